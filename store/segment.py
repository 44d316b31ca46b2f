"""Append-only segment files and the records inside them.

A segment is one file, ``seg-<id>.lseg``, written by exactly one process (the one
whose id is in the index and who holds an exclusive ``flock`` on the file) and never
rewritten: records are appended at 4 KiB-aligned offsets and, once indexed, their
bytes never change. Segments are removed whole after compaction.

Record layout (all integers little-endian)::

    0   magic        8s  b"LMCTLREC"
    8   version      H
    10  codec        B
    11  flags        B
    12  key_len      H
    14  meta_len     H
    16  stored_len   Q   payload bytes as stored (after the codec)
    24  raw_len      Q   payload bytes after decoding
    32  checksum     Q   xxh3-64 of the stored payload
    40  created      d   unix time
    48  hdr_crc      I   crc32 of bytes 0..47 + key + meta
    52  reserved     12x
    64  key, meta (JSON: layout, tokens), zero padding to a multiple of 64
    ..  payload (stored_len bytes), zero padding to a multiple of 4096

Every record is self-describing, so the index can be rebuilt from segments alone.
Large transfers are split into pieces and pipelined through one I/O thread, so
that copying and hashing overlap with the disk.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from .errors import StoreError

if TYPE_CHECKING:
    from collections.abc import Buffer

ALIGN = 4096
PIECE = 8 << 20  # pipelining granularity for large transfers
REC_MAGIC = b"LMCTLREC"
SEG_MAGIC = b"LMCTLSEG"
REC_VERSION = 1
SEG_VERSION = 1
_REC = struct.Struct("<8sHBBHHQQQdI12x")
_SEG = struct.Struct("<8sHQd")
REC_FIXED = _REC.size  # 64
MAX_HEADER = ALIGN
assert REC_FIXED == 64


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def checksum(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def segment_name(seg_id: int) -> str:
    return f"seg-{seg_id:012d}.lseg"


@dataclass(frozen=True)
class RecordHeader:
    codec: int
    key: bytes
    meta: dict[str, Any]
    stored_len: int
    raw_len: int
    checksum: int
    created: float
    header_len: int

    @property
    def record_len(self) -> int:
        return align_up(self.header_len + self.stored_len)


def encode_header(
    key: bytes, codec: int, meta: dict[str, Any], stored_len: int, raw_len: int, csum: int,
    created: float,
) -> bytes:
    meta_b = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    body = _REC.pack(REC_MAGIC, REC_VERSION, codec, 0, len(key), len(meta_b), stored_len,
                     raw_len, csum, created, 0)
    crc = zlib.crc32(body[:48] + key + meta_b)
    body = body[:48] + struct.pack("<I", crc) + body[52:]
    hdr = body + key + meta_b
    total = align_up(len(hdr), 64)
    if total > MAX_HEADER:
        raise StoreError(f"record header of {total} bytes is over {MAX_HEADER}; shorten the metadata")
    return hdr + b"\0" * (total - len(hdr))


def decode_header(buf: Buffer) -> RecordHeader | None:
    """Parse a record header at the start of ``buf``; None if it is not a valid header."""
    mv = memoryview(buf)
    if len(mv) < REC_FIXED:
        return None
    (magic, version, codec, _flags, key_len, meta_len, stored_len, raw_len, csum, created,
     crc) = _REC.unpack_from(mv, 0)
    if magic != REC_MAGIC or version != REC_VERSION:
        return None
    end = REC_FIXED + key_len + meta_len
    if end > min(len(mv), MAX_HEADER):
        return None
    key = bytes(mv[REC_FIXED : REC_FIXED + key_len])
    meta_b = bytes(mv[REC_FIXED + key_len : end])
    if zlib.crc32(bytes(mv[:48]) + key + meta_b) != crc:
        return None
    try:
        meta = json.loads(meta_b)
    except ValueError:
        return None
    return RecordHeader(codec, key, meta, stored_len, raw_len, csum, created, align_up(end, 64))


class AlignedPool:
    """Reusable page-aligned buffers (anonymous mmaps).

    Fresh memory costs a page fault per 4 KiB on first touch, which is slower than
    the disk; reusing buffers keeps chunk I/O at memcpy speed.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._max = max_bytes

    def take(self, size: int) -> mmap.mmap:
        size = max(align_up(size, 1 << 20), ALIGN)
        with self._lock:
            best = None
            for i, b in enumerate(self._free):
                if len(b) >= size and (best is None or len(b) < len(self._free[best])):
                    best = i
            if best is not None:
                return self._free.pop(best)
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)
            total = sum(len(b) for b in self._free)
            while total > self._max and self._free:
                victim = self._free.pop(0)
                total -= len(victim)
                victim.close()


def supports_direct_io(directory: str) -> bool:
    """Whether files in ``directory`` accept O_DIRECT (tmpfs, for one, does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


class SegmentIO:
    """Reads and writes records in the segment files of one tier directory."""

    def __init__(self, directory: str, direct: bool | None = None, fd_cache: int = 64) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.direct = supports_direct_io(directory) if direct is None else direct
        self.pool = AlignedPool()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmctl-io")
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._fd_cache = fd_cache
        self._lock = threading.Lock()

    def path(self, seg_id: int) -> str:
        return os.path.join(self.dir, segment_name(seg_id))

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    # -- writing -----------------------------------------------------------------
    def create(self, seg_id: int) -> int:
        """Create segment ``seg_id`` and return its fd, locked exclusively by this process."""
        fd = os.open(self.path(seg_id), os.O_RDWR | os.O_CREAT | os.O_EXCL | self._flags(), 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        buf = self.pool.take(ALIGN)
        try:
            buf[:ALIGN] = b"\0" * ALIGN
            import time as _t

            _SEG.pack_into(buf, 0, SEG_MAGIC, SEG_VERSION, seg_id, _t.time())
            os.pwrite(fd, memoryview(buf)[:ALIGN], 0)
        finally:
            self.pool.give(buf)
        return fd

    def write_record(self, fd: int, offset: int, header: bytes, payload: Buffer) -> int:
        """Write one record at ``offset`` (aligned); return the bytes written (padded)."""
        pay = memoryview(payload).cast("B")
        total = align_up(len(header) + len(pay))
        piece = min(PIECE, total)
        bufs = [self.pool.take(piece), self.pool.take(piece)]
        pending: list[Future[int] | None] = [None, None]
        try:
            pos = 0  # position within the record
            src_parts = [memoryview(header), pay]
            part, part_off = 0, 0
            i = 0
            while pos < total:
                n = min(piece, total - pos)
                slot = i % 2
                fut = pending[slot]
                if fut is not None:
                    fut.result()
                buf = bufs[slot]
                filled = 0
                while filled < n and part < len(src_parts):
                    src = src_parts[part]
                    take = min(n - filled, len(src) - part_off)
                    buf[filled : filled + take] = src[part_off : part_off + take]
                    filled += take
                    part_off += take
                    if part_off == len(src):
                        part, part_off = part + 1, 0
                if filled < n:
                    buf[filled:n] = bytes(n - filled)
                pending[slot] = self._io.submit(_pwrite_all, fd, memoryview(buf)[:n], offset + pos)
                pos += n
                i += 1
            for fut in pending:
                if fut is not None:
                    fut.result()
        finally:
            for b in bufs:
                self.pool.give(b)
        return total

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    # -- reading -----------------------------------------------------------------
    def _fd(self, seg_id: int) -> int:
        with self._lock:
            fd = self._fds.get(seg_id)
            if fd is not None:
                self._fds.move_to_end(seg_id)
                return fd
        fd = os.open(self.path(seg_id), os.O_RDONLY | self._flags())
        with self._lock:
            old = self._fds.get(seg_id)
            if old is not None:
                os.close(fd)
                return old
            self._fds[seg_id] = fd
            while len(self._fds) > self._fd_cache:
                _, victim = self._fds.popitem(last=False)
                os.close(victim)
        return fd

    def forget(self, seg_id: int) -> None:
        with self._lock:
            fd = self._fds.pop(seg_id, None)
        if fd is not None:
            os.close(fd)

    def read_record(
        self, seg_id: int, offset: int, record_len: int,
        consume: Callable[[RecordHeader, memoryview, int], None],
    ) -> RecordHeader:
        """Read a record and stream its payload to ``consume(header, piece, payload_offset)``.

        Reads are pipelined: piece k+1 is in flight while piece k is consumed. The
        stored checksum is verified over the streamed payload; a mismatch, a bad
        header or a short read raises ``CorruptRecord``.
        """
        try:
            fd = self._fd(seg_id)
        except FileNotFoundError:
            raise SegmentGone(seg_id) from None
        piece = min(PIECE, record_len)
        bufs = [self.pool.take(piece), self.pool.take(piece)]
        try:
            spans = [(a, min(a + piece, record_len)) for a in range(0, record_len, piece)]

            def fetch(k: int) -> Future[int]:
                a, b = spans[k]
                return self._io.submit(_pread_all, fd, memoryview(bufs[k % 2])[: b - a], offset + a)

            fut = fetch(0)
            hdr: RecordHeader | None = None
            hasher = xxhash.xxh3_64()
            for k, (a, b) in enumerate(spans):
                got = fut.result()
                if got != b - a:
                    raise CorruptRecord(f"short read in segment {seg_id} at {offset + a}")
                if k + 1 < len(spans):
                    fut = fetch(k + 1)
                view = memoryview(bufs[k % 2])[: b - a]
                lo = 0
                if k == 0:
                    hdr = decode_header(view[: min(len(view), MAX_HEADER)])
                    if hdr is None:
                        raise CorruptRecord(f"bad record header in segment {seg_id} at {offset}")
                    if hdr.record_len != record_len:
                        raise CorruptRecord(f"record length mismatch in segment {seg_id} at {offset}")
                    lo = hdr.header_len
                assert hdr is not None
                p0 = a + lo - hdr.header_len  # payload offset of this piece's first byte
                hi = min(b - a, hdr.header_len + hdr.stored_len - a)
                if hi > lo:
                    part = view[lo:hi]
                    hasher.update(part)
                    consume(hdr, part, p0)
            assert hdr is not None
            if hasher.intdigest() != hdr.checksum:
                raise CorruptRecord(f"checksum mismatch in segment {seg_id} at {offset}")
            return hdr
        finally:
            for buf in bufs:
                self.pool.give(buf)

    def scan(self, seg_id: int, size: int | None = None) -> Iterator[tuple[int, RecordHeader | None]]:
        """Yield (offset, header) for every record found in a segment, skipping garbage.

        A header is None where a region could not be parsed; the scan then resyncs
        at the next 4 KiB boundary.
        """
        path = self.path(seg_id)
        with open(path, "rb", buffering=0) as f:
            end = os.fstat(f.fileno()).st_size if size is None else size
            off = ALIGN
            while off + REC_FIXED <= end:
                head = os.pread(f.fileno(), MAX_HEADER, off)
                hdr = decode_header(head)
                if hdr is None or off + hdr.record_len > end:
                    yield off, None
                    off += ALIGN
                    continue
                yield off, hdr
                off += hdr.record_len

    def verify_payload(self, seg_id: int, offset: int, hdr: RecordHeader) -> bool:
        try:
            self.read_record(seg_id, offset, hdr.record_len, lambda h, p, o: None)
            return True
        except CorruptRecord:
            return False

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._io.shutdown(wait=True)


class CorruptRecord(StoreError):
    """A record failed its header, length or checksum check."""


class SegmentGone(StoreError):
    """The segment file was removed (compacted) after the index was read."""

    def __init__(self, seg_id: int) -> None:
        super().__init__(f"segment {seg_id} is gone")
        self.seg_id = seg_id


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
    return done


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done
