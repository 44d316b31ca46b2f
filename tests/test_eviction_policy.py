"""Eviction by segment (issue 22, item 2): ``eviction = "segment"`` (the default) against
``"lru"``, on real stores (LMDB, segment files on disk). Counts, never times: the write
amplification is the bytes the store wrote to its tier per payload byte put."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMALL_FMT, SMALL_LAYOUT, content, key

from store import MiB, Namespace, Store, StoreConfig, StoreError, TierConfig
from store.clock import ManualClock

MakeStore = Callable[..., Store]
ROOT = Path(__file__).resolve().parent.parent
#: chunks of 124 KiB: a record (payload and its 4 KiB trailer block) frames them at 3.2%
CHUNK = 124 * 1024
PER = CHUNK + 4096
LAYOUT = {"dtype": "uint8"}


def churn(store: Store, clock: ManualClock, n: int, seed: int = 3,
          pin_every: int = 20) -> tuple[list[bytes], set[bytes]]:
    """The issue's churn, small: ``n`` new chunks, each followed by a re-read of one of the
    recent ones (so LRU order departs from write order); every ``pin_every``-th chunk pinned.
    Checks the capacity after every put. Returns the keys put and the pinned ones."""
    rng = random.Random(seed)
    keys: list[bytes] = []
    pinned: set[bytes] = set()
    cap = store.config.tiers["nvme"].capacity
    for i in range(n):
        k = key(i)
        clock.advance(1.0)
        assert store.put(k, content(k, CHUNK), LAYOUT)
        keys.append(k)
        if i % pin_every == 0:
            assert store.pin("keep", [k]) == 1
            pinned.add(k)
        j = rng.randrange(max(0, i - 150), i + 1)
        store.get(keys[j])
        store.flush()
        tier = store.stats().tiers["nvme"]
        assert tier.disk_bytes <= cap, f"over capacity after put {i}"
    return keys, pinned


def churn_store(make_store: MakeStore, policy: str, path: Path | None = None) -> tuple[Store, ManualClock]:
    clock = ManualClock()
    # 128 records' worth, segments of a 16th of it: 7 records each (a 1 GiB tier of 5.6 MiB chunks
    # has 11)
    store = make_store(path, capacity=128 * PER, eviction=policy, fsync=False, clock=clock)
    return store, clock


@pytest.mark.parametrize("policy", ["segment", "lru"])
def test_pinned_chunks_are_never_evicted_and_the_capacity_holds(make_store: MakeStore, policy: str) -> None:
    store, clock = churn_store(make_store, policy)
    keys, pinned = churn(store, clock, 400)
    assert store.stats().counters["evicted"] > 200
    for k in pinned:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK), "a pinned chunk was evicted"
    assert store.check(deep=True) == []


def test_a_tier_larger_than_the_ranking_scan_still_evicts_by_segment(make_store: MakeStore,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a tier of more chunks than one eviction ranks (``SCAN_MAX``), the rest count as the
    most recently used: still whole segments, pins kept, capacity held."""
    import store.ops.eviction

    monkeypatch.setattr(store.ops.eviction, "SCAN_MAX", 16)
    s, clock = churn_store(make_store, "segment")
    _keys, pinned = churn(s, clock, 300)
    st = s.stats()
    assert st.counters["evicted"] > 100 and st.write_amplification <= 1.1
    assert s.locate(sorted(pinned)) == ["nvme"] * len(pinned)
    assert s.check(deep=True) == []


def test_segment_policy_keeps_write_amplification_near_one_under_churn(make_store: MakeStore,
                                                                       tmp_path: Path) -> None:
    """The same seeded churn through both policies: exact LRU leaves dead space in partly
    live segments and compaction moves live bytes; the segment policy moves pinned chunks
    only, once (they go to segments of their own)."""
    wa = {}
    for policy in ("segment", "lru"):
        store, clock = churn_store(make_store, policy, tmp_path / policy)
        churn(store, clock, 400)
        st = store.stats()
        wa[policy] = (st.write_amplification, st.counters["compacted_bytes"] / st.counters["payload_bytes"])
        store.close()
    assert wa["segment"][0] <= 1.1, wa
    assert wa["segment"][1] <= 0.05, wa  # moved bytes: the pins, about once each
    assert wa["lru"][1] > 2 * wa["segment"][1], wa  # the LRU baseline does move live bytes here


def test_chosen_segments_leave_the_index_and_the_disk(make_store: MakeStore, tmp_path: Path) -> None:
    """One eviction: each segment it removed is gone from the index with all its chunks (its
    pinned one moved elsewhere, bit-exact) and its file is gone from the tier's folder; the
    segments left are exactly the files left; the store reopens and serves the rest bit-exact."""
    store, clock = churn_store(make_store, "segment", tmp_path / "s")
    n = 112  # 16 segments of 7 records: 112 records and 16 headers in a 128-record tier
    for i in range(n):
        clock.advance(1.0)
        assert store.put(key(i), content(key(i), CHUNK), LAYOUT)
    pinned = [key(i) for i in range(3, n, 7)]  # one in each segment: none is cheaper for its pins
    assert store.pin("keep", pinned) == len(pinned)
    for i in range(7, n):  # all but the first segment read again: the first is the coldest
        clock.advance(1.0)
        assert store.get(key(i)) is not None
    store.flush()
    nvme = Path(store.path) / "nvme"
    idx = store._index  # the test reads the index as the store keeps it

    def segments() -> dict[int, list[bytes]]:
        with idx.read() as t:
            return {sid: [k for k, _e in t.entries_in_segment(sid)] for sid, _s in t.segments()}

    def files() -> set[str]:
        return {p.name for p in nvme.iterdir() if p.name.startswith("seg-")}

    before = segments()
    assert [len(v) for v in before.values()] == [7] * 16 and len(files()) == 16
    for i in range(n, n + 16):  # the tier fills: one eviction
        clock.advance(1.0)
        assert store.put(key(i), content(key(i), CHUNK), LAYOUT)
    after = segments()
    gone = set(before) - set(after)
    assert min(before) in gone  # the coldest segment went first
    in_gone = {k for sid in gone for k in before[sid]}
    assert key(3) in in_gone
    where = dict(zip(sorted(in_gone), store.locate(sorted(in_gone)), strict=True))
    assert {k for k, w in where.items() if w is not None} == set(pinned) & in_gone  # only the pins stayed ...
    assert all(k not in before.get(sid, ()) for sid in after for k in after[sid] if k in in_gone)  # ... moved
    assert len(files()) == len(after)  # the removed segments' files are gone, no other file is left
    assert store.stats().tiers["nvme"].dead_bytes == 0  # whole segments went: nothing left to compact
    assert store.check(deep=True) == []
    kept = [k for k, w in zip([key(i) for i in range(n + 16)], store.locate([key(i) for i in range(n + 16)]),
                              strict=True) if w is not None]
    assert set(pinned) <= set(kept) and len(kept) >= n + 16 - 3 * 7
    store.close()
    store = make_store(tmp_path / "s", capacity=128 * PER, eviction="segment", fsync=False)
    for k in kept:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, CHUNK)
    assert store.check(deep=True) == []


@pytest.mark.parametrize("policy", ["segment", "lru"])
def test_retired_fingerprints_go_first_under_either_policy(make_store: MakeStore, policy: str) -> None:
    per = SMALL_FMT.chunk_bytes + 4096
    clock = ManualClock()
    store = make_store(capacity=128 * per, retire_after_s=0.3, clock=clock, eviction=policy)
    old = Namespace("m", SMALL_FMT, model_fingerprint="a" * 32)
    new = Namespace("m", SMALL_FMT, model_fingerprint="b" * 32)
    other = Namespace("other-model", SMALL_FMT, model_fingerprint="c" * 32)
    store.register_namespace(other)
    other_keys = other.chunk_keys(list(range(5000, 5000 + 16 * 48)))
    for k in other_keys:  # written first: the oldest segments are the other model's
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    store.register_namespace(old)
    old_keys = old.chunk_keys(list(range(16 * 60)))
    for k in old_keys:
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    store.pin("keep", old_keys[:2])
    clock.advance(0.4)
    store.register_namespace(new)
    store.register_namespace(other)
    assert store.retired_namespaces() == {old.ns_id}
    for k in old_keys[2:]:
        assert store.get(k) is not None  # the retired chunks are the most recently used
    store.flush()
    new_keys = new.chunk_keys(list(range(2000, 2000 + 16 * 20)))
    for k in new_keys:
        assert store.put(k, content(k, SMALL_FMT.chunk_bytes), SMALL_LAYOUT, tokens=16)
    assert store.locate(old_keys[:2]) == ["nvme", "nvme"]  # pinned
    assert store.locate(old_keys[2:]).count(None) >= 8  # the retired fingerprint went first ...
    assert store.locate(other_keys) == ["nvme"] * len(other_keys)  # ... not the older, unrelated model
    assert store.check(deep=True) == []


def test_the_setting_is_checked_and_an_older_store_opens_with_the_default(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="eviction must be one of segment, lru"):
        StoreConfig(eviction="fifo").validate()
    doc = json.loads(StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}).to_json())
    del doc["eviction"]  # settings recorded by a version without it
    assert StoreConfig.from_json(json.dumps(doc)).eviction == "segment"
    s = Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, eviction="lru"))
    s.close()
    s = Store(tmp_path / "s")
    assert s.config.eviction == "lru"  # recorded in the store
    s.close()


def test_the_churn_benchmark_runs_quick(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "churn.py"), "--quick", "--json",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["summary"]) == {"churn", "zipf", "chat", "flood"}
    assert all({"lru", "segment", "lru-sim"} <= set(p) for p in out["summary"].values())
    assert out["goals"]["pins_and_capacity_kept"] is True
    assert out["goals"]["churn_wa"] < 1.1
    assert list(tmp_path.iterdir()) == []  # its stores are removed
