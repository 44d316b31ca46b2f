"""The store: round trips, integrity, capacity, eviction, pins, restart, compaction."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from conftest import SMALL_FMT, SMALL_LAYOUT, content, flip_byte, key
from hypothesis import given, settings
from hypothesis import strategies as st

import store.format.codec as codec_mod
from store import (
    GiB,
    MiB,
    Namespace,
    PinBudgetError,
    PutItem,
    Store,
    StoreConfig,
    StoreError,
    TierConfig,
)
from store.clock import ManualClock
from store.format.codec import Codec, encoded_parts, shuffle, unshuffle
from store.format.segment import SegmentIO
from store.format.tensors import pack, unpack
from store.tiers.space import Space

MakeStore = Callable[..., Store]
CHUNK = SMALL_FMT.chunk_bytes  # 16 KiB


def fill(store: Store, n: int, size: int = CHUNK, start: int = 0) -> list[bytes]:
    keys = [key(i) for i in range(start, start + n)]
    for k in keys:
        assert store.put(k, content(k, size), {"dtype": "uint8"}, tokens=16)
    return keys


# -- codecs and dtypes -------------------------------------------------------------
@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd-shuffle"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_round_trip_every_codec_and_dtype(store: Store, codec: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    shape = (2, 2, 16, 2, 32)
    t = (torch.randn(shape, generator=g) * 3).to(dtype)  # fp8 too: vLLM's --kv-cache-dtype fp8 KV
    data, layout = pack(t)
    assert layout["dtype"] == str(dtype).removeprefix("torch.")
    k = key(hash((codec, str(dtype))) & 0xFFFF)
    assert store.put(k, data, layout, tokens=16, codec=codec)
    c = store.get(k)
    assert c is not None and c.codec == codec
    back = unpack(c.data, c.layout)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_shuffle_compresses_bf16_kv_better_than_plain_zstd(store: Store) -> None:
    # smooth activations: the high byte of bf16 carries little entropy
    t = (torch.randn(4, 2, 64, 4, 64) * 0.5).to(torch.bfloat16)
    data, layout = pack(t)
    assert store.put(key(1), data, layout, codec="zstd")
    assert store.put(key(2), data, layout, codec="zstd-shuffle")
    plain, shuf = store.info(key(1)), store.info(key(2))
    assert plain is not None and shuf is not None
    assert shuf.stored_bytes < plain.stored_bytes < len(data)


@settings(max_examples=80, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), itemsize=st.sampled_from([1, 2, 4, 8]),
       codec=st.sampled_from([0, 1, 2]), piece=st.sampled_from([64, 1000, 1 << 20]))
def test_codec_property_lossless(data: bytes, itemsize: int, codec: int, piece: int) -> None:
    c = Codec()
    with mock.patch.object(codec_mod, "FRAME_RAW", piece):
        enc = c.encode(codec, data, itemsize)
    if codec and piece == 64 and len(data) > 128:
        assert len(list(encoded_parts(enc))) == -(-len(data) // (64 - 64 % itemsize))
    out = bytearray(len(data) + 3)
    c.decode_into(codec, enc, memoryview(out), len(data), itemsize)
    assert bytes(out[: len(data)]) == data
    assert bytes(unshuffle(shuffle(data, itemsize), itemsize)) == data
    if codec:  # as written before pieces: one zstd frame over the whole (shuffled) chunk
        legacy = zstandard.ZstdCompressor(level=1).compress(data if codec == 1 else shuffle(data, itemsize))
        out2 = bytearray(len(data))
        c.decode_into(codec, legacy, memoryview(out2), len(data), itemsize)
        assert bytes(out2) == data


def test_a_damaged_compressed_payload_never_decodes_to_wrong_bytes() -> None:
    c = Codec()
    data = bytes(range(256)) * 64
    with mock.patch.object(codec_mod, "FRAME_RAW", 4096):
        enc = bytes(c.encode(2, data, 2))
    out = memoryview(bytearray(len(data)))
    cut, short_table, bad_length = enc[:-1], enc[:10], enc[:12] + b"\xff" * 4 + enc[16:]
    for bad in (cut, short_table, bad_length, enc + b"\0", b"LMZP" + enc[4:8] + b"\x09" + enc[9:]):
        with pytest.raises(StoreError):
            c.decode_into(2, bad, out, len(data), 2)
    with pytest.raises(StoreError):
        c.decode_into(2, enc, out, len(data) + 1, 2)


def test_put_is_idempotent_and_get_into_reuses_buffer(store: Store) -> None:
    k = key(7)
    data = content(k, CHUNK)
    assert store.put(k, data, SMALL_LAYOUT, tokens=16)
    assert not store.put(k, b"\0" * CHUNK, SMALL_LAYOUT, tokens=16)  # first copy wins
    out = np.zeros(CHUNK * 2, dtype=np.uint8)  # numpy's stubs make ndarray a Buffer only on 3.12+: the ignores
    info = store.get_into(k, out)  # type: ignore[arg-type]
    assert info is not None and info.raw_bytes == CHUNK and info.tokens == 16
    assert out[:CHUNK].tobytes() == data
    # a buffer too small for the chunk is a miss, counted, never an exception; the chunk is
    # kept (it may be the reader's mistake: the index records no namespace for this key)
    assert store.get_into(k, bytearray(10)) is None
    assert store.contains(k)
    assert store.get_into(k, out) is not None  # type: ignore[arg-type]  # ndarray: see above


def test_lookup_longest_prefix(store: Store, ns: Namespace) -> None:
    toks = list(range(100))  # 6 full chunks of 16
    keys = ns.chunk_keys(toks)
    for k in keys[:3] + keys[4:]:
        store.put(k, content(k, CHUNK), SMALL_LAYOUT, tokens=16)
    res = store.lookup(ns, toks)
    assert res.total_tokens == 100 and res.hit_tokens == 48 and res.hit_chunks == 3
    assert res.tiers == ["nvme", "nvme", "nvme", None, "nvme", "nvme"]
    other = Namespace("other-model", SMALL_FMT)
    assert store.lookup(other, toks).hit_tokens == 0


# -- integrity ---------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle"])
@pytest.mark.parametrize("where", ["payload", "trailer"])
def test_flipped_byte_is_a_miss_never_wrong_bytes(store: Store, codec: str, where: str) -> None:
    keys = [key(i) for i in range(3)]
    for k in keys:
        store.put(k, content(k, CHUNK), {"dtype": "bfloat16"}, tokens=16, codec=codec)
    flip_byte(store, keys[1], where)
    os.sync()
    assert store.get(keys[1]) is None
    assert not store.contains(keys[1])  # dropped from the index
    assert store.stats().counters["corrupt"] == 1
    for k in (keys[0], keys[2]):
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)


def test_record_of_another_key_is_a_miss(store: Store) -> None:
    """An index entry that points at another chunk's record (a foreign chunk) is never served."""
    a, b = key(1), key(2)
    store.put(a, content(a, CHUNK), SMALL_LAYOUT)
    store.put(b, content(b, CHUNK), SMALL_LAYOUT)
    from store.index import Entry

    with store._index.env.begin(write=True) as txn:
        ra, rb = txn.get(a, db=store._index.chunks), txn.get(b, db=store._index.chunks)
        assert ra is not None and rb is not None
        ea, eb = Entry.unpack(ra), Entry.unpack(rb)
        eb.seg, eb.off, eb.checksum = ea.seg, ea.off, ea.checksum
        txn.put(b, eb.pack(), db=store._index.chunks)
    assert store.get(b) is None
    c = store.get(a)
    assert c is not None and bytes(c.data) == content(a, CHUNK)


def test_deep_check_finds_and_fixes_corruption(store: Store) -> None:
    keys = fill(store, 5)
    flip_byte(store, keys[3])
    problems = store.check(deep=True)
    assert [p.kind for p in problems] == ["corrupt-chunk"]
    fixed = store.check(deep=True, fix=True)
    assert any(p.kind == "corrupt-chunk" and p.fixed for p in fixed)
    assert store.check(deep=True) == []
    assert store.locate(keys) == ["nvme", "nvme", "nvme", None, "nvme"]


# -- capacity, eviction, pins ------------------------------------------------------
def test_capacity_eviction_and_pins_together(make_store: MakeStore) -> None:
    per = CHUNK + 4096  # one record on disk (payload + header, 4 KiB aligned)
    store = make_store(capacity=40 * per, segment_bytes=1 * MiB, pin_budget=0.5)
    pinned = fill(store, 5)
    assert store.pin("system-prompt", pinned) == 5
    hot = fill(store, 5, start=100)
    for i in range(200, 400):
        k = key(i)
        assert store.put(k, content(k, CHUNK), {"dtype": "uint8"})
        if i % 10 == 0:  # keep the hot set recently used
            for h in hot:
                assert store.get(h) is not None
            store.flush()
        st = store.stats().tiers["nvme"]
        assert st.disk_bytes <= st.capacity
    assert store.locate(pinned) == ["nvme"] * 5  # pinned chunks never evicted
    assert store.locate(hot) == ["nvme"] * 5  # LRU keeps recently used chunks
    assert store.locate([key(200), key(201)]) == [None, None]  # old, cold chunks went first
    for k in pinned:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)
    assert store.stats().counters["evicted"] > 100
    assert store.check(deep=True) == []


def test_pin_refcount_by_label_durable_and_forward(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store()
    keys = [key(i) for i in range(4)]
    assert store.pin("doc-a", keys[:3]) == 3  # none stored yet: pins may come first
    assert store.pin("doc-a", keys[:3]) == 0  # a label pins a key once
    assert store.pin("doc-b", keys[2:]) == 2
    assert [store.pin_refs(k) for k in keys] == [1, 1, 2, 1]
    for k in keys:
        store.put(k, content(k, CHUNK), SMALL_LAYOUT)
    store.close()
    store = make_store(tmp_path / "store")
    assert [store.pin_refs(k) for k in keys] == [1, 1, 2, 1]
    assert store.evict(keys) == (0, 0)  # all pinned
    assert store.unpin("doc-a") == 3
    assert [store.pin_refs(k) for k in keys] == [0, 0, 1, 1]
    n, _ = store.evict(keys)
    assert n == 2 and store.locate(keys) == [None, None, "nvme", "nvme"]
    assert store.evict(keys, force=True)[0] == 2
    assert store.labels() == {"doc-b": keys[2:]}
    assert store.check() == []


def test_pin_budget_refuses_clearly_and_changes_nothing(make_store: MakeStore) -> None:
    per = CHUNK + 4096
    store = make_store(capacity=100 * per, pin_budget=10 * per)
    keys = fill(store, 12)
    assert store.pin("fits", keys[:8]) == 8
    with pytest.raises(PinBudgetError, match="pin budget"):
        store.pin("too-much", keys[8:12])
    assert [store.pin_refs(k) for k in keys[8:]] == [0, 0, 0, 0]
    assert "too-much" not in store.labels()
    # not-yet-stored chunks count with their expected size
    with pytest.raises(PinBudgetError):
        store.pin("future", [key(900 + i) for i in range(3)], expected_bytes=per)
    assert store.pin("future", [key(900)], expected_bytes=per) == 1
    assert store.check() == []


def test_capacity_enforced_right_after_restart(make_store: MakeStore, tmp_path: Path) -> None:
    per = CHUNK + 4096
    store = make_store(capacity=100 * per, segment_bytes=64 * per)
    keys = fill(store, 80)
    store.pin("keep", keys[:5])
    store.close()
    store = make_store(tmp_path / "store", capacity=30 * per, segment_bytes=64 * per)
    st = store.stats().tiers["nvme"]
    assert st.disk_bytes <= 30 * per
    assert store.locate(keys[:5]) == ["nvme"] * 5
    assert store.check(deep=True) == []


def test_chunk_larger_than_tier_is_dropped_not_raised(make_store: MakeStore) -> None:
    store = make_store(capacity=2 * MiB)
    assert store.put(key(1), b"x" * (3 * MiB), {"dtype": "uint8"}) is False
    assert store.stats().counters["rejected_full"] == 1


# -- restart, compaction, rebuild --------------------------------------------------
def test_warm_restart_keeps_every_chunk(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store(segment_bytes=1 * MiB)
    keys = fill(store, 150)  # spans several segments
    before = store.stats().tiers["nvme"]
    store.close()
    store = make_store(tmp_path / "store", segment_bytes=1 * MiB)
    after = store.stats().tiers["nvme"]
    assert after.chunks == before.chunks == 150
    for k in keys:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)
    assert store.check(deep=True) == []


def test_compaction_reclaims_evicted_space(make_store: MakeStore) -> None:
    store = make_store(segment_bytes=1 * MiB)
    keys = fill(store, 200)
    store.evict(keys[::2])  # half of every segment dies
    st = store.stats()
    dead_before = st.tiers["nvme"].dead_bytes
    disk_before = st.tiers["nvme"].disk_bytes
    assert dead_before > 1 * MiB
    removed, reclaimed = store.compact(min_dead_ratio=0.3)
    assert removed > 0 and reclaimed > 0
    st = store.stats()
    assert st.tiers["nvme"].disk_bytes < disk_before
    assert st.counters["compacted_bytes"] > 0
    assert st.write_amplification > 1.0
    for k in keys[1::2]:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)
    assert store.check(deep=True) == []
    used = sum(os.path.getsize(p) for p in (Path(store.path) / "nvme").glob("seg-*.lseg"))
    assert used == st.tiers["nvme"].disk_bytes  # what is on disk is what is counted


def test_index_rebuilt_from_segments_alone(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store(segment_bytes=1 * MiB)
    keys = fill(store, 60)
    store.close()
    shutil.rmtree(tmp_path / "store" / "index")
    store = make_store(tmp_path / "store", segment_bytes=1 * MiB)
    # opening a store whose index is gone rebuilds it from the segments at once
    assert store.locate(keys) == ["nvme"] * 60
    assert store.rebuild_index() == 0  # nothing left to find
    for k in keys:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)
    assert [p for p in store.check(deep=True) if not p.fixed] == []


def test_configuration_is_kept_inside_the_store(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=123 * MiB)}, codec="zstd-shuffle")
    with Store(tmp_path / "s", cfg):
        pass
    with Store(tmp_path / "s") as s:
        assert s.config.tiers["nvme"].capacity == 123 * MiB and s.config.codec == "zstd-shuffle"
    with pytest.raises(StoreError, match="unknown codec"):
        Store(tmp_path / "t", StoreConfig(codec="lz5"))
    with pytest.raises(StoreError, match="not configured"):
        with Store(tmp_path / "s") as s:
            s.put_many([PutItem(key(1), b"x", {})], tier="dram")


def test_a_dram_tier_on_tmpfs_keeps_its_chunks_in_its_own_folder(tmp_path: Path) -> None:
    """A chunk lives in exactly one tier: the one it was put to, whose folder holds its
    segment, and reads come from there (there is no read order across tiers)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    dram = Path(shm) / f"lmctl-test-{os.getpid()}"
    try:
        cfg = StoreConfig(tiers={"dram": TierConfig(capacity=64 * MiB, path=str(dram)),
                                 "nvme": TierConfig(capacity=64 * MiB)})
        with Store(tmp_path / "s", cfg) as s:
            s.put_many([PutItem(key(1), content(key(1), CHUNK), SMALL_LAYOUT)], tier="dram")
            s.put(key(2), content(key(2), CHUNK), SMALL_LAYOUT)
            assert s.locate([key(1), key(2)]) == ["dram", "nvme"]
            c = s.get(key(1))
            assert c is not None and c.tier == "dram" and bytes(c.data) == content(key(1), CHUNK)
            info = s.info(key(1))
            assert info is not None and os.path.exists(SegmentIO(str(dram)).path(info.segment))
            assert info.segment not in SegmentIO(str(tmp_path / "s" / "nvme")).segment_ids()
            c2 = s.get(key(2))
            assert c2 is not None and c2.tier == "nvme"
    finally:
        shutil.rmtree(dram, ignore_errors=True)


def test_batch_that_crosses_a_segment_boundary(make_store: MakeStore) -> None:
    """One put batch larger than a segment: every record lands in the file its index names."""
    store = make_store(segment_bytes=64 * 1024)
    keys = [key(i) for i in range(20)]
    items = [PutItem(k, content(k, CHUNK), SMALL_LAYOUT, 16) for k in keys]
    assert all(store.put_many(items))
    assert len({store.info(k).segment for k in keys}) > 3  # type: ignore[union-attr]
    for k in keys:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)
    assert store.stats().counters["corrupt"] == 0


def test_rewrite_moves_and_recompresses_keeping_pins_and_bytes(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=1 * GiB), "dram": TierConfig(capacity=256 * MiB)},
                      segment_bytes=4 * MiB)
    s = Store(tmp_path / "s", cfg)
    try:
        keys = [key(i) for i in range(6)]
        zeros = bytes(64 * 1024)  # compressible
        for k in keys:
            assert s.put(k, zeros[:-8] + k[:8], SMALL_LAYOUT, tokens=16)
        s.pin("doc", keys[:2])
        dry = s.rewrite(keys[:3], tier="dram", dry_run=True)
        assert dry.chunks == 3 and s.locate(keys[:3]) == ["nvme"] * 3
        res = s.rewrite(keys[:3], tier="dram")
        assert res.chunks == 3 and s.locate(keys) == ["dram"] * 3 + ["nvme"] * 3
        assert s.pin_refs(keys[0]) == 1 and s.stats().tiers["dram"].pinned_bytes > 0
        comp = s.rewrite(keys, codec="zstd-shuffle", level=3)
        assert comp.chunks == 6 and comp.bytes_after < comp.bytes_before // 10
        for k in keys:
            got = s.get(k)
            assert got is not None and bytes(got.data) == zeros[:-8] + k[:8]
        assert s.rewrite(keys, codec="zstd-shuffle").skipped == 6
        assert s.evict(keys[:2]) == (0, 0)  # still pinned after both rewrites
        assert s.check(deep=True) == []
    finally:
        s.close()


def test_chunks_of_a_retired_model_fingerprint_are_evicted_first(make_store: MakeStore) -> None:
    """A new checkpoint under the same model id: the old fingerprint's chunks can never be hit
    again, so they go before any LRU victim, even when they were read more recently."""
    per = SMALL_FMT.chunk_bytes + 4096
    clock = ManualClock()
    store = make_store(capacity=64 * per, segment_bytes=1 * MiB, retire_after_s=0.3, clock=clock)
    old = Namespace("m", SMALL_FMT, model_fingerprint="a" * 32)
    new = Namespace("m", SMALL_FMT, model_fingerprint="b" * 32)
    other = Namespace("other-model", SMALL_FMT, model_fingerprint="c" * 32)
    store.register_namespace(old)
    old_keys = old.chunk_keys(list(range(16 * 16)))
    for k in old_keys:
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    store.pin("keep", old_keys[:2])
    store.register_namespace(other)
    other_keys = other.chunk_keys(list(range(5000, 5000 + 16 * 8)))
    for k in other_keys:
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    clock.advance(0.4)  # past retire_after_s
    store.register_namespace(new)  # the new checkpoint is served; the old one is not any more
    store.register_namespace(other)  # still in use (it has one fingerprint: never retired)
    assert store.retired_namespaces() == {old.ns_id}
    for k in old_keys[2:]:
        assert store.get(k) is not None  # the old chunks are the most recently used
    store.flush()
    new_keys = new.chunk_keys(list(range(100, 100 + 16 * 38)))
    for k in new_keys:
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    located = store.locate(old_keys)
    assert located[:2] == ["nvme", "nvme"]  # pinned: kept
    assert located[2:].count(None) >= 8  # the retired fingerprint went first ...
    assert store.locate(other_keys) == ["nvme"] * len(other_keys)  # ... not the older, unrelated model
    assert store.stats().counters["evicted_retired"] >= 8


def test_compress_records_its_level_and_rewrites_skip_the_same_form(make_store: MakeStore, ns: Namespace) -> None:
    store = make_store()
    keys = ns.chunk_keys(list(range(16 * 4)))
    for k in keys:
        store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    res = store.rewrite(keys, codec="zstd", level=3)
    assert res.chunks == 4 and {store.info(k).level for k in keys} == {3}  # type: ignore[union-attr]
    assert store.rewrite(keys, codec="zstd", level=3).skipped == 4
    assert store.rewrite(keys, codec="zstd", level=1).chunks == 4
    assert store.rewrite(keys, codec="raw").chunks == 4
    assert store.rewrite(keys, codec="raw").skipped == 4


def sealed_store(make_store: MakeStore, ns: Namespace, chunks: int) -> tuple[Store, list[bytes], list[bytes], Path]:
    """A store holding ``chunks`` chunks in sealed 1 MiB segments (written, closed, reopened):
    the store, every key, the keys in the first segment, and that segment's file."""
    store = make_store(segment_bytes=1 * MiB)
    keys = ns.chunk_keys(list(range(16 * chunks)))
    for k in keys:
        store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    store.close()
    store = make_store(segment_bytes=1 * MiB)
    first = store.info(keys[0])
    assert first is not None
    in_first = [i.key for i in store.iter_chunks() if i.segment == first.segment]
    return store, keys, in_first, Path(store.path) / "nvme" / f"seg-{first.segment:012d}.lseg"


def test_a_segment_forgotten_by_the_index_is_removed_when_its_unlink_was_lost(
        make_store: MakeStore, tmp_path: Path, ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed after an eviction commit and before the unlink leaves a segment file
    that the index no longer knows (fault injection: the unlink is skipped). Recovery removes
    it; it is never mistaken for a file that rebuild_index should take back."""
    store, keys, victims, path = sealed_store(make_store, ns, 40)
    monkeypatch.setattr(Space, "remove_files", lambda self, dropped: None)  # killed before the unlink
    store.evict(victims)
    monkeypatch.undo()
    assert path.exists() and path.stat().st_size > 4096  # left behind, records and all
    store.close()
    store = make_store(segment_bytes=1 * MiB)  # recovery
    assert not path.exists()
    assert [p for p in store.check(deep=True) if not p.fixed] == []
    assert all(store.get(k) is not None for k in keys if k not in victims)


@pytest.mark.parametrize("codec, field, value", [
    ("zstd-shuffle", "codec", 0),            # compressed bytes would be served as KV
    ("zstd-shuffle", "codec", 1),
    ("zstd-shuffle", "raw_len", None),       # a shorter raw length: part of a chunk served as all of it
    ("zstd-shuffle", "stored_len", None),
    ("raw", "stored_len", None),             # raised a bare ValueError
    ("raw", "raw_len", None),
    ("raw", "codec", 2),
    ("zstd-shuffle", "layout", {"dtype": "float16", "shape": [1]}),
    ("raw", "tokens", 7),
])
def test_an_index_entry_that_disagrees_with_its_record_is_a_corrupt_miss(
        make_store: MakeStore, ns: Namespace, codec: str, field: str, value: object) -> None:
    """LMDB has no checksums: a changed index entry (fault injection: one field rewritten in
    the index) is caught by the record's checksummed trailer, on every read and by verify."""
    from store.index import Entry

    store = make_store(codec=codec)
    keys = ns.chunk_keys(list(range(16 * 2)))
    for k in keys:
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    k = keys[0]
    with store._index.env.begin(write=True) as txn:
        entry = txn.get(k, db=store._index.chunks)
        assert entry is not None
        e = Entry.unpack(entry)
        if value is None:
            value = getattr(e, field) - 8 if field == "raw_len" else getattr(e, field) + 4096
        setattr(e, field, value)
        txn.put(k, e.pack(), db=store._index.chunks)
    kinds = [p.kind for p in store.check(deep=True)]
    # an entry's stored length is counted per namespace too: rewritten by hand, it no longer adds up
    assert kinds == ["corrupt-chunk"] + (["counts"] if field == "stored_len" else [])
    assert store.get(k) is None  # a miss, never wrong bytes or an exception
    assert store.stats().counters["corrupt"] == 1 and not store.contains(k)
    other = store.get(keys[1])
    assert other is not None and bytes(other.data) == content(keys[1], SMALL_FMT.chunk_bytes)


@pytest.mark.parametrize("how", ["read", "maintain", "reopen"])
def test_a_vanished_segment_stops_being_a_hit(make_store: MakeStore, ns: Namespace, how: str) -> None:
    """A sealed segment file deleted by hand: its chunks must stop counting as stored (else
    the engine never saves them again and recomputes those prefixes forever), on the next
    read of one of them, at maintenance, or at the next open; usage follows."""
    store, keys, gone, path = sealed_store(make_store, ns, 40)
    os.unlink(path)
    if how == "read":
        assert store.get(gone[0]) is None
    elif how == "maintain":
        assert store.maintain().segments_forgotten == 1
    else:
        store.close()
        store = make_store(segment_bytes=1 * MiB)
    assert store.locate(gone) == [None] * len(gone)
    assert all(t == "nvme" for k, t in zip(keys, store.locate(keys), strict=True) if k not in gone)
    assert [p for p in store.check() if not p.fixed] == []  # counters and usage match the index


def test_a_tier_whose_folder_is_not_there_keeps_its_chunks(make_store: MakeStore, ns: Namespace,
                                                           tmp_path: Path) -> None:
    """An unmounted disk or a moved tier folder looks like every segment vanished. Neither
    opening the store, maintenance nor verify --fix may drop the tier's chunks for that (before,
    verify --fix dropped every entry, irreversibly); once the folder is back, all is there."""
    store = make_store(segment_bytes=1 * MiB)
    keys = ns.chunk_keys(list(range(16 * 40)))
    for k in keys:
        store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    store.close()
    tier = Path(tmp_path / "store" / "nvme")
    aside = tmp_path / "nvme-aside"
    tier.rename(aside)  # the disk is not mounted
    store = make_store(segment_bytes=1 * MiB)
    assert store.maintain().segments_forgotten == 0
    problems = store.check(fix=True)
    assert "tier-unavailable" in {p.kind for p in problems}
    assert not all(p.fixed for p in problems)  # verify says it is not fine
    store.close()
    shutil.rmtree(tier)
    aside.rename(tier)  # mounted again
    store = make_store(segment_bytes=1 * MiB)
    assert store.locate(keys) == ["nvme"] * len(keys)
    assert [p for p in store.check(deep=True) if not p.fixed] == []


def test_a_lost_index_comes_back_with_its_pins_labels_namespaces_and_settings(tmp_path: Path) -> None:
    """The metadata journal beside the index: a store whose index was deleted reopens with
    its chunks (from the segments) and its pins, labels, namespace records, salt key and
    settings (a tier in its own folder included: before, its segments became invisible)."""
    dram = tmp_path / "elsewhere"
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=512 * MiB, pin_budget=0.25),
                             "dram": TierConfig(capacity=64 * MiB, path=str(dram))},
                      segment_bytes=1 * MiB, codec="zstd-shuffle", retire_after_s=123.0)
    salted = Namespace("m", SMALL_FMT, cache_salt="tenant-7")
    plain = Namespace("m", SMALL_FMT)
    path = tmp_path / "s"
    with Store(path, cfg) as s:
        s.register_namespace(plain, {"model_id": "m", "tokenizer": "tok"})
        s.register_namespace(salted, {"model_id": "m"})
        keys = plain.chunk_keys(list(range(16 * 6)))
        for k in keys:
            s.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
        s.rewrite(keys[4:], tier="dram")
        s.pin("contracts", keys[:3])
        s.pin("later", plain.chunk_keys(list(range(900, 900 + 16 * 2))), expected_bytes=8192)  # not stored yet
        s.pin("gone", keys[3:4])
        s.unpin("gone")
        digest = s.salt_digest("tenant-7")
        records = s.namespaces()
    shutil.rmtree(path / "index")
    with Store(path) as s:
        assert s.config.to_json() == cfg.to_json()
        assert s.locate(keys) == ["nvme"] * 4 + ["dram"] * 2
        assert sorted(s.labels()) == ["contracts", "later"]
        assert [s.pin_refs(k) for k in keys] == [1, 1, 1, 0, 0, 0]
        assert s.salt_digest("tenant-7") == digest
        assert {k: (d["namespace"], d["info"]) for k, d in s.namespaces().items()} == \
            {k: (d["namespace"], d["info"]) for k, d in records.items()}
        assert [p for p in s.check(deep=True) if not p.fixed] == []
        # compaction of the journal keeps the same state
        assert s.compact_journal(force=True)
    shutil.rmtree(path / "index")
    with Store(path) as s:
        assert sorted(s.labels()) == ["contracts", "later"] and s.salt_digest("tenant-7") == digest
        assert s.locate(keys) == ["nvme"] * 4 + ["dram"] * 2


def test_a_lost_index_without_a_journal_still_brings_the_chunks_back(tmp_path: Path, ns: Namespace) -> None:
    path = tmp_path / "s"
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)})) as s:
        keys = ns.chunk_keys(list(range(16 * 3)))
        for k in keys:
            s.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
        s.pin("x", keys)
    shutil.rmtree(path / "index")
    os.unlink(path / "meta.journal")
    with Store(path) as s:
        assert s.locate(keys) == ["nvme"] * 3 and s.labels() == {}


def test_a_damaged_index_is_one_clear_error_then_rebuilt_when_moved_aside(tmp_path: Path, ns: Namespace) -> None:
    path = tmp_path / "s"
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)})) as s:
        keys = ns.chunk_keys(list(range(16 * 3)))
        for k in keys:
            s.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
        s.pin("x", keys[:1])
    data = path / "index" / "data.mdb"
    data.write_bytes(os.urandom(64 * 1024))  # fault injection: the index is garbage
    with pytest.raises(StoreError, match="move that folder aside"):
        Store(path)
    (path / "index").rename(tmp_path / "index.damaged")
    with Store(path) as s:
        assert s.locate(keys) == ["nvme"] * 3 and s.labels() == {"x": keys[:1]}


@pytest.mark.parametrize("damage", ["garbage", "tier", "offset", "huge-length", "time"])
def test_an_undecodable_index_entry_is_a_miss_and_verify_fix_drops_it(make_store: MakeStore, ns: Namespace,
                                                                       damage: str) -> None:
    import struct as _struct

    store = make_store()
    keys = ns.chunk_keys(list(range(16 * 2)))
    for k in keys:
        store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    k = keys[0]
    with store._index.env.begin(write=True) as txn:
        entry = txn.get(k, db=store._index.chunks)
        assert entry is not None
        raw = bytearray(entry)
        if damage == "garbage":
            raw = bytearray(b"\xff" * 40)  # too short, not JSON
        elif damage == "tier":
            raw[57] = 9
        elif damage == "offset":
            _struct.pack_into("<Q", raw, 8, 4096 * 3 + 17)
        elif damage == "huge-length":
            _struct.pack_into("<Q", raw, 32, 1 << 60)  # raw_len: get() allocated this
        else:
            _struct.pack_into("<d", raw, 64, float("nan"))
        txn.put(k, bytes(raw), db=store._index.chunks)
    assert store.get(k) is None and store.info(k) is None  # a miss, no exception
    assert all(i.key != k for i in store.iter_chunks())
    other = store.get(keys[1])
    assert other is not None and bytes(other.data) == content(keys[1], SMALL_FMT.chunk_bytes)
    store.check(fix=True)
    assert [p for p in store.check(deep=True) if not p.fixed] == []


def test_a_rebuild_does_not_take_back_a_segment_the_lost_index_had_dropped(
        make_store: MakeStore, ns: Namespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill between an eviction commit and the unlink leaves a segment file; if the index is
    then lost too, the rebuild must not bring the evicted chunks back (the journal says the
    segment was dropped)."""
    store, keys, victims, path = sealed_store(make_store, ns, 200)
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda p, *a, **k: None if str(p).endswith(".lseg") else real_unlink(p))
    store.evict(victims)  # "killed" before the file went away
    monkeypatch.undo()
    assert path.exists()
    store.close()
    shutil.rmtree(tmp_path / "store" / "index")  # and the index is lost
    store = make_store(segment_bytes=1 * MiB)
    assert store.locate(victims) == [None] * len(victims) and not path.exists()
    rest = [k for k in keys if k not in victims]
    assert store.locate(rest) == ["nvme"] * len(rest)


def test_a_tier_added_while_the_store_is_open_is_marked_as_the_tiers(tmp_path: Path) -> None:
    """A dram tier added through ``configure`` (``lmctl config set tiers.dram...``) is a tier
    whose folder is there: checks never take it for an unmounted disk, before or after it holds
    chunks (its marker was written only when some process opened the store again)."""
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
        cfg = StoreConfig.from_json(s.config.to_json())
        cfg.tiers["dram"] = TierConfig(capacity=16 * MiB, path=str(tmp_path / "dram"))
        s.configure(cfg)
        assert [p for p in s.check() if not p.fixed] == []
        assert s.put_many([PutItem(key(1), content(key(1), 8192), SMALL_LAYOUT, 16)], tier="dram") == [True]
        assert [p for p in s.check() if not p.fixed] == []
    with Store(tmp_path / "s") as s:
        assert s.locate([key(1)]) == ["dram"]
        assert [p for p in s.check() if not p.fixed] == []


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_get_into_leaves_a_larger_buffer_alone_past_the_chunk(make_store: MakeStore, codec: str) -> None:
    """A page-aligned buffer is read into with O_DIRECT, a block at a time: the zero padding
    after an unaligned raw payload (up to 4095 bytes) landed in the caller's buffer past the
    chunk, where an unaligned buffer kept its bytes."""
    import mmap

    from store.format.segment import READ_SPAN

    store = make_store(segment_bytes=32 * MiB)
    if not store.stats().tiers["nvme"].direct_io:
        pytest.skip("the tier's filesystem does not take O_DIRECT")
    for i, n in enumerate((1, 4095, 4097, READ_SPAN - 1, READ_SPAN + 1, 3 * MiB + 5)):
        k = key(i)
        data = content(k, n + 8)[:n]  # (content makes at least 8 bytes)
        assert store.put(k, data, SMALL_LAYOUT, tokens=16, codec=codec)
        out = mmap.mmap(-1, n + 2 * 4096)
        out[:] = b"\xee" * len(out)
        info = store.get_into(k, out)
        assert info is not None and info.raw_bytes == n
        assert out[:n] == data
        assert out[n:] == b"\xee" * (len(out) - n), f"get_into wrote past a chunk of {n} bytes"
        out.close()


def test_compaction_moves_records_over_a_write_piece_of_unaligned_length(make_store: MakeStore) -> None:
    """A record longer than one 8 MiB write piece whose length is not a multiple of 4 KiB
    (every zstd-compressed chunk of a 7B+ model) goes out zero-copy piece by piece with its
    partial last piece staged: compaction moved such records with an IndexError (the staging
    ring was indexed before it was filled), so maintenance failed for good."""
    import mmap

    from store.format.segment import WRITE_SPAN

    store = make_store(segment_bytes=20 * MiB)  # two records a segment
    n = WRITE_SPAN + MiB + 123
    src = mmap.mmap(-1, n + 4096)  # page-aligned: the direct path writes it without a copy
    keys = [key(i) for i in range(6)]
    for k in keys:
        src[:n] = content(k, n)
        assert store.put(k, memoryview(src)[:n], SMALL_LAYOUT, tokens=16)
    # compressed chunks: stored lengths are never aligned, and compaction reads them into
    # page-aligned buffers before writing them out again
    import hashlib

    def noise(k: bytes) -> bytes:  # does not compress: stays over a write piece
        return hashlib.shake_256(k).digest(n)

    zkeys = [key(100 + i) for i in range(6)]
    for k in zkeys:
        assert store.put(k, noise(k), SMALL_LAYOUT, tokens=16, codec="zstd-shuffle")
        info = store.info(k)
        assert info is not None and info.stored_bytes > WRITE_SPAN and info.stored_bytes % 4096
    store.evict(keys[::2] + zkeys[::2])
    removed, reclaimed = store.compact(min_dead_ratio=0.3)
    assert removed >= 2 and reclaimed > 0
    for k in keys[1::2]:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, n)
    for k in zkeys[1::2]:
        c = store.get(k)
        assert c is not None and c.codec == "zstd-shuffle" and bytes(c.data) == noise(k)
    assert store.check(deep=True) == []


def test_the_ladder_follows_the_store_s_tiers_and_moves_chunks_along_it(tmp_path: Path) -> None:
    """One ordered ladder (store/tiers/ladder.py): nvme alone spills nowhere; with dram added by
    ``configure`` the ladder is dram over nvme at once, dram's victims spill one rung down, and
    a hit below the top (``get_into``, an engine's read) is promoted back up."""
    shm = tmp_path / "shm"
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, segment_bytes=1 * MiB)) as s:
        ladder = s._ladder
        assert (ladder.local(), ladder.top()) == (["nvme"], "nvme")
        assert ladder.local_below("nvme") is None and not ladder.spills() and not s._writes.spill_moves("nvme")
        cfg = StoreConfig.from_json(s.config.to_json())
        cfg.tiers["dram"] = TierConfig(capacity=2 * MiB, path=str(shm))
        cfg.default_tier = "dram"
        s.configure(cfg)
        assert (ladder.local(), ladder.top(), ladder.local_below("dram")) == (["dram", "nvme"], "dram", "nvme")
        assert ladder.from_("dram") == ["dram", "nvme"] and ladder.from_("nvme") == ["nvme"] and ladder.spills()
        keys = [key(i) for i in range(6)]
        for k in keys:  # 6 chunks of 512 KiB through a 2 MiB dram tier: the oldest spill to nvme
            s.put_many([PutItem(k, content(k, 512 * 1024), SMALL_LAYOUT, 16)])
        s.flush()
        where = s.locate(keys)
        assert "nvme" in where and where[-1] == "dram"
        low = keys[where.index("nvme")]
        buf = bytearray(512 * 1024)
        assert s.get_into(low, buf) is not None and bytes(buf) == content(low, 512 * 1024)
        s.close()  # waits for the promotion in the background
    with Store(tmp_path / "s") as s:
        assert s.locate([low]) == ["dram"]
