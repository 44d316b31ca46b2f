"""Listings and statistics at scale, through a real daemon: cursor paging returns every
chunk once while another process writes, sorted pages are in order, and inspect or evict
--dry-run scoped by a selector equals a recount of the chunks the selector picks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL_FMT, SMALL_LAYOUT
from test_daemon import Daemon, cj, cli

from lmctl.client import Client, RemoteError
from store import AdapterIdentity, ChunkInfo, GiB, MiB, Namespace, PutItem, Store, StoreConfig, TierConfig
from store.clock import ManualClock

BASE = Namespace("m", SMALL_FMT)
CIVIL = Namespace("m", SMALL_FMT, AdapterIdentity("civil", "3f" * 16))
OTHER = Namespace("o", SMALL_FMT)


def build(path: Path) -> dict[str, list[bytes]]:
    """Three namespaces, sizes that differ (each at most one chunk of SMALL_FMT), two labels, some chunks moved
    to dram, some read."""
    tiers = {"nvme": TierConfig(capacity=1 * GiB), "dram": TierConfig(capacity=64 * MiB, path=str(path / "dram"))}
    keys: dict[str, list[bytes]] = {}
    clock = ManualClock()
    with Store(path, StoreConfig(tiers=tiers, default_tier="nvme", segment_bytes=1 * MiB), clock=clock) as s:
        for name, ns, n in (("base", BASE, 120), ("civil", CIVIL, 70), ("other", OTHER, 50)):
            s.register_namespace(ns, {"model_id": ns.model})
            keys[name] = ns.chunk_keys(list(range(n * 16)))
            s.put_many([PutItem(k, bytes(64 + 4000 * (i % 3)), SMALL_LAYOUT, 16) for i, k in enumerate(keys[name])])
            clock.advance(0.01)  # namespaces written at different times: age orders them
        s.pin("doc", keys["base"][:30] + keys["civil"][:5])
        s.pin("doc", [b"\x07" * 48])  # pinned before it is stored
        s.pin("hot", keys["base"][20:40])
        s.rewrite(keys["base"][::7] + keys["other"][:9], tier="dram")
        for k in keys["civil"][10:20]:
            s.get(k)
    return keys


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Daemon, dict[str, list[bytes]]]]:
    keys = build(tmp_path / "store")
    d = Daemon(tmp_path / "store")
    d.start()
    yield d, keys
    assert d.stop() == 0


def pages(client: Client, args: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cursor = None
    while True:
        r = client.call("ls", {**args, "limit": limit, **({"cursor": cursor} if cursor else {})})
        assert len(r["chunks"]) <= limit
        rows += r["chunks"]
        cursor = r["next"]
        if cursor is None:
            assert r["truncated"] is False
            return rows
        assert r["truncated"] is True and len(r["chunks"]) == limit


def picked(path: Path, keep: Callable[[ChunkInfo], bool]) -> list[ChunkInfo]:
    with Store(path, readonly=True) as s:
        return [c for c in s.iter_chunks() if keep(c)]


def test_cursor_pages_return_every_chunk_once_while_another_process_writes(
        served: tuple[Daemon, dict[str, list[bytes]]]) -> None:
    d, keys = served
    before = {k.hex() for ks in keys.values() for k in ks}
    stop = threading.Event()
    added: list[bytes] = []

    def writer() -> None:  # another process's store: new chunks in, some of them out again
        with Store(d.store) as s:
            n = 0
            while not stop.is_set():
                new = BASE.chunk_keys(list(range(10_000 + n * 160, 10_000 + (n + 1) * 160)))
                s.put_many([PutItem(k, bytes(64), SMALL_LAYOUT, 16) for k in new])
                added.extend(new)
                s.evict(new[::2])
                n += 1

    t = threading.Thread(target=writer)
    t.start()
    client = Client(str(d.sock), timeout=60)
    try:
        for args, expect in (({}, before), ({"model": "m"}, {k.hex() for k in keys["base"] + keys["civil"]}),
                             ({"label": "doc"}, {k.hex() for k in keys["base"][:30] + keys["civil"][:5]})):
            rows = pages(client, args, 17)
            got = [r["key"] for r in rows]
            assert len(got) == len(set(got)), "a chunk was listed twice"
            assert got == sorted(got), "pages are not in key order"
            assert expect <= set(got), "a chunk stored throughout was not listed"
            assert set(got) <= expect | {k.hex() for k in added}
    finally:
        stop.set()
        t.join()
        client.close()
    assert len(added) > 0


def test_sorted_pages_are_in_order_and_cover_the_selection(served: tuple[Daemon, dict[str, list[bytes]]]) -> None:
    d, keys = served
    client = Client(str(d.sock), timeout=60)
    try:
        for sort, order in (("size", lambda c: (-c.stored_bytes, c.key)), ("age", lambda c: (c.created, c.key)),
                            ("access", lambda c: (c.last_access, c.key)), ("key", lambda c: c.key)):
            for args, keep in (({}, lambda c: True), ({"model": "m", "tier": "nvme"},
                                                      lambda c: c.key[:16] != OTHER.ns_id and c.tier == "nvme")):
                want = [c.key.hex() for c in sorted(picked(d.store, keep), key=order)]  # type: ignore[arg-type]
                got = [r["key"] for r in pages(client, {**args, "sort": sort}, 23)]
                assert got == want, (sort, args)
        top = client.call("ls", {"sort": "size", "limit": 5})
        assert [r["bytes"] for r in top["chunks"]] == sorted((r["bytes"] for r in top["chunks"]), reverse=True)
        assert top["total"] == 240 and top["next"].startswith("size:")
        with pytest.raises(RemoteError, match="--sort age"):
            client.call("ls", {"sort": "size", "limit": 5, "cursor": top["next"].replace("size:", "age:", 1)})
    finally:
        client.close()
    r = cli(d, "ls", "--sort", "size", "--limit", "0")
    assert r.returncode == 2 and "--limit" in r.stderr and r.stderr.count("\n") == 1
    r = cli(d, "ls", "--cursor", "nonsense")
    assert r.returncode == 2 and "cursor" in r.stderr
    k = "ab" * 48
    for bad in (f"age:nan:{k}", f"age:1e999:{k}", f"access:-inf:{k}", f"size:{-10**30}:{k}"):
        r = cli(d, "ls", "--sort", bad.split(":")[0], "--limit", "2", "--cursor", bad)
        assert r.returncode == 2 and "is not a cursor that ls printed" in r.stderr, (bad, r.stderr)
    r = cli(d, "ls", "--limit", str(10**20))  # one line, a usage error, not an internal one
    assert r.returncode == 2 and "--limit must be" in r.stderr and r.stderr.count("\n") == 1
    r = cli(d, "events", "--limit", str(10**20))
    assert r.returncode == 2 and "--limit must be" in r.stderr
    r = cli(d, "ls", "--limit", "3")
    assert r.returncode == 0 and "last access" in r.stdout
    assert f"next page: lmctl --socket {d.sock} ls --limit 3 --cursor key::" in r.stdout


SELECTORS: list[tuple[list[str], Callable[[ChunkInfo, set[bytes], set[bytes]], bool]]] = [
    ([], lambda c, doc, hot: True),
    (["--model", "m"], lambda c, doc, hot: c.key[:16] in (BASE.ns_id, CIVIL.ns_id)),
    (["--model", "m", "--base"], lambda c, doc, hot: c.key[:16] == BASE.ns_id),
    (["--adapter", "civil"], lambda c, doc, hot: c.key[:16] == CIVIL.ns_id),
    (["--tier", "dram"], lambda c, doc, hot: c.tier == "dram"),
    (["--model", "m", "--tier", "nvme", "--unpinned"],
     lambda c, doc, hot: c.key[:16] in (BASE.ns_id, CIVIL.ns_id) and c.tier == "nvme" and not c.pin_refs),
    (["--pinned"], lambda c, doc, hot: c.pin_refs > 0),
    (["--label", "doc"], lambda c, doc, hot: c.key in doc),
    (["--label", "hot", "--tier", "nvme"], lambda c, doc, hot: c.key in hot and c.tier == "nvme"),
    (["--label", "doc", "--adapter", "civil"], lambda c, doc, hot: c.key in doc and c.key[:16] == CIVIL.ns_id),
    (["--older-than", "0s", "--model", "o"], lambda c, doc, hot: c.key[:16] == OTHER.ns_id),
    (["--older-than", "0s", "--model", "m"], lambda c, doc, hot: c.key[:16] in (BASE.ns_id, CIVIL.ns_id)),
]


@pytest.mark.parametrize(("sel", "keep"), SELECTORS, ids=[" ".join(s) or "all" for s, _k in SELECTORS])
def test_inspect_ls_and_evict_dry_run_by_selector_equal_a_filtered_recount(
        served: tuple[Daemon, dict[str, list[bytes]]], sel: list[str],
        keep: Callable[[ChunkInfo, set[bytes], set[bytes]], bool]) -> None:
    d, _keys = served
    with Store(d.store, readonly=True) as s:
        labels = s.labels()
    doc, hot = set(labels["doc"]), set(labels["hot"])
    mine = picked(d.store, lambda c: keep(c, doc, hot))
    assert mine or sel == ["--label", "hot", "--tier", "nvme"]
    r = cj(d, "inspect", *sel)
    assert r["chunks"] == len(mine)
    for tier in ("nvme", "dram"):
        in_tier = [c for c in mine if c.tier == tier]
        assert r["tiers"][tier]["chunks"] == len(in_tier)
        assert r["tiers"][tier]["bytes"] == sum(c.disk_bytes for c in in_tier)
        assert r["tiers"][tier]["pinned_chunks"] == sum(c.pin_refs > 0 for c in in_tier)
    by_adapter = {(a["model"], a["adapter"]): a["chunks"] for a in r["adapters"]}
    want: dict[tuple[str, str | None], int] = {}
    for c in mine:
        a = ("o", None) if c.key[:16] == OTHER.ns_id else ("m", str(CIVIL.adapter) if c.key[:16] == CIVIL.ns_id
                                                           else None)
        want[a] = want.get(a, 0) + 1
    assert {a: n for a, n in by_adapter.items() if n} == want
    if not sel:
        assert r["labels"] == {"doc": 36, "hot": 20}  # keys pinned, stored or not
    else:  # each label's stored chunks within the selection, counted or read
        want_labels = {name: sum(c.key in set(ks) for c in mine) for name, ks in labels.items()}
        assert r["labels"] == {name: n for name, n in want_labels.items() if n}
    ls = cj(d, "ls", "--limit", "2", *sel)
    assert ls["total"] == len(mine) and ls["bytes"] == sum(c.stored_bytes for c in mine)
    if sel:
        ev = cj(d, "evict", "--dry-run", *sel)
        assert ev["chunks"] == sum(c.pin_refs == 0 for c in mine)
        assert ev["bytes"] == sum(c.disk_bytes for c in mine if c.pin_refs == 0)
        assert ev["skipped_pinned"] == sum(c.pin_refs > 0 for c in mine)
        ev = cj(d, "evict", "--dry-run", "--force", *sel)
        assert ev["chunks"] == len(mine) and ev["pinned_removed"] == sum(c.pin_refs > 0 for c in mine)


def test_evict_by_selector_streams_and_keeps_counts(served: tuple[Daemon, dict[str, list[bytes]]]) -> None:
    d, keys = served
    dry = cj(d, "evict", "--dry-run", "--model", "m")
    done = cj(d, "evict", "--model", "m")
    assert {k: done[k] for k in ("chunks", "bytes", "skipped_pinned")} == {
        k: dry[k] for k in ("chunks", "bytes", "skipped_pinned")}
    left = picked(d.store, lambda c: c.key[:16] in (BASE.ns_id, CIVIL.ns_id))
    assert len(left) == dry["skipped_pinned"] and all(c.pin_refs for c in left)
    assert cj(d, "inspect", "--model", "m")["chunks"] == len(left)
    r = cj(d, "verify")
    assert r["ok"] and r["problems"] == []
