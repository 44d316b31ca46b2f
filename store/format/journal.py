"""The metadata journal: what a lost index cannot get back from the segment files.

Chunks describe themselves (every record carries its key, layout and checksum), so
``Store.rebuild_index`` recovers them from the segments alone. Pins, labels, namespace
records, the store's settings and the key of its salt digests live only in the index. The
journal keeps them too: an append-only file beside the index (``STORE/meta.journal``,
0600) to which every change of them is added after its index transaction commits.

A record is a 4-byte little-endian length, the xxh64 of the body, and the body (compact
JSON ``{"op": ..., ...}``). Reading stops at the first record that does not check out (a
torn tail after a crash). Several processes append to one journal: each append is one
``write`` under an exclusive ``flock``; compaction replaces the file with a snapshot of the
index (written beside it, then renamed), and appenders that find the path pointing to a
new file reopen it.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from .private import open_file

_HEAD = struct.Struct("<IQ")
#: compaction rewrites the journal once it is this large
COMPACT_BYTES = 32 << 20


class MetaJournal:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:  # never through a link, never another user's file
            self._fd = open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "metadata journal")
        return self._fd

    def _current(self) -> int:
        """The journal's fd, locked, reopened if compaction replaced the file meanwhile."""
        for _ in range(8):
            fd = self._open()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.lstat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self._fd = None
        raise OSError(f"the metadata journal {self.path} keeps being replaced")

    @staticmethod
    def encode(op: str, **fields: Any) -> bytes:
        body = json.dumps({"op": op, **fields}, separators=(",", ":"), sort_keys=True).encode()
        return _HEAD.pack(len(body), xxhash.xxh64_intdigest(body)) + body

    def append(self, op: str, **fields: Any) -> None:
        """Add one record, durably (fdatasync)."""
        rec = self.encode(op, **fields)
        fd = self._current()
        try:
            os.write(fd, rec)
            os.fdatasync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every intact record, oldest first (nothing when there is no journal)."""
        try:
            fd = open_file(self.path, os.O_RDONLY, "metadata journal", written=False)
        except FileNotFoundError:
            return
        with open(fd, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _HEAD.size <= len(data):
            n, digest = _HEAD.unpack_from(data, pos)
            body = data[pos + _HEAD.size : pos + _HEAD.size + n]
            if len(body) != n or xxhash.xxh64_intdigest(body) != digest:
                return  # a torn tail
            try:
                rec = json.loads(body)
            except ValueError:
                return
            if isinstance(rec, dict):
                yield rec
            pos += _HEAD.size + n

    def size(self) -> int:
        try:
            return os.path.getsize(self.path)
        except FileNotFoundError:
            return 0

    def replace(self, snapshot: Callable[[], list[bytes]]) -> None:
        """Compaction: the journal becomes ``snapshot()`` (encoded records of the current
        state), taken while appends wait, so none is lost between the two."""
        fd = self._current()
        try:
            tmp = self.path + ".new"
            try:  # one a compaction killed midway left: made anew, never written through
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            out = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "metadata journal")
            try:
                for rec in snapshot():
                    os.write(out, rec)
                os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, self.path)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        self._fd = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def replay(records: Iterator[dict[str, Any]]) -> dict[str, Any]:
    """The metadata state the records describe: settings, salt key, namespace records and
    each label's keys (hex)."""
    state: dict[str, Any] = {"config": None, "salt_key": None, "namespaces": {}, "labels": {}, "dropped": set()}
    for rec in records:
        op = rec.get("op")
        if op == "config":
            state["config"] = rec.get("config")
        elif op == "salt_key":
            state["salt_key"] = rec.get("key")
        elif op == "ns":
            state["namespaces"][rec["id"]] = rec["doc"]
        elif op == "drop_segments":
            state["dropped"].update(int(i) for i in rec.get("ids", []))
        elif op == "pin":
            entry = state["labels"].setdefault(rec["label"], {"keys": {}, "expected": 0})
            entry["expected"] = max(entry["expected"], int(rec.get("expected", 0)))
            for k in rec.get("keys", []):
                entry["keys"][k] = True
        elif op == "unpin":
            if rec.get("keys") is None:
                state["labels"].pop(rec["label"], None)
            elif rec["label"] in state["labels"]:
                keys = state["labels"][rec["label"]]["keys"]
                for k in rec["keys"]:
                    keys.pop(k, None)
                if not keys:
                    state["labels"].pop(rec["label"], None)
    return state
