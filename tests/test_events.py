"""Why a lookup misses (``Store.explain``, ``lmctl lookup --explain``) and the event log behind
it (``Store.events``, ``lmctl events``): each reason made by a real scenario on a real store."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import flip_byte
from redis_server import secret_file
from test_daemon import Daemon, cj, cli, tokens_file
from test_reliability import small_disk  # noqa: F401 - a fixture

from engine_hook import KVCacheClient
from engine_hook.transfer import ChunkWriter, StagingPool
from store import (
    AdapterIdentity,
    KVFormat,
    MiB,
    Namespace,
    PutItem,
    Store,
    StoreConfig,
    StoreError,
    TierConfig,
    open_shared,
    release_shared,
)
from store.config import RemoteConfig

FMT = KVFormat("float32", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=16)
CIVIL_V1 = AdapterIdentity("civil", "1" * 32)
CIVIL_V2 = AdapterIdentity("civil", "2" * 32)
LEGAL = AdapterIdentity("legal", "3" * 32)


def doc(n: int, chunks: int = 4) -> list[int]:
    """A document of ``chunks`` full chunks, its tokens unlike any other document's."""
    return [1000 * n + i for i in range(FMT.chunk_size * chunks)]


def kv(tokens: list[int], fmt: KVFormat = FMT) -> torch.Tensor:
    return torch.randn(fmt.num_layers, 2, len(tokens), fmt.num_kv_heads, fmt.head_dim)


def cfg(**kw: Any) -> StoreConfig:
    return StoreConfig(tiers={"nvme": TierConfig(capacity=kw.pop("capacity", 256 * MiB))}, segment_bytes=1 * MiB,
                       **kw)


def reason(store: Store, ns: Namespace, tokens: list[int]) -> str:
    ex = store.explain(ns, tokens)
    assert ex is not None
    return ex.reason


def test_each_other_namespace_reason_from_chunks_an_engine_saved(tmp_path: Path) -> None:
    """Chunks saved through the engine API (which stores each chunk's prefix id) under one
    adapter, salt, checkpoint or KV format are found, and named, from a lookup in another."""
    path = tmp_path / "store"
    Store(path, cfg()).close()
    tp2 = KVFormat("float32", num_layers=1, num_kv_heads=1, head_dim=8, tp_size=2, tp_rank=0, chunk_size=16)
    new = KVCacheClient(path, "m", FMT, model_fingerprint="fp-new")
    old = KVCacheClient(path, "m", FMT, model_fingerprint="fp-old")
    wide = KVCacheClient(path, "m", tp2, model_fingerprint="fp-new")
    try:
        assert new.save(doc(1), kv(doc(1)), adapter=CIVIL_V1) == 4
        assert new.save(doc(2), kv(doc(2)), cache_salt="tenant-a") == 4
        assert old.save(doc(3), kv(doc(3))) == 4
        assert wide.save(doc(4), kv(doc(4), tp2)) == 4
        assert new.flush(30) and old.flush(30) and wide.flush(30)
        store = new.store

        def ns(adapter: AdapterIdentity | None = None, salt: str | None = None) -> Namespace:
            return Namespace("m", FMT, adapter, salt, "fp-new")

        assert store.explain(ns(CIVIL_V1), doc(1)) is None  # all of it hits: nothing to explain
        ex = store.explain(ns(CIVIL_V2), doc(1))
        assert ex is not None and ex.reason == "other-adapter-version" and ex.chunk == 0 and ex.token == 0
        assert str(CIVIL_V1) in ex.message and ex.details["holder"]["namespace"]["adapter"] == str(CIVIL_V1)
        ex = store.explain(ns(LEGAL), doc(1))
        assert ex is not None and ex.reason == "other-adapter" and str(CIVIL_V1) in ex.message
        assert reason(store, ns(), doc(1)) == "other-adapter"  # the base model asks
        assert reason(store, ns(), doc(2)) == "other-salt"  # unsalted asks what only a salt has
        ex = store.explain(ns(salt="tenant-b"), doc(2))
        assert ex is not None and ex.reason == "other-salt"
        assert "tenant" not in ex.message and "tenant" not in json.dumps(ex.to_dict())  # salts are never shown
        ex = store.explain(ns(), doc(3))
        assert ex is not None and ex.reason == "other-model-fingerprint" and "fp-old" in ex.message
        ex = store.explain(ns(), doc(4))
        assert ex is not None and ex.reason == "other-kv-format" and "tp_size 2 (asked 1)" in ex.message
        assert reason(store, ns(), doc(5)) == "never-stored"
        # the first missing chunk is the one explained: a document that shares two chunks
        mixed = doc(1)[:32] + doc(6, 2)
        ex = store.explain(ns(CIVIL_V1), mixed)
        assert ex is not None and ex.chunk == 2 and ex.token == 32 and ex.reason == "never-stored"
    finally:
        for c in (new, old, wide):
            c.close()


def test_prefix_rows_follow_the_chunk_through_moves_and_go_with_it(tmp_path: Path) -> None:
    """A recompressed (rewritten) or compacted chunk still tells explain where it is; an
    evicted one no longer claims the prefix."""
    with Store(tmp_path / "s", cfg()) as s:
        toks = doc(1, 2)
        held = Namespace("m", FMT, CIVIL_V1)
        asked = Namespace("m", FMT, CIVIL_V2)
        keys = held.chunk_keys(toks)
        items = [PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "float32"}, 16, prefix=p)
                 for k, p in zip(keys, s.prefix_ids(toks, 16), strict=True)]
        assert s.put_many(items) == [True, True]
        s.register_namespace(held)
        s.register_namespace(asked)
        assert reason(s, asked, toks) == "other-adapter-version"
        assert s.rewrite(keys, codec="zstd").chunks == 2
        s.compact(min_dead_ratio=0.0)
        assert reason(s, asked, toks) == "other-adapter-version"
        s.evict(keys)
        assert reason(s, asked, toks) == "never-stored"  # the asked key itself has no event
        assert reason(s, held, toks) == "evicted"


def test_eviction_under_capacity_pressure_is_explained_and_counted(tmp_path: Path) -> None:
    fmt = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=1 << 16, chunk_size=16)  # 2 MiB chunks
    ns = Namespace("m", fmt)
    with Store(tmp_path / "s", cfg(capacity=16 * MiB)) as s:
        first = list(range(16 * 2))
        s.put_many([PutItem(k, os.urandom(fmt.chunk_bytes), {"dtype": "uint8"}, 16, prefix=p)
                    for k, p in zip(ns.chunk_keys(first), s.prefix_ids(first, 16), strict=True)])
        for i in range(10):  # more documents than fit: the first is the least recently used
            toks = [10_000 + 100 * i + j for j in range(16)]
            s.put_many([PutItem(ns.chunk_keys(toks)[0], os.urandom(fmt.chunk_bytes), {"dtype": "uint8"}, 16)])
        ex = s.explain(ns, first)
        assert ex is not None and ex.reason == "evicted" and ex.chunk == 0
        assert "least recently used" in ex.message and "tier nvme" in ex.message
        assert ex.details["event"]["reason"] == "lru" and ex.details["event"]["tier"] == "nvme"
        evicted = s.stats().counters["evicted"]
        assert evicted >= 2
        assert s.event_counters()["evictions_total"] == {"lru": evicted}
        assert {e["reason"] for e in s.events(kinds=["evict"])} == {"lru"}
        assert sum(e["chunks"] for e in s.events(kinds=["evict"])) == evicted


def test_a_corrupt_chunk_found_by_a_read_is_explained(tmp_path: Path) -> None:
    ns = Namespace("m", FMT)
    with Store(tmp_path / "s", cfg()) as s:
        toks = doc(1, 2)
        keys = ns.chunk_keys(toks)
        s.put_many([PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "float32"}, 16, prefix=p)
                    for k, p in zip(keys, s.prefix_ids(toks, 16), strict=True)])
        flip_byte(s, keys[1])
        assert s.get(keys[1]) is None  # the read finds it and drops it
        ex = s.explain(ns, toks)
        assert ex is not None and ex.reason == "corrupt" and ex.chunk == 1
        assert "failed verification" in ex.message and "checksum" in ex.details["event"]["detail"]
        assert s.event_counters()["corrupt_total"] == {"bad-record": 1}


def test_saves_dropped_by_a_full_queue_are_logged_in_one_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer is held (a slow disk): with one save buffer beside the one being written,
    the later chunks of a document are dropped; they reach the event log in one transaction."""
    path = tmp_path / "store"
    Store(path, cfg()).close()
    client = KVCacheClient(path, "m", FMT, save_buffers=1)
    try:
        store = client.store
        gate = threading.Event()
        real = store.put_many

        def held(*a: Any, **kw: Any) -> list[bool]:
            assert gate.wait(30)
            return real(*a, **kw)

        monkeypatch.setattr(store, "put_many", held)
        logged: list[int] = []  # per call of record_dropped_saves: the transactions it made
        real_log, real_transact = store.record_dropped_saves, store._index.transact
        writes = [0]

        def counted() -> Any:
            writes[0] += 1
            return real_transact()

        def log_drops(*a: Any, **kw: Any) -> None:
            before = writes[0]
            real_log(*a, **kw)
            logged.append(writes[0] - before)

        monkeypatch.setattr(store._index, "transact", counted)
        monkeypatch.setattr(store, "record_dropped_saves", log_drops)
        toks = doc(1, 6)
        assert client.save(toks, kv(toks)) == 2  # two buffers; four chunks dropped
        gate.set()
        assert client.flush(30)
        monkeypatch.undo()
        ns = client.namespace()
        ex = store.explain(ns, toks)
        assert ex is not None and ex.reason == "save-dropped" and ex.chunk == 2 and "queue was full" in ex.message
        dropped = store.events(kinds=["save-dropped"])
        assert [(e["reason"], e["chunks"]) for e in dropped] == [("queue-full", 4)]
        assert store.event_counters()["saves_dropped_total"] == {"queue-full": 4}
        assert logged == [1]  # all four drops in one transaction
    finally:
        client.close()


def test_saves_dropped_by_a_full_disk_are_explained(small_disk: Path, tmp_path: Path) -> None:  # noqa: F811
    """The tier's disk fills up under the writer: the chunk is dropped with reason disk-full
    (the index lives on another disk, so the drop can be logged)."""
    fmt = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=1 << 16, chunk_size=16)  # 2 MiB chunks
    ns = Namespace("m", fmt)
    path = tmp_path / "store"
    s = open_shared(path, StoreConfig(tiers={"nvme": TierConfig(capacity=320 * MiB, path=str(small_disk / "nvme"))},
                                      segment_bytes=16 * MiB))
    try:
        with open(small_disk / "filler", "wb", buffering=0) as f:  # another program fills the disk
            try:
                while True:
                    f.write(bytes(1 << 20))
            except OSError:
                pass
        pool = StagingPool(fmt.chunk_bytes, 2)
        writer = ChunkWriter(s, pool)
        toks = list(range(16))
        key = ns.chunk_keys(toks)[0]
        buf = pool.acquire()
        assert buf is not None
        writer.submit(key, buf, {"dtype": "uint8"}, 16, s.prefix_ids(toks, 16)[0])
        assert writer.flush(30)
        writer.close()
        assert writer.stats.failed == 1
        ex = s.explain(ns, toks)
        assert ex is not None and ex.reason == "save-dropped" and "disk was full" in ex.message
        assert s.event_counters()["saves_dropped_total"] == {"disk-full": 1}
    finally:
        release_shared(s)


def test_remote_unavailable_when_the_server_is_stopped(tmp_path: Path, servers: Any) -> None:
    redis = servers()
    ns = Namespace("m", FMT)
    conf = cfg(remote=RemoteConfig(redis.url, key_prefix="t", write="always", lookup_timeout_s=0.2,
                                   secret_file=str(secret_file(tmp_path))))
    with Store(tmp_path / "s", conf) as s:
        toks = doc(1, 2)
        keys = ns.chunk_keys(toks)
        s.put_many([PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "float32"}, 16, prefix=p)
                    for k, p in zip(keys, s.prefix_ids(toks, 16), strict=True)])
        s.evict(keys)  # only the remote tier has them now
        assert s.lookup(ns, toks).hit_chunks == 2
        redis.stop()
        assert s.lookup(ns, toks).hit_chunks == 0
        ex = s.explain(ns, toks)
        assert ex is not None and ex.reason == "remote-unavailable" and "does not answer" in ex.message
        assert "evicted" in ex.message  # and what the log says of the local copy
        assert ex.details["remote"]["url"].startswith("redis://127.0.0.1")


def test_the_log_keeps_its_bound_and_the_counters_survive_it_and_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with Store(path, cfg(event_log_max=20)) as s:
        key = Namespace("m", FMT).chunk_keys(doc(1, 1))[0]
        for i in range(50):
            s.pin(f"label-{i}", [key], uid=1234)
        assert len(s.events(limit=0)) == 20
        assert [e["label"] for e in s.events(limit=0)] == [f"label-{i}" for i in range(30, 50)]  # oldest went first
        assert s.events(limit=3)[-1]["uid"] == 1234 and len(s.events(limit=3)) == 3
        # one eviction naming more chunks than the log may name (16 per event) pushes out older events
        ns = Namespace("m", FMT, LEGAL)
        toks = doc(2, 400)
        keys = ns.chunk_keys(toks)
        s.put_many([PutItem(k, b"\0" * FMT.chunk_bytes, {"dtype": "float32"}, 16) for k in keys])
        assert s.evict(keys).chunks == 400
        kept = s.events(limit=0)
        assert kept[-1]["kind"] == "evict" and kept[-1]["chunks"] == 400 and len(kept) <= 20
        assert s.explain(ns, toks) is not None
    with Store(path) as again:  # a restart keeps events and counters
        kept2 = again.events(limit=0)
        assert kept2 == kept
        assert again.event_counters()["pins_total"] == {"operator": 50}
        assert again.event_counters()["evictions_total"] == {"operator": 400}
        assert again.events(since=time.time() + 60) == []
        with pytest.raises(Exception, match="unknown event kind"):
            again.events(kinds=["nope"])
        # a smaller bound drops the oldest events at once, not at the next event (here all but
        # the newest: it names 320 chunks, more than 2 events may name)
        smaller = StoreConfig.from_json(again.config.to_json())
        smaller.event_log_max = 2
        again.configure(smaller)
        assert again.events(limit=0) == kept2[-1:]
        assert again.event_counters()["pins_total"] == {"operator": 50}  # totals outlive the log
        smaller.event_log_max = 10**8
        with pytest.raises(StoreError, match="event_log_max must be a whole number of events, 1 to"):
            again.configure(smaller)


def test_event_writes_ride_in_the_transactions_that_make_the_change(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Storing chunks with their prefix ids, evicting and pinning cost no transaction more
    than they did before the event log."""
    ns = Namespace("m", FMT)
    with Store(tmp_path / "s", cfg()) as s:
        count = [0]
        real = s._index.transact

        def counted() -> Any:
            count[0] += 1
            return real()

        monkeypatch.setattr(s._index, "transact", counted)
        toks = doc(1, 4)
        keys = ns.chunk_keys(toks)
        s.put_many([PutItem(k, b"\0" * FMT.chunk_bytes, {"dtype": "float32"}, 16, prefix=p)
                    for k, p in zip(keys, s.prefix_ids(toks, 16), strict=True)])
        after_put = count[0]
        s.put_many([PutItem(k, b"\0" * FMT.chunk_bytes, {"dtype": "float32"}, 16)
                    for k in Namespace("m", FMT, LEGAL).chunk_keys(toks)])
        assert count[0] - after_put == after_put  # the same with and without prefix ids
        before = count[0]
        s.evict(keys[:2])
        s.pin("l", keys[2:])
        assert count[0] - before == 2
        assert [e["kind"] for e in s.events()] == ["evict", "pin"]


# -- through the CLI, against a real daemon ------------------------------------------------------
def _adapter_store(path: Path) -> list[int]:
    """A store whose engine recorded model m for the base model and two adapters, and saved a
    document (with prefix ids) for adapter civil@v1 only."""
    toks = doc(7, 3)
    with Store(path, cfg()) as s:
        for a in (None, CIVIL_V1, LEGAL):
            s.register_namespace(Namespace("m", FMT, a), {"model_id": "m"})
        held = Namespace("m", FMT, CIVIL_V1)
        s.put_many([PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "float32"}, 16, prefix=p)
                    for k, p in zip(held.chunk_keys(toks), s.prefix_ids(toks, 16), strict=True)])
    return toks


def test_lookup_explain_and_events_through_the_cli(tmp_path: Path) -> None:
    toks = _adapter_store(tmp_path / "store")
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        f = tokens_file(tmp_path, toks)
        r = cj(d, "lookup", "--tokens", f, "--adapter", "legal", "--explain")
        assert r["hit_tokens"] == 0 and r["explain"]["reason"] == "other-adapter"
        assert r["explain"]["chunk"] == 0 and r["explain"]["holder"]["namespace"]["adapter"] == str(CIVIL_V1)
        human = cli(d, "lookup", "--tokens", f, "--base", "--explain")
        assert human.returncode == 0 and "why: other-adapter: chunk 0 (tokens 0-15) misses" in human.stdout
        assert str(CIVIL_V1) in human.stdout
        assert cj(d, "lookup", "--tokens", f, "--adapter", "civil", "--explain")["explain"] is None
        short = tokens_file(tmp_path, toks[:10], "short.json")  # no full chunk: nothing can miss
        human = cli(d, "lookup", "--tokens", short, "--adapter", "civil", "--explain")
        assert human.stdout.startswith("the document's 10 token(s) are less than one chunk of 16: nothing of it is "
                                       "stored") and "nothing misses" not in human.stdout
        assert "explain" not in cj(d, "lookup", "--tokens", f, "--adapter", "civil")
        # an operator evicts the middle chunk and pins the document: both logged with the uid
        key = Namespace("m", FMT, CIVIL_V1).chunk_keys(toks)[1].hex()
        assert cli(d, "evict", "--key", key).returncode == 0
        assert cli(d, "pin", "--label", "docs", "--tokens", f, "--adapter", "civil").returncode == 0
        r = cj(d, "lookup", "--tokens", f, "--adapter", "civil", "--explain")
        assert r["hit_chunks"] == 1 and r["explain"]["reason"] == "evicted"
        assert r["explain"]["event"]["uid"] == os.getuid() and "an operator evicted it" in r["explain"]["message"]
        ev = cj(d, "events", "--since", "1h")
        assert [(e["kind"], e["reason"], e["chunks"]) for e in ev["events"]] == [("evict", "operator", 1),
                                                                               ("pin", "operator", 3)]
        assert ev["events"][1]["uid"] == os.getuid() and ev["events"][1]["label"] == "docs"
        assert ev["counters"]["evictions_total"] == {"operator": 1}
        assert [e["kind"] for e in cj(d, "events", "--kind", "pin")["events"]] == ["pin"]
        shown = cli(d, "events", "--limit", "1")
        assert shown.returncode == 0 and "pin" in shown.stdout and "label docs" in shown.stdout
        assert "evictions_total operator=1" in shown.stdout
        # bad input: one line, exit 2, the daemon carries on
        for argv in (["events", "--kind", "bogus"], ["events", "--since", "soon"],
                     ["lookup", "--key", key, "--explain"]):
            bad = cli(d, *argv)
            assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert d.stop() == 0
        d.start()  # the log survives a restart of the daemon
        again = cj(d, "events")
        assert [(e["kind"], e["reason"]) for e in again["events"]] == [("evict", "operator"), ("pin", "operator")]
        r = cj(d, "lookup", "--tokens", f, "--adapter", "civil", "--explain")
        assert r["explain"]["reason"] == "evicted"
    finally:
        if d.proc is not None:
            d.stop()


def test_event_log_max_is_a_store_setting() -> None:
    from lmctl.settings import apply_settings

    assert apply_settings(StoreConfig(), {"event_log_max": "500"}).event_log_max == 500
    assert apply_settings(StoreConfig(), {"event_log_max": "9999999"}).event_log_max == 9999999
    for bad in ("0", "many", "1.5", "99999999999999999999999", 10**40, "nan"):
        with pytest.raises(Exception, match="event_log_max"):
            apply_settings(StoreConfig(), {"event_log_max": bad})


def test_a_chunk_moved_to_a_remote_tier_the_store_no_longer_has(tmp_path: Path, servers: Any) -> None:
    """Explain says what is known: the chunk went to a remote tier the settings no longer name,
    not that the server dropped it."""
    redis = servers()
    ns = Namespace("m", FMT)
    with Store(tmp_path / "s", cfg(remote=RemoteConfig(redis.url, key_prefix="t", write="never",
                                                                 secret_file=str(secret_file(tmp_path))))) as s:
        toks = doc(3, 1)
        keys = ns.chunk_keys(toks)
        s.put_many([PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "float32"}, 16, prefix=p)
                    for k, p in zip(keys, s.prefix_ids(toks, 16), strict=True)])
        assert s.rewrite(keys, tier="remote").chunks == 1
        local = StoreConfig.from_json(s.config.to_json())
        local.remote = None
        s.configure(local)
        ex = s.explain(ns, toks)
        assert ex is not None and ex.reason == "evicted"
        assert "moved to the remote tier" in ex.message and "no longer has in its settings" in ex.message
