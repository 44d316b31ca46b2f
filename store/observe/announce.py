"""What engines announced to routers about chunks, kept so that a restarted engine can
announce them again.

An engine that publishes KV events (``engine_hook.announce``) tells routers, for each chunk
it saves, the engine's own block hashes and the chunk's token ids. Neither can be computed
again from what the index holds (the block hashes depend on the cache salt, which the store
keeps only as a digest), so the engine leaves them here, opaque to the store: one record per
chunk, written in batches.

Rows of the ``announce`` sub-database (keys declared in store/index/schema.py):

===============================================  ============  ================================
key                                              value         what
===============================================  ============  ================================
``p`` + chain position (BE u32) + chunk key      record        one chunk's announcement
``k`` + chunk key                                position      to find (and drop) it by key
===============================================  ============  ================================

Reading ``p`` rows in key order gives every chain's root before its children (position 0 of
every chain first), the order routers need: llm-d drops a block whose parent it has not seen.

Records are hints, never KV: a reader validates what it decodes, and a record whose chunk
has left the store is dropped when it is met (``Announcements.forget``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..index import Index, Txn
from ..index.schema import ANNOUNCE_ROW, announce_key_row, announce_row, key_after

_BE32 = struct.Struct(">I")
#: the largest record kept (a 256-token chunk's record is about 1.5 KB)
MAX_RECORD = 64 * 1024
MAX_POSITION = 2**32 - 1


class Announcements:
    """The ``announce`` sub-database (see the module's docstring)."""

    def __init__(self, index: Index) -> None:
        self.index = index

    def usable(self) -> bool:
        return self.index.has_announce and self.index.readonly_reason is None

    def note(self, t: Txn, items: Sequence[tuple[bytes, int, bytes]]) -> int:
        """In ``t``: keep ``(chunk key, chain position, record)`` for each item; a record over
        ``MAX_RECORD`` bytes or a position out of range is skipped. How many were kept."""
        n = 0
        for key, pos, rec in items:
            key, pos, rec = bytes(key), int(pos), bytes(rec)
            if not key or not 0 <= pos <= MAX_POSITION or len(rec) > MAX_RECORD:
                continue
            old = t.get("announce", announce_key_row(key))
            if old is not None and old != _BE32.pack(pos):
                t.delete("announce", announce_row(old, key))
            t.put("announce", announce_key_row(key), _BE32.pack(pos))
            t.put("announce", announce_row(pos, key), rec)
            n += 1
        return n

    def forget(self, t: Txn, keys: Sequence[bytes]) -> int:
        """In ``t``: drop the records of ``keys``; how many there were."""
        n = 0
        for key in keys:
            key = bytes(key)
            pos = t.get("announce", announce_key_row(key))
            if pos is None:
                continue
            t.delete("announce", announce_key_row(key))
            t.delete("announce", announce_row(pos, key))
            n += 1
        return n

    def page(self, after: bytes | None = None, limit: int = 256) -> list[tuple[bytes, int, bytes, bytes]]:
        """Up to ``limit`` records in announcing order (chain position, then key), after the
        row ``after`` (a cursor: the last item's row), as ``(row, position, chunk key,
        record)``. One short read transaction."""
        out: list[tuple[bytes, int, bytes, bytes]] = []
        if not self.index.has_announce:
            return out
        with self.index.read() as t:
            for row, value in t.rows("announce", ANNOUNCE_ROW, start=key_after(after) if after else None):
                if len(out) >= limit:
                    break
                if len(row) > 5:
                    out.append((row, _BE32.unpack(row[1:5])[0], row[5:], value))
        return out

    def get(self, keys: Sequence[bytes]) -> dict[bytes, tuple[int, bytes]]:
        """The position and record of each of ``keys`` that has one."""
        out: dict[bytes, tuple[int, bytes]] = {}
        if not self.index.has_announce:
            return out
        with self.index.read() as t:
            for key in keys:
                key = bytes(key)
                pos = t.get("announce", announce_key_row(key))
                if pos is None or len(pos) != 4:
                    continue
                rec = t.get("announce", announce_row(pos, key))
                if rec is not None:
                    out[key] = (_BE32.unpack(pos)[0], rec)
        return out
