"""The index and its transactions: map growth, aborted transactions, orphans, recounts,
paging, fsync=False, rewrites racing compaction, and stores written by an earlier lmctl."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest
from conftest import SMALL_FMT, SMALL_LAYOUT, content

import store.index as index_mod
import store.ops.reads as reads_mod
from store import Chunk, MiB, Namespace, PutItem, Store, StoreConfig, StoreError, TierConfig
from store.clock import ManualClock
from store.format.segment import SegmentIO

MakeStore = Callable[..., Store]
DATA = Path(__file__).resolve().parent / "data"


def segment_files(s: Store, tier: str = "nvme") -> set[int]:
    return set(SegmentIO(os.path.join(s.path, tier)).segment_ids())


class _FullOnceTxn:
    """A write transaction that fails with MapFullError at its first put after a new
    segment file appeared on disk (fault injection: the map fills up while a segment is
    being registered)."""

    def __init__(self, txn: Any, env: _FullOnceEnv) -> None:
        self._txn = txn
        self._env = env

    def __enter__(self) -> _FullOnceTxn:
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._txn.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def put(self, key: bytes, value: bytes, **kw: Any) -> Any:
        if self._env.armed and len(os.listdir(self._env.tier_dir)) > self._env.files:
            self._env.armed = False
            self._env.fired += 1
            raise lmdb.MapFullError("injected: the map is full")
        return self._txn.put(key, value, **kw)


class _FullOnceEnv:
    def __init__(self, env: Any) -> None:
        self._env = env
        self.armed = False
        self.fired = 0
        self.tier_dir = ""
        self.files = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def arm(self, tier_dir: str) -> None:
        self.tier_dir, self.files, self.armed = tier_dir, len(os.listdir(tier_dir)), True

    def begin(self, write: bool = False, **kw: Any) -> Any:
        txn = self._env.begin(write=write, **kw)
        return _FullOnceTxn(txn, self) if write else txn


def test_a_full_map_while_a_segment_is_registered_leaves_no_orphan_file(
        tmp_path: Path, ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transaction that registers a new segment fails with MapFullError: the map grows
    and the write goes through, and the segment file made by the aborted transaction is
    removed with it (it used to stay behind, reported by check() until a reopen)."""
    envs: list[_FullOnceEnv] = []
    real_open = lmdb.open

    def open_(*a: Any, **kw: Any) -> Any:
        envs.append(_FullOnceEnv(real_open(*a, **kw)))
        return envs[-1]

    monkeypatch.setattr(lmdb, "open", open_)
    s = Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, segment_bytes=1 * MiB))
    try:
        keys = ns.chunk_keys(list(range(16 * 4)))
        envs[0].arm(os.path.join(s.path, "nvme"))
        assert s.put_many([PutItem(k, content(k, 4096), SMALL_LAYOUT, 16) for k in keys]) == [True] * 4
        assert envs[0].fired == 1
        assert [p for p in s.check() if not p.fixed] == []
        registered = {seg for k in keys if (i := s.info(k)) is not None for seg in [i.segment]}
        assert segment_files(s) == registered
        assert all(bytes(c.data) == content(k, 4096) for k in keys if (c := s.get(k)) is not None)
    finally:
        s.close()


def test_the_map_grows_as_the_index_fills(tmp_path: Path, ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "MAP_SIZE", 256 << 10)
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, segment_bytes=4 * MiB)
    keys = ns.chunk_keys(list(range(16 * 1500)))
    with Store(tmp_path / "s", cfg) as s:
        for i in range(0, len(keys), 100):
            assert all(s.put_many([PutItem(k, k * 2, {"dtype": "uint8"}, 16) for k in keys[i : i + 100]]))
        grown = s._index.env.info()["map_size"]
        assert grown > 256 << 10
    with Store(tmp_path / "s") as s:
        assert s.locate(keys) == ["nvme"] * len(keys)
        assert all(bytes(c.data) == k * 2 for k in keys[::97] if (c := s.get(k)) is not None)
        assert [p for p in s.check(deep=True) if not p.fixed] == []


def test_opening_removes_an_empty_orphan_segment_and_keeps_one_with_records(
        make_store: MakeStore, tmp_path: Path, ns: Namespace) -> None:
    """A file with no record (a writer killed between creating a segment and registering
    it) is removed at open; a file with records the index never issued is kept and
    reported; one that another store wrote (its header names that store) is never indexed."""
    s = make_store()
    keys = ns.chunk_keys(list(range(16 * 3)))
    assert all(s.put_many([PutItem(k, content(k, 4096), SMALL_LAYOUT, 16) for k in keys]))
    s.close()
    io = SegmentIO(os.path.join(s.path, "nvme"))
    empty = 900
    os.close(io.create(empty))  # header only
    donor = tmp_path / "donor"
    d = Store(donor, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}))
    other = Namespace("other-model", SMALL_FMT).chunk_keys(list(range(16)))
    d.put(other[0], content(other[0], 4096), SMALL_LAYOUT, 16)
    d.close()
    (src,) = SegmentIO(os.path.join(donor, "nvme")).segment_ids()
    foreign = 901
    os.link(SegmentIO(os.path.join(donor, "nvme")).path(src), io.path(foreign))
    s2 = Store(s.path)
    try:
        assert not os.path.exists(io.path(empty))
        assert os.path.exists(io.path(foreign))
        kinds = [(p.kind, p.fixed) for p in s2.check()]
        assert ("foreign-file", False) in kinds  # another store's segment (its header says so)
        assert s2.locate(keys) == ["nvme"] * 3 and s2.locate(other[:1]) == [None]
        assert s2.rebuild_index() == 0  # another store's segment: kept, never taken
        assert s2.get(other[0]) is None and os.path.exists(io.path(foreign))
    finally:
        s2.close()


def test_check_fix_repairs_drifted_counters(store: Store, ns: Namespace) -> None:
    keys = ns.chunk_keys(list(range(16 * 6)))
    assert all(store.put_many([PutItem(k, content(k, 4096), SMALL_LAYOUT, 16) for k in keys]))
    store.pin("doc", keys[:2])
    good = store.stats().tiers["nvme"]

    def drift(t: index_mod.Txn) -> None:
        t.set_counter("live:nvme", 12345)
        t.set_counter("count:nvme", 99)
        t.set_counter("pinned:nvme", 7)
        sid = store.info(keys[0]).segment  # type: ignore[union-attr]
        seg = t.must_segment(sid)
        seg.live_count += 3
        t.put_segment(sid, seg)

    store._index.write(drift)
    found = {p.kind for p in store.check()}
    assert {"counter", "segment-count"} <= found
    assert store.stats().tiers["nvme"].chunks == 99
    fixed = store.check(fix=True)
    assert fixed and all(p.fixed for p in fixed if p.kind in ("counter", "segment-count"))
    assert store.check() == []
    now = store.stats().tiers["nvme"]
    assert (now.chunks, now.bytes, now.pinned_bytes) == (good.chunks, good.bytes, good.pinned_bytes)


def test_listing_holds_no_snapshot_between_pages(store: Store, ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """iter_chunks reads a page per transaction: chunks stored while a listing runs are
    seen by its later pages (one long snapshot would hide them and pin old index pages)."""
    monkeypatch.setattr(reads_mod, "PAGE", 4)
    keys = sorted(ns.chunk_keys(list(range(16 * 20))))
    early, late = keys[:6], keys[-6:]
    assert all(store.put_many([PutItem(k, b"x" * 64, {"dtype": "uint8"}) for k in early]))
    seen = []
    for i, info in enumerate(store.iter_chunks(ns.ns_id)):
        seen.append(info.key)
        if i == 0:
            assert all(store.put_many([PutItem(k, b"y" * 64, {"dtype": "uint8"}) for k in late]))
    assert seen == early + late


def test_fsync_off_never_syncs_and_keeps_what_it_stored(make_store: MakeStore, ns: Namespace,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync=False: the payload is not synced (the OS writes it back; a power loss may lose
    recent chunks, never make them wrong: every read is verified), and a clean close and
    reopen keeps every chunk."""
    synced: list[int] = []
    real = SegmentIO.sync

    def counted_sync(self: SegmentIO, fd: int) -> None:
        synced.append(fd)
        real(self, fd)

    monkeypatch.setattr(SegmentIO, "sync", counted_sync)
    s = make_store(fsync=False)
    keys = ns.chunk_keys(list(range(16 * 8)))
    assert all(s.put_many([PutItem(k, content(k, 4096), SMALL_LAYOUT, 16) for k in keys]))
    s.evict(keys[::2])
    s.compact(min_dead_ratio=0.0)
    assert synced == []
    path = s.path
    s.close()
    with Store(path) as again:
        assert again.config.fsync is False
        for k in keys[1::2]:
            c = again.get(k)
            assert c is not None and bytes(c.data) == content(k, 4096)
    s2 = make_store(path=Path(path) / ".." / "synced")
    s2.put(keys[0], content(keys[0], 4096), SMALL_LAYOUT, 16)
    assert synced  # the default syncs: the hook above sees it


def test_rewrite_racing_compaction_keeps_every_chunk(make_store: MakeStore, ns: Namespace) -> None:
    s = make_store(segment_bytes=256 << 10)
    keys = ns.chunk_keys(list(range(16 * 60)))
    for i in range(0, 60, 6):
        assert all(s.put_many([PutItem(k, content(k, 8192), SMALL_LAYOUT, 16) for k in keys[i : i + 6]]))
    s.evict(keys[::3])
    live = [k for i, k in enumerate(keys) if i % 3]
    stop = threading.Event()
    errors: list[BaseException] = []

    def compactor() -> None:
        try:
            while not stop.is_set():
                s.compact(min_dead_ratio=0.0)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=compactor)
    t.start()
    try:
        for codec in ("zstd", "raw", "zstd-shuffle"):
            res = s.rewrite(live, codec=codec, level=1 if codec != "raw" else None)
            assert res.chunks + res.skipped == len(live) and res.missing == 0
    finally:
        stop.set()
        t.join()
    assert not errors
    for k in live:
        c = s.get(k)
        assert c is not None and bytes(c.data) == content(k, 8192) and c.codec == "zstd-shuffle"
    assert [p for p in s.check(deep=True) if not p.fixed] == []


def test_a_rewrite_survives_compaction_moving_its_chunk(make_store: MakeStore, ns: Namespace) -> None:
    """Compaction that moves a chunk's record between a rewrite's read and its commit (the
    same bytes in another segment) does not make the rewrite give up on that chunk."""
    s = make_store(segment_bytes=64 << 10)
    keys = ns.chunk_keys(list(range(16 * 24)))
    for i in range(0, 24, 6):
        assert all(s.put_many([PutItem(k, content(k, 8192), SMALL_LAYOUT, 16) for k in keys[i : i + 6]]))
    s.evict(keys[::2])
    live = keys[1::2]
    reads = s._writes.reads
    real_get = reads.get
    moved = []

    def get_then_compact(key: bytes, touch: bool = True, expect: int | None = None,
                         limit: int | None = None) -> Chunk | None:
        chunk = real_get(key, touch, expect, limit)
        before = s.info(key)
        s.compact(min_dead_ratio=0.0)  # the entry the rewrite read now points at a removed segment
        after = s.info(key)
        moved.append(before is not None and after is not None and before.segment != after.segment)
        return chunk

    puts = []
    real_put = s._writes.put_many

    def counted_put(*a: Any, **kw: Any) -> list[bool]:
        got = real_put(*a, **kw)
        puts.append(got)
        return got

    reads.get = get_then_compact  # type: ignore[method-assign]
    s._writes.put_many = counted_put  # type: ignore[method-assign]
    try:
        res = s.rewrite(live, codec="zstd", level=1)
    finally:
        reads.get = real_get  # type: ignore[method-assign]
        s._writes.put_many = real_put  # type: ignore[method-assign]
    assert any(moved)
    # one put per chunk: none was thrown away because compaction had moved its record (under
    # a compactor running in a loop every attempt could be, and the chunk was left as it was)
    assert puts == [[True]] * len(live)
    assert (res.chunks, res.skipped, res.missing) == (len(live), 0, 0)
    for k in live:
        c = s.get(k)
        assert c is not None and bytes(c.data) == content(k, 8192) and c.codec == "zstd"
    assert [p for p in s.check(deep=True) if not p.fixed] == []


def test_a_store_written_by_an_earlier_lmctl_opens_unchanged(tmp_path: Path) -> None:
    """tests/data/store-format1.tar.gz was written by the lmctl before the store was split
    into parts: it opens with its chunks, pins, namespaces and settings as they were."""
    with tarfile.open(DATA / "store-format1.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    expect: dict[str, list[str]] = json.loads((tmp_path / "expect.json").read_text())
    with Store(tmp_path / "store") as s:
        assert s.config.segment_bytes == 1 * MiB
        kept = [bytes.fromhex(k) for k in expect["kept"]]
        assert s.locate(kept) == ["nvme"] * len(kept)
        assert s.locate([bytes.fromhex(k) for k in expect["evicted"]]) == [None]
        for k in kept:
            c = s.get(k)
            assert c is not None and bytes(c.data) == content(k, SMALL_FMT.chunk_bytes)
        assert {c.key.hex() for c in s.iter_chunks() if c.codec == "zstd"} == set(expect["zstd"])
        assert sorted(k.hex() for k in s.labels()["doc"]) == sorted(expect["pinned"])
        assert all(s.pin_refs(bytes.fromhex(k)) == 1 for k in expect["pinned"])
        models = {r.model for r, _doc in s.namespace_records().values()}
        assert models == {"legacy-model"}
        assert any(doc["namespace"].get("salt_digest") for _r, doc in s.namespace_records().values())
        assert [p for p in s.check(deep=True) if not p.fixed] == []
        assert s.stats().tiers["nvme"].chunks == len(kept)


def test_maintenance_compresses_cold_raw_chunks_only(make_store: MakeStore, ns: Namespace) -> None:
    clock = ManualClock()
    s = make_store(compress_cold_after_s=0.5, clock=clock)
    keys = ns.chunk_keys(list(range(16 * 6)))
    data = {k: content(k, 8192)[:4096] * 2 for k in keys}  # compressible
    assert all(s.put_many([PutItem(k, data[k], SMALL_LAYOUT, 16) for k in keys]))
    s.pin("doc", keys[:1])
    clock.advance(0.7)  # past compress_cold_after_s
    for k in keys[4:]:  # read now: not cold
        assert s.get(k) is not None
    s.flush()
    assert s.maintain().chunks_compressed == 4
    assert [s.info(k).codec for k in keys] == ["zstd-shuffle"] * 4 + ["raw"] * 2  # type: ignore[union-attr]
    assert all(bytes(c.data) == data[k] for k in keys if (c := s.get(k, touch=False)) is not None)
    assert s.pin_refs(keys[0]) == 1
    assert s.maintain().chunks_compressed == 0  # nothing left that is cold and raw
    assert [p for p in s.check(deep=True) if not p.fixed] == []


def test_a_failed_open_leaves_nothing_open(tmp_path: Path) -> None:
    """Settings refused at open used to leave the LMDB environment open, so every later open
    of that folder in the process failed with "already open"."""
    with pytest.raises(StoreError, match="segment_bytes"):
        Store(tmp_path / "s", StoreConfig(segment_bytes=1))
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
        assert s.stats().tiers["nvme"].chunks == 0


def test_a_full_dram_tier_demotes_to_nvme_instead_of_evicting(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=16 * MiB, path=str(tmp_path / "shm")),
                             "nvme": TierConfig(capacity=256 * MiB)}, default_tier="dram", segment_bytes=1 * MiB)
    with Store(tmp_path / "s", cfg) as s:
        big = 1 << 20
        keys = [bytes([5]) * 16 + i.to_bytes(32, "big") for i in range(40)]
        s.pin("doc", keys[:1])
        for k in keys:  # 40 MiB through a 16 MiB dram tier
            assert s.put(k, content(k, big), {"dtype": "uint8"})
        tiers = s.locate(keys)
        assert None not in tiers and "nvme" in tiers and tiers[-1] == "dram"
        assert tiers[0] == "nvme" and s.pin_refs(keys[0]) == 1  # pinned: demoted like the others, pin kept
        assert s.stats().counters["evicted"] == 0
        assert all(bytes(c.data) == content(k, big) for k in keys if (c := s.get(k, touch=False)) is not None)
        assert s.stats().tiers["dram"].disk_bytes <= 16 * MiB
        assert [p for p in s.check(deep=True) if not p.fixed] == []


def test_a_hit_in_nvme_is_promoted_to_dram_in_the_background(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=64 * MiB, path=str(tmp_path / "shm")),
                             "nvme": TierConfig(capacity=256 * MiB)}, default_tier="dram")
    with Store(tmp_path / "s", cfg) as s:
        k = bytes([6]) * 16 + (1).to_bytes(32, "big")
        assert s.put_many([PutItem(k, content(k, 1 << 20), {"dtype": "uint8"})], tier="nvme") == [True]
        assert s.get(k, touch=False) is not None and s.locate([k]) == ["nvme"]  # the store's own reads do not
        out = bytearray(1 << 20)
        info = s.get_into(k, out)
        assert info is not None and info.tier == "nvme" and bytes(out) == content(k, 1 << 20)
        deadline = time.monotonic() + 10
        while s.locate([k]) != ["dram"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert bytes(s.get(k).data) == content(k, 1 << 20)  # type: ignore[union-attr]


def test_connector_dram_capacity_puts_saves_in_dram(tmp_path: Path) -> None:
    from engine_hook.config import ConnectorSettings

    st = ConnectorSettings.parse({"store_path": str(tmp_path / "s"), "dram_capacity": "64MiB",
                                  "dram_path": str(tmp_path / "shm"), "capacity": "1GiB"})
    with Store(tmp_path / "s") as s:
        st.apply(s)
        st.apply(s)  # again, as at the next start: capacity is still the disk tier's
        assert s.config.default_tier == "dram" and s.config.tiers["dram"].capacity == 64 * MiB
        assert s.config.tiers["nvme"].capacity == 1 << 30
        assert s.config.tiers["dram"].path == str(tmp_path / "shm") and "nvme" in s.config.tiers
    with pytest.raises(StoreError, match="dram_capacity"):
        ConnectorSettings.parse({"store_path": "/x", "dram_capacity": "1KiB"})


def test_after_a_reboot_the_dram_tiers_chunks_are_forgotten_and_nvme_keeps_its_own(tmp_path: Path) -> None:
    """tmpfs is empty after a reboot: the dram tier's chunks are gone for good, and the index
    must not go on reporting them as hits. Without a reboot, a missing dram folder may be
    another mount namespace's /dev/shm: its chunks are kept, like an unmounted disk's."""
    shm = tmp_path / "shm"
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=64 * MiB, path=str(shm)),
                             "nvme": TierConfig(capacity=256 * MiB)}, default_tier="dram")
    keys = [bytes([4]) * 16 + i.to_bytes(32, "big") for i in range(6)]
    with Store(tmp_path / "s", cfg) as s:
        assert all(s.put_many([PutItem(k, content(k, 8192), {"dtype": "uint8"}) for k in keys[:3]]))
        assert all(s.put_many([PutItem(k, content(k, 8192), {"dtype": "uint8"}) for k in keys[3:]], tier="nvme"))
    moved = tmp_path / "elsewhere"
    shm.rename(moved)  # the same boot, another view of /dev/shm
    with Store(tmp_path / "s") as s:
        assert s.locate(keys) == ["dram"] * 3 + ["nvme"] * 3  # kept until the folder is back
        s._index.write(lambda t: t.raw.put(b"boot_id", b"an earlier boot", db=s._index.meta))
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(moved)  # the reboot
    with Store(tmp_path / "s") as s:
        assert s.locate(keys) == [None] * 3 + ["nvme"] * 3
        assert s.stats().tiers["dram"].chunks == 0
        assert [p for p in s.check(deep=True) if not p.fixed] == []
        assert all(s.put_many([PutItem(k, content(k, 8192), {"dtype": "uint8"}) for k in keys[:3]]))
        assert s.locate(keys[:3]) == ["dram"] * 3


def test_pinned_chunks_are_not_promoted_and_a_failing_spill_evicts(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=16 * MiB, path=str(tmp_path / "shm")),
                             "nvme": TierConfig(capacity=256 * MiB)}, default_tier="dram", segment_bytes=1 * MiB)
    with Store(tmp_path / "s", cfg) as s:
        k = bytes([3]) * 16 + (1).to_bytes(32, "big")
        assert s.put_many([PutItem(k, content(k, 1 << 20), {"dtype": "uint8"})], tier="nvme") == [True]
        s.pin("doc", [k])
        assert s.get_into(k, bytearray(1 << 20)) is not None
        time.sleep(0.3)
        assert s.locate([k]) == ["nvme"]  # dram has a pin budget of its own: pinned chunks are not promoted
        # the nvme tier fails: dram's victims cannot move, so they are evicted, and puts go on
        from store.ops.writes import Writes

        def broken(self: Writes, *a: object, **kw: object) -> object:
            raise StoreError("injected: the disk under nvme is full")

        monkeypatch.setattr(Writes, "rewrite", broken)
        keys = [bytes([2]) * 16 + i.to_bytes(32, "big") for i in range(30)]
        for key in keys:
            assert s.put(key, content(key, 1 << 20), {"dtype": "uint8"})
        assert s.stats().counters["evicted"] > 0 and s.locate(keys[-1:]) == ["dram"]
