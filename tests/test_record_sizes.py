"""Every size, every path: records from 1 byte to 64 MiB, raw and compressed, through every
path that reads or writes a record, each checked byte for byte.

Sizes are drawn mostly just around the store's internal piece sizes (the 4 KiB alignment, the
codec's 1 MiB pieces, the 2 MiB read pieces, the remote tier's 4 MiB pieces, the 8 MiB write
pieces, a 32 MiB chunk of an 8B model and the 64 MiB top), plus any size at all. Payloads
are bf16-like KV (compresses to an unaligned length) or noise (a compressed length just past
the raw one), taken from page-aligned or unaligned source buffers.

The local paths (put, get, get_into, re-encode, compress, move between dram and nvme, the
spill of a full dram tier to nvme, reopen, compaction, the rebuild of a lost index, the deep
check) run on one store per example; the remote paths (put through ``write = "always"``,
a read that promotes into another store, ``get`` and ``get_into`` from the remote tier,
``move --to remote``, the push of chunks evicted with ``write = "evict"``) on stores of one
deployment on a real redis-server, with a secret, the pieces encrypted or not.
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from store import MiB, PutItem, Store, StoreConfig, TierConfig
from store.config import GiB, RemoteConfig
from store.format.codec import FRAME_RAW
from store.format.record import ALIGN
from store.format.segment import READ_SPAN, WRITE_SPAN
from store.tiers.remote import PIECE_BYTES as REMOTE_PIECE

#: the largest record drawn
MAX = 64 * MiB
#: the sizes whose neighbourhoods are drawn most: every internal piece size and then some
BOUNDARIES = sorted({ALIGN, 2 * ALIGN, FRAME_RAW, READ_SPAN, 3 * MiB, REMOTE_PIECE, WRITE_SPAN, 12 * MiB, 16 * MiB,
                     32 * MiB, MAX})
DELTAS = (-4097, -4096, -4095, -513, -17, -2, -1, 0, 1, 2, 17, 513, 4095, 4096, 4097)
CODECS = ("raw", "zstd", "zstd-shuffle")

near_boundary = st.builds(lambda b, d: min(MAX, max(1, b + d)), st.sampled_from(BOUNDARIES), st.sampled_from(DELTAS))
#: boundaries twice as likely as small sizes, as sizes anywhere up to 64 MiB and as sizes past
#: the 8 MiB write piece (integers() leans towards small numbers)
sizes = st.one_of(near_boundary, near_boundary, st.integers(1, 64 * 1024), st.integers(1, MAX),
                  st.integers(WRITE_SPAN + 1, MAX))
#: where a payload starts in its source buffer: page-aligned (O_DIRECT writes it without a
#: copy) or not (it goes through the staging ring)
offsets = st.sampled_from((0, 1, 2048 + 3))

_keys = itertools.count(1)


def new_key() -> bytes:
    return b"\x05" * 16 + next(_keys).to_bytes(8, "big") + os.urandom(24)


_SOURCES: dict[str, mmap.mmap] = {}


def source(kind: str) -> mmap.mmap:
    """A page-aligned buffer of ``MAX`` + 8 KiB bytes, made once: ``kv`` is bf16 values of a
    smooth activation-like distribution (zstd shrinks it to an unaligned length), ``noise``
    does not compress (its compressed length lies just past its raw one)."""
    buf = _SOURCES.get(kind)
    if buf is None:
        n = MAX + 2 * ALIGN
        buf = mmap.mmap(-1, n)
        rng = np.random.default_rng(19 if kind == "kv" else 20)
        if kind == "kv":
            f32 = (rng.standard_normal(n // 2, dtype=np.float32) * 0.5).view(np.uint32)
            np.frombuffer(buf, dtype=np.uint16)[:] = (f32 >> 16).astype(np.uint16)
        else:
            np.frombuffer(buf, dtype=np.uint8)[:] = rng.integers(0, 256, n, dtype=np.uint8)
        _SOURCES[kind] = buf
    return buf


def payload(kind: str, size: int, offset: int) -> memoryview:
    return memoryview(source(kind))[offset : offset + size]


def same(got: Any, want: memoryview) -> bool:
    a = np.frombuffer(memoryview(got).cast("B"), dtype=np.uint8)
    b = np.frombuffer(want, dtype=np.uint8)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def layout(dtype: str, size: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [size]}


def read_back(s: Store, k: bytes, want: memoryview, where: str, tier: str | None = None, how: str = "all") -> None:
    """``want`` comes back (from ``tier`` when given) through ``get`` (``how`` "get"),
    ``get_into`` a buffer of exactly the chunk (``expect`` given: "into"), or all of them
    and ``get_into`` a larger page-aligned buffer, which keeps its bytes past the chunk."""
    n = len(want)
    if how in ("all", "get"):
        c = s.get(k)
        assert c is not None, f"{where}: get missed a chunk of {n} bytes"
        assert same(c.data, want), f"{where}: get gave other bytes for a chunk of {n} bytes"
        assert tier is None or c.tier == tier, f"{where}: read from {c.tier}, not {tier}"
        del c
    if how in ("all", "into"):
        exact = bytearray(n)
        info = s.get_into(k, exact, expect=n)
        assert info is not None and info.raw_bytes == n, f"{where}: get_into missed a chunk of {n} bytes"
        assert same(exact, want), f"{where}: get_into gave other bytes for a chunk of {n} bytes"
        assert tier is None or info.tier == tier, f"{where}: read from {info.tier}, not {tier}"
        del exact
    if how == "all":
        roomy = mmap.mmap(-1, n + ALIGN)
        try:
            roomy[n : n + 16] = b"\xee" * 16
            info = s.get_into(k, roomy)
            assert info is not None, f"{where}: get_into (a larger buffer) missed a chunk of {n} bytes"
            view = memoryview(roomy)
            try:
                assert same(view[:n], want), f"{where}: get_into (a larger buffer) gave other bytes"
                assert roomy[n : n + 16] == b"\xee" * 16, f"{where}: get_into wrote past the chunk"
            finally:
                view.release()
        finally:
            roomy.close()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="lmctl-sizes-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def local_config(folder: Path, dram_capacity: int = 1 * GiB) -> StoreConfig:
    return StoreConfig(tiers={"nvme": TierConfig(capacity=4 * GiB),
                              "dram": TierConfig(capacity=dram_capacity, path=str(folder / "dram"))},
                       default_tier="nvme", segment_bytes=128 * MiB, fsync=False)


@settings(max_examples=32, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(size=sizes, codec=st.sampled_from(CODECS), kind=st.sampled_from(("kv", "noise")),
       dtype=st.sampled_from(("bfloat16", "uint8", "float32")), offset=offsets)
@example(size=1, codec="raw", kind="kv", dtype="uint8", offset=0)
@example(size=1, codec="zstd-shuffle", kind="kv", dtype="bfloat16", offset=1)
@example(size=WRITE_SPAN + 1, codec="zstd", kind="noise", dtype="uint8", offset=1)
@example(size=MAX, codec="zstd-shuffle", kind="kv", dtype="bfloat16", offset=0)
@example(size=MAX - 1, codec="raw", kind="kv", dtype="bfloat16", offset=2048 + 3)
def test_every_local_path_keeps_every_size(workdir: Path, size: int, codec: str, kind: str, dtype: str,
                                           offset: int) -> None:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    want = payload(kind, size, offset)
    k, filler = new_key(), new_key()
    other = "zstd-shuffle" if codec == "raw" else "raw"
    stores: list[Store] = []

    def reopen(cfg: StoreConfig | None = None) -> Store:
        if stores:
            stores[-1].close()
        stores.append(Store(folder / "store", cfg))
        return stores[-1]

    try:
        s = reopen(local_config(folder))
        # put, get, get_into
        assert s.put(k, want, layout(dtype, size), tokens=256, codec=codec)
        info = s.info(k)
        assert info is not None and info.raw_bytes == size and info.codec == codec
        if codec == "raw":
            assert info.stored_bytes == size
        elif kind == "kv" and size >= 64 * 1024:
            assert info.stored_bytes < size  # compression shrinks bf16 KV
        read_back(s, k, want, "put")
        # compress or decompress, then re-encode back (rewrite), at another level
        assert s.rewrite([k], codec=other, level=3).chunks == 1
        info = s.info(k)
        assert info is not None and info.codec == other
        read_back(s, k, want, f"rewrite to {other}", how="into")
        assert s.rewrite([k], codec=codec, level=None if codec == "raw" else 2).chunks == 1
        read_back(s, k, want, f"rewrite back to {codec}", how="get")
        # nvme -> dram, then a reopen (no kill: the store was closed)
        assert s.rewrite([k], tier="dram").chunks == 1
        read_back(s, k, want, "move to dram", tier="dram", how="into")
        s = reopen()
        read_back(s, k, want, "reopen", tier="dram", how="get")
        # dram -> nvme into a fresh segment after a filler that is then evicted: that segment
        # is partly dead once it is sealed (the reopen), so compaction moves the record
        assert s.put(filler, payload("kv", 4096, 0), layout("uint8", 4096), tokens=16)
        assert s.rewrite([k], tier="nvme").chunks == 1
        read_back(s, k, want, "move to nvme", tier="nvme", how="into")
        before = s.info(k)
        assert before is not None and before.codec == codec
        assert s.evict([filler]).chunks == 1
        s = reopen()
        moved = s.compact(tier="nvme", min_dead_ratio=0.0)
        assert moved.segments >= 1
        after = s.info(k)
        assert after is not None and (after.segment, after.offset) != (before.segment, before.offset)
        read_back(s, k, want, "compaction", tier="nvme")
        # dram full: its chunks spill down to nvme
        assert s.rewrite([k], tier="dram").chunks == 1
        s.configure(local_config(folder, dram_capacity=ALIGN))  # less than any chunk takes
        assert s.locate([k]) == ["nvme"], "a full dram tier dropped its chunk instead of moving it to nvme"
        read_back(s, k, want, "spill", tier="nvme", how="into")
        s.configure(local_config(folder))
        # the index lost: moved aside, the next open rebuilds it from the segment files
        s.close()
        os.rename(folder / "store" / "index", folder / "index.aside")
        s = reopen()
        read_back(s, k, want, "rebuilt index")
        assert s.rebuild_index() == 0  # nothing left to find
        assert s.check(deep=True) == []
    finally:
        for one in stores:
            one.close()
        shutil.rmtree(folder, ignore_errors=True)


# -- the remote tier -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(workdir: Path) -> Iterator[dict[str, Any]]:
    """A real redis-server on loopback and a deployment secret."""
    from redis_server import Server, secret_file

    redis = Server(workdir / "redis")
    try:
        redis.wait(redis.client)
        yield {"url": redis.url, "secret": str(secret_file(workdir)), "redis": redis}
    finally:
        redis.stop()


def remote_config(dep: dict[str, Any], write: str, encrypt: bool, capacity: int = 4 * GiB) -> StoreConfig:
    return StoreConfig(tiers={"nvme": TierConfig(capacity=capacity)}, segment_bytes=128 * MiB, fsync=False,
                       remote=RemoteConfig(dep["url"], key_prefix="sizes", write=write, secret_file=dep["secret"],
                                           encrypt=encrypt, io_timeout_s=30.0))


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(size=sizes, codec=st.sampled_from(CODECS), kind=st.sampled_from(("kv", "noise")),
       dtype=st.sampled_from(("bfloat16", "uint8")), offset=offsets, encrypt=st.booleans())
@example(size=1, codec="zstd", kind="kv", dtype="uint8", offset=1, encrypt=False)
@example(size=REMOTE_PIECE + 1, codec="raw", kind="noise", dtype="uint8", offset=0, encrypt=True)
@example(size=MAX, codec="zstd-shuffle", kind="kv", dtype="bfloat16", offset=0, encrypt=False)
def test_every_remote_path_keeps_every_size(workdir: Path, deployment: dict[str, Any], size: int, codec: str,
                                            kind: str, dtype: str, offset: int, encrypt: bool) -> None:
    folder = Path(tempfile.mkdtemp(dir=workdir))
    want = payload(kind, size, offset)
    k, k2 = new_key(), new_key()
    a = b = e = None
    try:
        a = Store(folder / "a", remote_config(deployment, "always", encrypt))
        b = Store(folder / "b", remote_config(deployment, "never", encrypt))
        # a put goes to the remote tier as stored (compressed by the writer's codec)
        assert a.put_many([PutItem(k, want, layout(dtype, size), 256, codec)]) == [True]
        remote = a.stats().remote
        assert remote is not None and remote["puts"] == 1 and remote["put_failures"] == 0
        assert b.locate([k]) == ["remote"]
        # get_into from the remote tier (into a larger buffer), promoted into b's nvme
        roomy = bytearray(size + 4097)
        info = b.get_into(k, roomy)
        assert info is not None and info.tier == "remote" and info.raw_bytes == size and info.codec == codec
        assert same(memoryview(roomy)[:size], want), "a remote get_into gave other bytes"
        assert b.locate([k], remote=False) == ["nvme"], "a remote hit was not promoted"
        read_back(b, k, want, "promoted", tier="nvme", how="get")
        # get from the remote tier (a new buffer of its size)
        assert b.evict([k]).chunks == 1
        c = b.get(k)
        assert c is not None and c.tier == "remote" and same(c.data, want), "a remote get gave other bytes"
        # move --to remote: the chunk goes raw, and is read back from there
        assert a.rewrite([k], tier="remote").chunks == 1
        assert a.locate([k], remote=False) == [None]
        assert b.evict([k]).chunks == 1
        exact = bytearray(size)
        info = b.get_into(k, exact, expect=size)
        assert info is not None and info.tier == "remote" and info.codec == "raw"
        assert same(exact, want), "a chunk moved to the remote tier came back with other bytes"
        read_back(b, k, want, "promoted after a move", tier="nvme", how="into")
        # write = "evict": the chunks eviction takes from the last local tier go to the
        # remote tier as stored (their bytes verified on the way out)
        e = Store(folder / "e", remote_config(deployment, "evict", encrypt))
        assert e.put_many([PutItem(k2, want, layout(dtype, size), 256, codec)]) == [True]
        e.configure(remote_config(deployment, "evict", encrypt, capacity=ALIGN))  # less than any chunk takes
        assert e.locate([k2], remote=False) == [None]
        c = b.get(k2)
        assert c is not None and c.tier == "remote" and same(c.data, want), "an evicted chunk came back other"
        assert a.check(deep=True) == [] and b.check(deep=True) == [] and e.check(deep=True) == []
    finally:
        for s in (a, b, e):
            if s is not None:
                s.close()
        deployment["redis"].client().flushdb()
        shutil.rmtree(folder, ignore_errors=True)
