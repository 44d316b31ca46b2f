"""``drain``: this instance's chunks copied to the shared tier before scale-down, pinned documents
first, then the hottest, within a budget and a deadline."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from store import ChunkInfo, Namespace, Store, StoreError

from ..errors import UsageError
from ..selection import arg, recorded_namespaces
from .base import Job, names_of
from .pins import pinned_entries

#: ``drain`` logs an event and streams what went every this many chunks copied, or this often
DRAIN_BATCH, DRAIN_FLUSH_S = 64, 1.0
#: why ``drain`` left a chunk behind; the first two are the operator's limits
DRAIN_REASONS = ("budget", "deadline", "refused", "unreadable", "gone")


def _hotness(c: ChunkInfo) -> tuple[bool, float, int]:
    """How ``drain`` orders chunks, hottest first: those hit since stored, most recently used
    first (then by hits), then those never hit, most recently used first."""
    return c.hits == 0, -c.last_access, -c.hits


@dataclasses.dataclass
class _Unit:
    """What ``drain`` copies as one: a pinned document (all its stored chunks, or nothing
    for the budget) or one chunk. ``row``: the report row of the pinned entry it is part of
    (None: an unpinned chunk); ``entry``: the manifest fields of a document (None: its chunks
    go as keys entries)."""

    keys: list[tuple[bytes, int]]  # each chunk's key and stored bytes
    row: dict[str, Any] | None
    entry: dict[str, Any] | None
    order: tuple[bool, float, int]


class _Drain:
    """The state of one ``drain``: what went, what did not and why, and the manifest entries
    not yet streamed to the client (they go, with an event, every ``DRAIN_BATCH`` chunks)."""

    def __init__(self, store: Store, job: Job, budget: int | None, deadline_s: float | None, dry_run: bool,
                 names: dict[bytes, Namespace], order: list[bytes], reader: Executor) -> None:
        self.store, self.job, self.budget, self.deadline_s, self.dry_run = store, job, budget, deadline_s, dry_run
        self.names, self.order, self.total = names, order, len(order)
        self.next_of = dict(zip(order, order[1:], strict=False))  # the chunk after each, in drain's order
        self.reader = reader
        self.ahead: tuple[bytes, Future[Any]] | None = None
        self.start = time.monotonic()
        self.stopped: str | None = None
        self.copied: set[bytes] = set()
        self.went = {"chunks": 0, "bytes": 0, "pinned_chunks": 0, "documents": 0}
        self.left = {r: {"chunks": 0, "bytes": 0, "pinned_chunks": 0} for r in DRAIN_REASONS}
        self.unlogged: list[bytes] = []
        self.unlogged_bytes = 0
        self.pending: list[dict[str, Any]] = []  # manifest entries not streamed yet
        self.keys_entry: dict[tuple[str | None, bytes], list[str]] = {}  # chunks that went, by label, namespace
        self.n = 0
        self.flushed = self.start

    def read(self, key: bytes) -> Any:
        """``Store.read_stored(key)``, read ahead while the chunk before was put; then the read
        of the chunk after it starts (the local read and the remote put overlap)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == key:
            got = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].result()  # a read for a chunk that does not go now: let it end
            got = self.store.read_stored(key)
        after = self.next_of.get(key)
        if after is not None:
            self.ahead = (after, self.reader.submit(self.store.read_stored, after))
        return got

    def out_of_time(self) -> bool:
        return self.deadline_s is not None and time.monotonic() - self.start >= self.deadline_s

    def leave(self, chunks: list[tuple[bytes, int]], reason: str, row: dict[str, Any] | None) -> None:
        for _k, size in chunks:
            self.left[reason]["chunks"] += 1
            self.left[reason]["bytes"] += size
            self.left[reason]["pinned_chunks"] += row is not None
        if row is not None and chunks:
            row["left"] += len(chunks)
            row["reason"] = row["reason"] or reason

    def run(self, u: _Unit) -> None:
        """Copy one unit, or leave it (the limits, checked before it starts)."""
        todo = [c for c in u.keys if c[0] not in self.copied]
        if u.row is not None:
            u.row["went"] += len(u.keys) - len(todo)  # copied already, under another label
        need = sum(size for _k, size in todo)
        if todo and self.stopped is None and self.out_of_time():
            self.stopped = "deadline"
        if todo and self.stopped is None and self.budget is not None and self.went["bytes"] + need > self.budget:
            self.stopped = "budget"  # in order: nothing colder goes while something hotter stayed
        if todo and self.stopped is not None:
            self.leave(todo, self.stopped, u.row)
            return
        went: list[bytes] = []
        for i, (key, size) in enumerate(todo):
            self.job.progress(self.n, self.total, "copying to the remote tier")  # where a cancel lands
            self.n += 1
            if self.out_of_time():  # a document that runs into the deadline goes in part
                self.stopped = "deadline"
                self.leave(todo[i:], "deadline", u.row)
                break
            what, n = ("copied", size) if self.dry_run else self.store.copy_to_remote(key, self.read(key))
            if what != "copied":
                self.leave([(key, size)], what, u.row)
                continue
            went.append(key)
            self.copied.add(key)
            self.went["chunks"] += 1
            self.went["bytes"] += n
            self.went["pinned_chunks"] += u.row is not None
            self.unlogged.append(key)
            self.unlogged_bytes += n
            if u.row is not None:
                u.row["went"] += 1
                u.row["bytes"] += n
        if u.entry is not None and u.keys and len(went) == len(todo):  # the document is whole there
            self.went["documents"] += 1
            self.pending.append(u.entry)
            self.flush()  # a frame per document (a document may be long)
            return
        label = None if u.row is None else u.row["label"]
        for k in went:
            self.keys_entry.setdefault((label, k[:16]), []).append(k.hex())
        if len(self.unlogged) >= DRAIN_BATCH or time.monotonic() - self.flushed >= DRAIN_FLUSH_S:
            self.flush()

    def entries(self) -> list[dict[str, Any]]:
        """The manifest entries to stream now: the documents that went, then keys entries."""
        out, self.pending = self.pending, []
        for (label, nid), keys in self.keys_entry.items():
            out.append({**names_of(self.names.get(nid), label), "keys": keys})
        self.keys_entry = {}
        return out

    def log(self) -> None:
        """The event that says the chunks copied since the last one are in the remote tier."""
        if self.unlogged and not self.dry_run:
            self.store.log_remote_copies(self.unlogged, self.unlogged_bytes)
        self.unlogged, self.unlogged_bytes = [], 0

    def flush(self) -> None:
        self.flushed = time.monotonic()
        self.log()
        rows = self.entries()
        if rows:
            self.job.emit(rows, into="manifest")


def op_drain(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """``lmctl drain``: copy this store's chunks to the remote tier before the instance goes,
    pinned documents first, then by recent hits (``_hotness``), within ``budget`` (a size
    with a unit: stored bytes copied) and ``deadline_s``; the local copies stay. Manifest
    entries of what went stream to the client (``into: manifest``) as chunks go, each after
    its chunks are whole in the remote tier, so a client that stops part way holds a manifest
    of chunks that are all there. Returns the report (docs/cli.md, drain)."""
    from store.config import parse_unit_size

    budget = arg(args, "budget", str)
    limit = None
    if budget is not None:
        try:
            limit = parse_unit_size(budget, "--budget")
        except StoreError as exc:
            raise UsageError(str(exc)) from None
    deadline_s = arg(args, "deadline_s", float)
    if deadline_s is not None and not 0 < deadline_s <= 366 * 86400:
        raise UsageError("--deadline must be a duration between 1s and 366d")
    dry_run = arg(args, "dry_run", bool, False)
    if not store.has_remote:
        refused = store.stats().remote_refused
        raise UsageError("this store has no remote tier to drain to" + (
            f" (it did not start: {refused})" if refused else "") + "; configure one first: lmctl config set "
            "remote.url=redis://HOST:PORT remote.secret_file=FILE")
    recorded = recorded_namespaces(store)
    names = {r.nid: r.ns for r in recorded}

    # pinned entries first (a document whole, other pinned chunks one by one), hottest first
    rows: list[dict[str, Any]] = []
    units: list[_Unit] = []
    labels = store.labels()
    for name in sorted(labels):
        for entry, keys in pinned_entries(store, name, labels[name], None, names):
            infos = [c for c in (store.info(k) for k in keys) if c is not None]
            chunks = [(c.key, c.stored_bytes) for c in infos]
            doc = "keys" not in entry
            row = {"label": name, "model": entry.get("model"), "adapter": entry.get("adapter"),
                   "document": next((k for k in ("text", "messages", "tokens") if k in entry), "keys"),
                   "chunks": len(infos), "not_stored": len(keys) - len(infos), "went": 0, "bytes": 0, "left": 0,
                   "reason": None}
            rows.append(row)
            if doc:
                units.append(_Unit(chunks, row, entry, min((_hotness(c) for c in infos), default=(True, 0.0, 0))))
            else:
                units.extend(_Unit([(c.key, c.stored_bytes)], row, None, _hotness(c)) for c in infos)
    units.sort(key=lambda u: u.order)
    # then every other chunk, hottest first (what a pin holds went above)
    cold = sorted((_hotness(c), c.key, c.stored_bytes) for c in store.iter_chunks() if c.pin_refs == 0)
    order = list(dict.fromkeys([k for u in units for k, _n in u.keys] + [k for _o, k, _n in cold]))
    total = len(order)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmctl-drain-read") as reader:
        d = _Drain(store, job, limit, deadline_s, dry_run, names, order, reader)
        try:
            for u in units:
                d.run(u)
            for hot, k, size in cold:
                d.run(_Unit([(k, size)], None, None, hot))
        finally:
            d.log()  # a cancelled drain too: what went is in the remote tier, and the log says so
    d.flush()
    job.progress(total, total, "copied to the remote tier")
    for r in rows:
        r["status"] = "went" if not r["left"] else "left" if not r["went"] else "partial"
    for i in range(0, len(rows), 1000):
        job.emit(rows[i:i + 1000], into="pinned")
    left_pinned = sum(1 for r in rows if r["left"] and r["reason"] != "gone")
    left = {"chunks": sum(x["chunks"] for x in d.left.values()), "bytes": sum(x["bytes"] for x in d.left.values()),
            "pinned_chunks": sum(x["pinned_chunks"] for x in d.left.values()),
            "reasons": {r: x for r, x in d.left.items() if x["chunks"]}}
    return {"dry_run": dry_run, "budget": limit, "deadline_s": deadline_s,
            "elapsed_s": round(time.monotonic() - d.start, 3), "stopped": d.stopped, "went": d.went, "left": left,
            "pinned_entries": len(rows), "pinned_left": left_pinned, "pinned": [], "manifest": []}
