"""The counts the index keeps per namespace, label and tier: equal to a recount from the
chunks after every kind of change, repaired by verify --fix, built once for a store
written before they were kept."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from pathlib import Path

from conftest import SMALL_FMT, SMALL_LAYOUT, assert_counts_match, content, counts_of, recount

from store import AdapterIdentity, GiB, MiB, Namespace, PutItem, Store, StoreConfig, TierConfig
from store.index import Txn, pack_counts
from store.index.schema import label_count_key, ns_count_key

MakeStore = Callable[..., Store]
DATA = Path(__file__).resolve().parent / "data"


def put(s: Store, keys: list[bytes], size: int = 4096) -> None:
    assert all(s.put_many([PutItem(k, content(k, size), SMALL_LAYOUT, 16) for k in keys]))


def test_counts_follow_puts_pins_evictions_moves_and_compaction(tmp_path: Path, ns: Namespace) -> None:
    other = Namespace("other-model", SMALL_FMT, AdapterIdentity("civil", "ab" * 16))
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=1 * GiB), "dram": TierConfig(
        capacity=64 * MiB, path=str(tmp_path / "dram"))}, default_tier="nvme", segment_bytes=256 << 10)
    with Store(tmp_path / "s", cfg) as s:
        a, b = ns.chunk_keys(list(range(16 * 40))), other.chunk_keys(list(range(16 * 30)))
        s.pin("early", a[30:] + b[:5], expected_bytes=8192)  # pinned before they are stored
        put(s, a[:20])
        put(s, b, size=9000)
        assert_counts_match(s)
        put(s, a[20:])
        s.pin("doc", a[:10])
        s.pin("both", a[5:15] + b[:3])
        assert_counts_match(s)
        c = s.counts()
        assert c.total([ns.ns_id]).chunks == 40 and c.total([other.ns_id]).chunks == 30
        assert c.total(label="both").chunks == 13 and c.label_keys == {"early": 15, "doc": 10, "both": 13}
        assert c.total().pinned_chunks == len(set(a[:15] + a[30:] + b[:5]))
        s.unpin("both", a[5:8])
        s.evict(a[::3])
        s.evict(a[1:4], force=True)  # pinned ones too
        assert_counts_match(s)
        assert s.rewrite(a[10:25] + b[:8], tier="dram").chunks > 0
        assert s.rewrite(b[10:20], codec="zstd-shuffle", level=1).chunks == 10
        assert_counts_match(s)
        assert s.counts().total(tier="dram").chunks > 0
        s.evict(b[12:30])
        assert s.compact(min_dead_ratio=0.0).segments > 0
        assert_counts_match(s)
        s.unpin("doc")
        s.unpin("early")
        assert_counts_match(s)
        assert set(s.counts().label_keys) == {"both"}


def test_verify_finds_and_fix_repairs_drifted_counts(store: Store, ns: Namespace) -> None:
    keys = ns.chunk_keys(list(range(16 * 8)))
    put(store, keys)
    store.pin("doc", keys[:3])
    good = counts_of(store)

    def drift(t: Txn) -> None:
        t.raw.put(ns_count_key(ns.ns_id, 1), pack_counts([99, 1, 2, 3, 4, 5]), db=store._index.counts)
        t.raw.delete(label_count_key(b"doc", ns.ns_id, 1), db=store._index.counts)
        t.raw.delete(keys[0] + b"doc", db=store._index.keylabels)

    store._index.write(drift)
    assert counts_of(store) != good
    kinds = [p.kind for p in store.check()]
    assert kinds.count("counts") == 2
    fixed = store.check(fix=True)
    assert {p.kind for p in fixed} == {"counts"} and all(p.fixed for p in fixed)
    assert counts_of(store) == good == recount(store)
    store.unpin("doc", keys[:1])  # the label of keys[0] is known by key again
    assert_counts_match(store)


def test_a_store_of_the_first_format_gets_its_counts_at_open(tmp_path: Path) -> None:
    with tarfile.open(DATA / "store-format1.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    expect = json.loads((tmp_path / "expect.json").read_text())
    with Store(tmp_path / "store", readonly=True) as ro:  # read-only: nothing is built, counts are taken
        assert ro.format_version() == 1
        assert counts_of(ro) == recount(ro)
    with Store(tmp_path / "store") as s:
        assert s.format_version() == 2
        c = s.counts()
        assert c.total().chunks == len(expect["kept"]) and c.label_keys == {"doc": len(expect["pinned"])}
        assert c.total(label="doc").chunks == sum(k in expect["kept"] for k in expect["pinned"])
        assert_counts_match(s)
    with Store(tmp_path / "store", readonly=True) as ro:
        assert ro.format_version() == 2 and counts_of(ro) == recount(ro)
