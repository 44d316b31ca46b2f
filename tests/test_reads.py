"""Bounded, exact reads: the lengths a record claims are checked against what the reader
expects before anything is allocated; a mismatch is a miss with a reason, never an exception
into an engine and never the previous chunk's KV."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_FMT, content, env_with_path, key

from engine_hook.api import KVCacheClient
from engine_hook.config import ConnectorSettings
from engine_hook.context import ConnectorContext
from engine_hook.ops import LoadOp, SaveOp
from engine_hook.worker import LMCtlConnectorWorker
from store import KVFormat, Namespace, Store
from store.format.record import ALIGN, decode_trailer, encode_trailer, record_len
from store.index import Entry

CHUNK = SMALL_FMT.chunk_bytes
GIB16 = (16 << 30) - 2 * ALIGN  # the largest claim an index entry's own check lets through (record < 16 GiB)


def forge(store: Store, k: bytes, raw_len: int, stored_len: int | None = None) -> None:
    """Make ``k``'s index entry claim ``raw_len`` raw bytes (what damage, or a bug, could do;
    the record on disk is left as it is)."""
    idx = store._index

    def fn(t: Any) -> None:
        e = Entry.unpack(t.raw.get(k, db=idx.chunks))
        e.raw_len = raw_len
        e.stored_len = raw_len if stored_len is None else stored_len
        e.rec_len = record_len(e.stored_len)
        t.raw.put(k, e.pack(), db=idx.chunks)

    idx.write(fn)


def read_failures(store: Store) -> dict[str, int]:
    store.flush()
    return {c.labels["reason"]: int(c.value) for c in store.metric_cells() if c.name == "read_failures_total"}


# -- the store ------------------------------------------------------------------------------
def test_a_claim_under_the_cap_allocates_nothing_before_the_trailer_agrees(store: Store) -> None:
    """512 MiB claimed by a damaged entry: the reader checks the record's trailer on disk
    first (today it allocated and zeroed 512 MiB, then found a short read)."""
    k = key(1)
    assert store.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    forge(store, k, 512 << 20)
    tracemalloc.start()
    try:
        assert store.get(k) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated for a forged claim"
    assert not store.contains(k)
    assert store.event_counters()["corrupt_total"] == {"bad-record": 1}
    assert read_failures(store) == {"bad-record": 1}


@pytest.mark.parametrize("registered", [False, True])
def test_a_16_gib_claim_allocates_nothing(tmp_path: Path, registered: bool) -> None:
    """In a child whose address space leaves no room for 16 GiB: ``get`` and ``get_into``
    of a chunk whose entry claims 16 GiB are misses that allocate nothing (today ``get``
    raises MemoryError there, and allocates and zeroes 16 GiB where memory allows; ``get_into``
    raises StoreError)."""
    code = f"""
import resource, tracemalloc
from store import KVFormat, Namespace, Store
from store.format.record import record_len
from store.index import Entry
fmt = KVFormat("bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, chunk_size=16)
ns = Namespace("m", fmt)
s = Store({str(tmp_path / 'store')!r})
k = ns.chunk_keys(list(range(16)))[0]
if {registered}:
    s.register_namespace(ns)
assert s.put(k, bytes(fmt.chunk_bytes), {{"dtype": "uint8"}}, tokens=16)
def fn(t):
    e = Entry.unpack(t.raw.get(k, db=s._index.chunks))
    e.raw_len = e.stored_len = {GIB16}
    e.rec_len = record_len(e.stored_len)
    t.raw.put(k, e.pack(), db=s._index.chunks)
s._index.write(fn)
with open("/proc/self/statm") as f:
    vsz = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vsz + (1 << 30), resource.RLIM_INFINITY))
tracemalloc.start()
out = bytearray(fmt.chunk_bytes)
assert s.get_into(k, out) is None
assert s.get(k) is None
peak = tracemalloc.get_traced_memory()[1]
print(peak, s.contains(k), sorted(s.event_counters()["corrupt_total"].items()))
s.close()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_path(),
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    peak, kept, counted = r.stdout.split(maxsplit=2)
    assert int(peak) < 4 << 20
    if registered:  # larger than its namespace's chunk: the entry is wrong, dropped and counted
        assert kept == "False" and counted.strip() == "[('bad-length', 1)]"
    else:  # no namespace record says what it should hold: larger than the reader takes, kept
        assert kept == "True" and counted.strip() == "[]"


def test_a_chunk_of_another_length_than_expected_is_a_miss_dropped_and_counted(store: Store) -> None:
    a, b = key(1), key(2)
    for k in (a, b):
        assert store.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    out = np.zeros(2 * CHUNK, dtype=np.uint8)  # numpy's stubs make ndarray a Buffer only on 3.12+: the ignores
    assert store.get_into(a, out, expect=CHUNK) is not None  # type: ignore[arg-type]
    assert out[:CHUNK].tobytes() == content(a, CHUNK)
    # not what the caller knows it holds
    assert store.get_into(a, out, expect=CHUNK + ALIGN) is None  # type: ignore[arg-type]
    assert not store.contains(a)
    assert store.get(b, expect=CHUNK // 2) is None and not store.contains(b)
    assert store.event_counters()["corrupt_total"] == {"bad-length": 2}
    assert read_failures(store) == {"bad-length": 2}


def test_a_chunk_larger_than_its_namespace_chunk_is_dropped(store: Store) -> None:
    ns = Namespace("m", SMALL_FMT)
    store.register_namespace(ns)
    big, fine = ns.chunk_keys(list(range(32)))
    assert store.put(big, content(big, 2 * CHUNK), {"dtype": "uint8"}, tokens=16)
    assert store.put(fine, content(fine, CHUNK), {"dtype": "uint8"}, tokens=16)
    assert store.get(big) is None and not store.contains(big)
    c = store.get(fine)
    assert c is not None and bytes(c.data) == content(fine, CHUNK)


def test_stored_and_raw_lengths_that_no_codec_makes_are_refused(store: Store) -> None:
    k = key(3)
    assert store.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16, codec="zstd")
    forge(store, k, CHUNK, stored_len=64 * CHUNK)  # more stored bytes than zstd ever writes for it
    assert store.get(k) is None and not store.contains(k)
    assert store.event_counters()["corrupt_total"] == {"bad-length": 1}


def test_a_trailer_that_claims_impossible_lengths_is_not_a_trailer() -> None:
    good = encode_trailer(key(1), 0, {}, 4096, 4096, 0, 0.0)
    assert decode_trailer(good) is not None
    for stored, raw, codec in ((4096, 1 << 40, 0), (1 << 40, 4096, 1), (8192, 4096, 0)):
        assert decode_trailer(encode_trailer(key(1), codec, {}, stored, raw, 0, 0.0)) is None


def test_a_remote_chunk_of_another_length_is_a_miss(tmp_path: Path, servers: Callable[..., Any]) -> None:
    """Read through the remote tier: a chunk of other lengths than the reader's is a miss (today
    a buffer smaller than the chunk raises StoreError)."""
    from redis_server import secret_file

    from store import MiB, StoreConfig, TierConfig
    from store.config import RemoteConfig

    redis = servers()
    secret = str(secret_file(tmp_path))

    def host(name: str) -> Store:
        return Store(tmp_path / name, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)},
                                                  remote=RemoteConfig(redis.url, key_prefix="t", write="always",
                                                                      secret_file=secret)))

    a, b = host("a"), host("b")
    try:
        k = key(5)
        assert a.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
        assert b.get_into(k, bytearray(CHUNK // 2)) is None
        assert b.get_into(k, bytearray(2 * CHUNK), expect=2 * CHUNK) is None
        assert b.get(k, expect=CHUNK // 2) is None
        assert not b.contains(k)  # nothing promoted
        out = bytearray(CHUNK)
        assert b.get_into(k, out, expect=CHUNK) is not None and bytes(out) == content(k, CHUNK)
    finally:
        a.close()
        b.close()


# -- the engine side ------------------------------------------------------------------------
FMT = KVFormat("float32", num_layers=3, num_kv_heads=2, head_dim=8, chunk_size=32)
BS = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(FMT.num_layers)]
PROMPT = list(range(100, 164))  # two full chunks


@pytest.fixture
def worker(tmp_path: Path) -> Any:
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "store"), "chunk_size": FMT.chunk_size,
                                        "model_fingerprint": "off", "save_queue": 2})
    w = LMCtlConnectorWorker(ConnectorContext(settings, "m", FMT, LAYERS, BS, None, None, {"engine": "test"}))
    yield w
    w.close()


def kv_caches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(12, FMT.num_kv_heads, BS, 2 * FMT.head_dim, generator=g) for n in LAYERS}


@pytest.mark.parametrize("short", [FMT.chunk_bytes // 2, FMT.chunk_bytes - ALIGN])
def test_a_short_chunk_never_leaves_the_previous_chunks_kv_in_the_engine(
        worker: LMCtlConnectorWorker, short: int) -> None:
    """A chunk of fewer bytes than the chunk size, after a normal one: today its read
    "succeeds" and its blocks get its bytes followed by the rest of the previous chunk's KV
    from the staging buffer. Now it is a miss and vLLM recomputes it."""
    caches = kv_caches()
    worker.register_kv_caches(caches)
    first, second = Namespace("m", FMT).chunk_keys(PROMPT)
    worker.save([SaveOp("r1", first, [0, 1])])
    assert worker.flush(10)
    # a value of the right key but too short (a bug in another writer, a forged record)
    assert worker.store.put(second, content(second, short), {"dtype": "float32"}, tokens=FMT.chunk_size)
    before = {n: t[[6, 7]].clone() for n, t in caches.items()}
    worker.load([LoadOp("r2", [first, second], [[4, 5], [6, 7]])])
    assert worker.wait_loads(30) and worker.take_finished() == {"r2"}
    assert worker.take_load_errors() == {6, 7}
    assert all(torch.equal(t[[4, 5]], t[[0, 1]]) for t in caches.values())
    assert all(torch.equal(caches[n][[6, 7]], before[n]) for n in LAYERS)  # nothing half-written
    assert worker.loaded_chunks == 1 and worker.failed_loads == 1
    assert not worker.store.contains(second)
    assert worker.store.event_counters()["corrupt_total"] == {"bad-length": 1}


def test_the_worker_checks_every_read_against_the_chunk_size_itself(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a store returns (here one that ignores ``expect``), the worker compares the
    bytes read with the chunk size before the staging buffer goes into the engine."""
    caches = kv_caches()
    worker.register_kv_caches(caches)
    first, second = Namespace("m", FMT).chunk_keys(PROMPT)
    worker.save([SaveOp("r1", first, [0, 1])])
    assert worker.flush(10)
    assert worker.store.put(second, content(second, FMT.chunk_bytes // 2), {"dtype": "float32"}, tokens=32)
    real = worker.store.get_many_into
    monkeypatch.setattr(worker.store, "get_many_into", lambda keys, outs, *a, **kw: real(keys, outs))
    before = {n: t[[6, 7]].clone() for n, t in caches.items()}
    worker.take_stats()
    worker.load([LoadOp("r2", [first, second], [[4, 5], [6, 7]])])
    assert worker.wait_loads(30) and worker.take_finished() == {"r2"}
    assert worker.take_load_errors() == {6, 7}
    assert all(torch.equal(caches[n][[6, 7]], before[n]) for n in LAYERS)
    report = worker.take_stats()
    assert report is not None and report["counters"]["failed_loads"] == {"bad_length": 1}


def client_with(tmp_path: Path, size: int) -> tuple[KVCacheClient, list[int], torch.Tensor]:
    """A client whose prompt has two chunks: the first saved by it, the second put with ``size`` bytes."""
    c = KVCacheClient(tmp_path / "s", "m", FMT)
    toks = list(range(64))
    kv = torch.randn(FMT.num_layers, 2, 64, FMT.num_kv_heads, FMT.head_dim)
    assert c.save(toks[:32], kv[:, :, :32]) == 1 and c.flush(10)
    second = c.namespace().chunk_keys(toks)[1]
    assert c.store.put(second, content(second, size), {"dtype": "float32"}, tokens=32)
    return c, toks, kv


@pytest.mark.parametrize("size", [2 * FMT.chunk_bytes, FMT.chunk_bytes // 2])
def test_client_load_stops_at_a_chunk_of_the_wrong_length_and_never_raises(tmp_path: Path, size: int) -> None:
    """Longer than the buffer: today ``load`` raises StoreError; shorter: today it returns the
    chunk with the previous chunk's KV after its bytes."""
    c, toks, kv = client_with(tmp_path, size)
    try:
        hit = c.load(toks)
        assert hit.chunks == 1 and torch.equal(hit.kv, kv[:, :, :32])
    finally:
        c.close()


def test_client_load_never_raises_whatever_the_store_does(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    c, toks, kv = client_with(tmp_path, FMT.chunk_bytes)
    try:
        calls: list[int] = []

        def broken(*args: Any, **kw: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise OSError("injected fault")
            return real(*args, **kw)

        real: Callable[..., Any] = c.store.get_into
        monkeypatch.setattr(c.store, "get_into", broken)
        assert c.load(toks).chunks == 1
    finally:
        c.close()
