"""The event log: what happened to chunks and pins, kept in the index, bounded.

Events are written in the transaction that makes the change they describe (an eviction,
a corrupt chunk dropped, a pin), so logging costs no transaction of its own; dropped
saves, which change nothing in the index, arrive in batches (``Store.record_dropped_saves``).

Rows of the ``events`` sub-database (their keys are declared in store/index/schema.py):

=============================  ==============  ==============================================
key                            value           what
=============================  ==============  ==============================================
``e`` + seq (BE u64)           event JSON      one event, oldest first (``event_row``)
``k`` + chunk key              seq (BE u64)    the latest event that names the chunk (``event_key_row``)
``r`` + seq (BE u64) + key     empty           the chunks an event names, to trim them (``event_ref_row``)
=============================  ==============  ==============================================

Counters in ``meta``: ``c:event_seq`` (the last seq), ``c:events`` and ``c:event_keys``
(rows kept) and ``c:ev:<kind>:<reason>``, the chunks (or pins) of every event ever added,
which outlive the log: a metrics exporter reads them with ``Store.event_counters``.

The log keeps at most ``event_log_max`` events and names at most ``KEYS_PER_EVENT`` times
that many chunks; past either, the oldest events go first.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

from . import Index, Txn
from .schema import EVENT_COUNTER, EVENT_ROW, event_key_row, event_ref_row, event_row, event_seq

#: event kinds and the name of each one's counter family
METRICS = {"evict": "evictions_total", "corrupt": "corrupt_total", "save-dropped": "saves_dropped_total",
           "pin": "pins_total", "unpin": "unpins_total", "remote-copy": "remote_copies_total",
           "announce": "announced_total"}
KINDS = tuple(METRICS)
#: chunks the log names per event, on average at most (an eviction may name many)
KEYS_PER_EVENT = 16

_BE64 = struct.Struct(">Q")
_event_row, _ref_row, _key_row = event_row, event_ref_row, event_key_row


class EventLog:
    """The store's event log (see the module's docstring)."""

    def __init__(self, index: Index, max_events: Callable[[], int]) -> None:
        self.index = index
        self._max = max_events

    # -- writing (inside a write transaction) ---------------------------------------------
    def add(self, t: Txn, kind: str, reason: str, keys: Sequence[bytes] = (), **fields: Any) -> None:
        """Append an event in ``t``: ``kind`` and ``reason``, the chunks it names (``keys``),
        and ``fields`` (``chunks``: how many it counts, when not ``len(keys)``; ``tier``,
        ``label``, ``uid``, ``bytes``, ``detail`` ...; None values are left out)."""
        bound = max(1, self._max())
        key_bound = bound * KEYS_PER_EVENT
        named = list(dict.fromkeys(bytes(k) for k in keys))[:key_bound]
        count = int(fields.pop("chunks", len(keys)))
        seq = t.add("event_seq", 1)
        doc: dict[str, Any] = {"seq": seq, "time": round(self.index.clock.time(), 6), "kind": kind, "reason": reason,
                               "chunks": count}
        doc.update((k, v) for k, v in fields.items() if v is not None and v != "")
        if named:
            doc["key"] = named[0].hex()
        t.put("events", _event_row(seq), json.dumps(doc, separators=(",", ":")).encode())
        packed = _BE64.pack(seq)
        for k in sorted(named):  # in key order: neighbouring puts touch the same pages
            t.put("events", _key_row(k), packed)
            t.put("events", _ref_row(seq, k), b"")
        t.add("events", 1)
        t.add("event_keys", len(named))
        t.add(f"ev:{kind}:{reason}", count)
        self.trim(t, keep=seq)

    def trim(self, t: Txn, keep: int | None = None) -> None:
        """Drop the oldest events until the log is within its bound (``event_log_max``
        events, and chunks named); event ``keep`` (default: the newest) stays, however many
        chunks it names."""
        bound = max(1, self._max())
        key_bound = bound * KEYS_PER_EVENT
        events, refs = t.counter("events"), t.counter("event_keys")
        keep = t.counter("event_seq") if keep is None else keep  # the newest event always stays
        dropped = False
        while events > bound or refs > key_bound:
            first = next(t.keys("events", EVENT_ROW), None)
            if first is None:
                break
            oldest = event_seq(first)
            if oldest == keep:
                break
            refs -= self._drop(t, oldest)
            events -= 1
            dropped = True
        if dropped:
            t.set_counter("events", max(0, events))
            t.set_counter("event_keys", max(0, refs))

    def _drop(self, t: Txn, seq: int) -> int:
        """Remove event ``seq`` and what it names; how many chunks it named."""
        t.delete("events", _event_row(seq))
        lo = _ref_row(seq)
        named = list(t.keys("events", lo))
        packed = _BE64.pack(seq)
        for row in named:
            t.delete("events", row)
            key = row[len(lo):]
            if t.get("events", _key_row(key)) == packed:
                t.delete("events", _key_row(key))
        return len(named)

    # -- reading ----------------------------------------------------------------------------
    def recent(self, since: float | None = None, kinds: Sequence[str] | None = None,
               limit: int = 100, after: int | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` events (0: all) since ``since`` (a time), of ``kinds`` (None:
        all), after event ``after`` (a ``seq``; None: from the oldest), oldest first. One read
        transaction, newest to oldest."""
        out: list[dict[str, Any]] = []
        if not self.index.has_events:
            return out
        with self.index.read() as t:
            for _k, v in t.rows_newest_first("events", EVENT_ROW):
                doc = _decode(v)
                if doc is not None:
                    if since is not None and doc.get("time", 0) < since:
                        break
                    if after is not None and doc.get("seq", 0) <= after:
                        break
                    if kinds is None or doc.get("kind") in kinds:
                        out.append(doc)
                        if limit and len(out) >= limit:
                            break
        out.reverse()
        return out

    def last_seq(self) -> int:
        """The ``seq`` of the newest event ever logged (0: none yet), kept or dropped."""
        if not self.index.has_events:
            return 0
        with self.index.read() as t:
            return t.counter("event_seq")

    def keys_of(self, seq: int) -> list[bytes]:
        """The chunks event ``seq`` names (empty once the log dropped it), in key order."""
        out: list[bytes] = []
        if not self.index.has_events:
            return out
        lo = _ref_row(seq)
        with self.index.read() as t:
            out = [k[len(lo):] for k in t.keys("events", lo)]
        return out

    def latest(self, keys: Sequence[bytes]) -> dict[bytes, dict[str, Any]]:
        """The latest event that names each of ``keys`` (where the log still has one)."""
        out: dict[bytes, dict[str, Any]] = {}
        if not self.index.has_events:
            return out
        with self.index.read() as t:
            for k in keys:
                seq = t.get("events", _key_row(k))
                if seq is None:
                    continue
                doc = _decode(t.get("events", EVENT_ROW + seq))
                if doc is not None:
                    out[k] = doc
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Every event counter: ``{"evictions_total": {"lru": 12, ...}, "corrupt_total": {...},
        "saves_dropped_total": {...}, "pins_total": {...}, "unpins_total": {...},
        "remote_copies_total": {...}}`` (each family present, empty when nothing was counted)."""
        out: dict[str, dict[str, int]] = {name: {} for name in METRICS.values()}
        prefix = EVENT_COUNTER
        with self.index.read() as t:
            for k, v in t.rows("meta", prefix):
                kind, _, reason = k[len(prefix):].decode(errors="replace").partition(":")
                name = METRICS.get(kind, f"{kind.replace('-', '_')}_total")
                out.setdefault(name, {})[reason] = int(struct.unpack("<Q", bytes(v))[0])
        return out


def _decode(raw: bytes | memoryview | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        doc = json.loads(bytes(raw))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
