"""Append-only segment files and the records inside them.

A segment is one file, ``seg-<id>.lseg``, written by exactly one process (the one
whose id is in the index and who holds an exclusive ``flock`` on the file) and never
rewritten: records are appended at 4 KiB-aligned offsets and, once indexed, their
bytes never change. Segments are removed whole after compaction.

The record format is in ``record.py``. Payloads are page-aligned, so page-aligned
buffers go to and from the disk with O_DIRECT and no copy; others pass through
reused aligned staging buffers. Large transfers are split into spans, several in
flight at once on the tier's I/O threads, so hashing and copying overlap the disk.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import xxhash

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import StoreError
from .private import FILE_MODE, SAFE_OPEN, UnsafePath, check_folder, file_problem, make_private_dir
from .record import (
    ALIGN,
    REC_MAGIC,
    SEG_MAGIC,
    SEG_VERSION,
    SEGMENT_HEADER,
    TRAILER_BLOCK,
    RecordTrailer,
    align_up,
    checksum,
    decode_trailer,
    header_problem,
    is_aligned,
    segment_name,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")

WRITE_SPAN = 8 << 20  # writes: pipelining granularity for large transfers
READ_SPAN = 2 << 20  # reads: small enough that hashing span k overlaps reading the next ones
#: I/O requests in flight per transfer (measured: benchmarks/store_io.py --depths)
IO_DEPTH = 4

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
    probe = os.path.join(directory, f".odirect-probe-{secrets.token_hex(8)}")
    try:  # a new file of its own (never one planted under that name), then O_DIRECT asked for
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
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

    def __init__(self, directory: str, direct: bool | None = None, fd_cache: int = 64,
                 readonly: bool = False, *, what: str = "tier folder", store_id: str | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.dir = directory
        self.clock = clock  # when a segment was made (its header)
        #: how messages name the folder ("dram folder")
        self.what = what
        #: the id of the store whose segments these are (written into each new segment's
        #: header; None: a store of an earlier version opened read-only)
        self.store_id = store_id
        if readonly:  # reads only: nothing is created, and buffered reads need no probe file
            check_folder(directory, what)
            self.direct = False if direct is None else direct
        else:
            make_private_dir(directory, what)  # 0700 whatever the umask; refused unless private
            self.direct = supports_direct_io(directory) if direct is None else direct
        self.pool = AlignedPool()
        #: spans of one transfer in flight at once (and I/O threads of this tier)
        self.depth = IO_DEPTH
        self._io = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="lmctl-io")
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._fd_cache = fd_cache
        self._lock = threading.Lock()

    def path(self, seg_id: int) -> str:
        return os.path.join(self.dir, segment_name(seg_id))

    def segment_ids(self) -> list[int]:
        """Ids of the segment files in this tier's directory, ascending."""
        return sorted(int(n[4:-5]) for n in os.listdir(self.dir) if n.startswith("seg-") and n.endswith(".lseg"))

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    # -- writing -----------------------------------------------------------------
    def create(self, seg_id: int) -> int:
        """Create segment ``seg_id`` and return its fd, locked exclusively by this process."""
        path = self.path(seg_id)
        check_folder(self.dir, self.what)  # still private: a tmpfs folder may have been made anew
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | self._flags(),
                     FILE_MODE)
        buf = self.pool.take(ALIGN)
        try:
            os.fchmod(fd, FILE_MODE)  # exactly 0600, whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            buf[:ALIGN] = b"\0" * ALIGN
            sid = bytes.fromhex(self.store_id) if self.store_id else bytes(16)
            SEGMENT_HEADER.pack_into(buf, 0, SEG_MAGIC, SEG_VERSION, seg_id, self.clock.time(), sid)
            if os.pwrite(fd, memoryview(buf)[:ALIGN], 0) != ALIGN:
                raise OSError(errno.ENOSPC, "short write of a segment header")
        except BaseException:
            # a full disk (or any failure) must leave neither an fd nor a half-made file
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        finally:
            self.pool.give(buf)
        return fd

    def write_record(self, fd: int, offset: int, payload: Buffer,
                     make_trailer: Callable[[int], bytes]) -> tuple[int, int]:
        """Append a record at ``offset`` and wait for it; returns (bytes written, checksum)."""
        return self.start_write(fd, offset, payload, make_trailer).result()

    def start_write(self, fd: int, offset: int, payload: Buffer,
                    make_trailer: Callable[[int], bytes]) -> PendingWrite:
        """Start appending a record at ``offset``: the payload, then its trailer.

        ``make_trailer(checksum)`` builds the trailer once the payload's checksum is
        known; it goes out in the same write as the payload's last span. The payload
        goes out in spans, up to ``depth`` of them in flight on the I/O threads while
        the caller hashes the next (and the spans of other records of a batch may be in
        flight too); ``result()`` waits for them. ``payload`` must stay unchanged until then.
        """
        pay = memoryview(payload).cast("B")
        n = len(pay)
        body = align_up(n)
        hasher = xxhash.xxh3_64()
        zero_copy = self.direct and is_aligned(pay)
        pw = PendingWrite(self.pool, body + TRAILER_BLOCK)
        if body > WRITE_SPAN:  # spans in parallel: keep them together (one span is one extent anyway)
            reserve(fd, offset, body + TRAILER_BLOCK)
        trailer = self.pool.take(TRAILER_BLOCK)
        pw.buffers.append(trailer)
        staging: list[mmap.mmap] = []
        inflight: list[Future[int] | None] = [None] * self.depth
        try:
            spans = [(a, min(a + WRITE_SPAN, body)) for a in range(0, body, WRITE_SPAN)] or [(0, 0)]
            for i, (a, b) in enumerate(spans):
                m = b - a
                span = pay[a:b]
                hasher.update(span)
                slot = -1
                views: list[memoryview]
                if (zero_copy or not self.direct) and len(span) == m:
                    views = [span]  # whole span straight from the source
                elif not self.direct:
                    views = [span, memoryview(bytes(m - len(span)))]
                else:  # O_DIRECT from an unaligned source: through a ring of aligned buffers
                    slot = i % self.depth
                    while len(staging) <= slot:  # the ring fills lazily: earlier spans may have gone zero-copy
                        staging.append(self.pool.take(min(WRITE_SPAN, max(body, ALIGN))))
                        pw.buffers.append(staging[-1])
                    prev = inflight[slot]
                    if prev is not None:
                        prev.result()
                    buf = staging[slot]
                    buf[: len(span)] = span
                    if len(span) < m:
                        buf[len(span) : m] = bytes(m - len(span))
                    views = [memoryview(buf)[:m]]
                if i == len(spans) - 1:
                    pw.checksum = hasher.intdigest()
                    trailer[:TRAILER_BLOCK] = make_trailer(pw.checksum)
                    views.append(memoryview(trailer)[:TRAILER_BLOCK])
                fut = self._io.submit(_pwritev_all, fd, [v for v in views if len(v)], offset + a)
                pw.futures.append(fut)
                if slot >= 0:
                    inflight[slot] = fut
        except BaseException:
            pw.cancel()
            raise
        return pw

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    # -- opening what is on disk ---------------------------------------------------
    def open_checked(self, seg_id: int, flags: int, written: bool = True) -> int:
        """Open segment ``seg_id``'s file without following a link or blocking on a FIFO,
        and check it is a regular file the store may trust (``store.format.private.file_problem``);
        ``ForeignSegment`` if not, ``FileNotFoundError`` if there is none."""
        path = self.path(seg_id)
        direct = flags & getattr(os, "O_DIRECT", 0)
        try:  # O_DIRECT only once it is known to be a file (a FIFO refuses it with EINVAL)
            fd = os.open(path, (flags & ~direct) | SAFE_OPEN)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ForeignSegment(f"{path} is a symbolic link, not a segment of this store") from None
            raise
        try:
            problem = file_problem(os.fstat(fd), written)
            if problem is not None:
                raise ForeignSegment(f"{path} {problem}: not a segment of this store")
            os.set_blocking(fd, True)
            if direct:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | direct)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_own(self, seg_id: int, flags: int = os.O_RDONLY, headless: bool = False) -> int:
        """``open_checked``, and the segment's header says it is segment ``seg_id`` of this
        store (or of no store: written before store ids): the file recovery may cut, and
        rebuild may index. ``ForeignSegment`` otherwise. ``headless``: a file of this store's
        user with no header yet (its writer was killed as it made it) passes too."""
        fd = self.open_checked(seg_id, flags, written=flags & os.O_ACCMODE != os.O_RDONLY)
        try:
            head = os.pread(fd, SEGMENT_HEADER.size, 0)
            if len(head) < SEGMENT_HEADER.size or not any(head[: len(SEG_MAGIC)]):
                if headless:
                    return fd
                raise ForeignSegment(f"{self.path(seg_id)} has no segment header")
            magic, _version, sid, _created, store = SEGMENT_HEADER.unpack(head)
            if magic != SEG_MAGIC or sid != seg_id:
                raise ForeignSegment(f"{self.path(seg_id)}'s header is not that of segment {seg_id}")
            if self.store_id is not None and store != bytes(16) and store.hex() != self.store_id:
                raise ForeignSegment(f"{self.path(seg_id)} is a segment of another store ({store.hex()})")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- reading -----------------------------------------------------------------
    def _fd(self, seg_id: int) -> int:
        with self._lock:
            fd = self._fds.get(seg_id)
            if fd is not None:
                self._fds.move_to_end(seg_id)
                return fd
        fd = self.open_checked(seg_id, os.O_RDONLY | self._flags(), written=False)
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

    def trailer_at(self, seg_id: int, offset: int, stored_len: int) -> RecordTrailer | None:
        """The trailer of the record at ``offset`` whose payload is ``stored_len`` bytes (one
        4 KiB read, no payload): what a reader checks an index entry's claims against before
        it sizes a buffer by them. None if there is no valid trailer there. Raises like
        ``read_record`` (``SegmentGone``, OSError)."""
        try:
            fd = self._fd(seg_id)
        except FileNotFoundError:
            raise SegmentGone(seg_id) from None
        buf = self.pool.take(TRAILER_BLOCK)  # aligned: the fd may be O_DIRECT
        try:
            view = memoryview(buf)[:TRAILER_BLOCK]
            if _preadv_all(fd, [view], offset + align_up(stored_len)) != TRAILER_BLOCK:
                return None
            return decode_trailer(view)
        finally:
            self.pool.give(buf)

    def read_record(self, seg_id: int, offset: int, stored_len: int,
                    dst: memoryview | None) -> RecordTrailer:
        """Read a record's payload into ``dst[:stored_len]`` and verify it; ``dst`` past
        ``stored_len`` is left as it was.

        With ``dst=None`` the payload is only verified. A page-aligned ``dst`` is read
        into directly (O_DIRECT, no copy; the last block of an unaligned payload, with its
        padding, through a staging buffer). The payload is read in spans, up to ``depth``
        in flight while the caller hashes (and, through staging buffers, copies) the
        earliest one. A bad trailer, a short read or a checksum mismatch raises
        ``CorruptRecord``; a removed segment raises ``SegmentGone``.
        """
        try:
            fd = self._fd(seg_id)
        except FileNotFoundError:
            raise SegmentGone(seg_id) from None
        except ForeignSegment as exc:  # a file planted or swapped in under its name: a miss
            raise CorruptRecord(str(exc)) from None
        body = align_up(stored_len)
        direct_dst = dst is not None and self.direct and is_aligned(dst)
        spans = [(a, min(a + READ_SPAN, body)) for a in range(0, body, READ_SPAN)] or [(0, 0)]
        if direct_dst and body != stored_len and spans[-1][1] - spans[-1][0] > ALIGN:
            # the padding of an unaligned payload never lands in ``dst``: its last block is
            # read apart (a caller's buffer past the payload keeps what it held)
            a, b = spans.pop()
            spans += [(a, b - ALIGN), (b - ALIGN, b)]
        depth = min(self.depth, len(spans))
        size = min(READ_SPAN, max(body, ALIGN))
        trailer = self.pool.take(TRAILER_BLOCK)
        bufs: list[mmap.mmap] = []
        futs: list[Future[int]] = []

        def target(k: int) -> tuple[memoryview, bool]:
            a, b = spans[k]
            if direct_dst and dst is not None and b <= min(len(dst), stored_len):
                return dst[a:b], True
            while len(bufs) <= k % depth:
                bufs.append(self.pool.take(size))
            return memoryview(bufs[k % depth])[: b - a], False

        def fetch(k: int) -> Future[int]:
            views = [target(k)[0]]
            if k == len(spans) - 1:
                views.append(memoryview(trailer)[:TRAILER_BLOCK])
            f = self._io.submit(_preadv_all, fd, [v for v in views if len(v)], offset + spans[k][0])
            futs.append(f)
            return f

        try:
            hasher = xxhash.xxh3_64()
            pending = [fetch(k) for k in range(depth)]
            for k, (a, b) in enumerate(spans):
                got = pending[k].result()
                want = b - a + (TRAILER_BLOCK if k == len(spans) - 1 else 0)
                if got != want:
                    raise CorruptRecord(f"short read in segment {seg_id} at {offset + a}")
                view, in_place = target(k)
                valid = view[: max(0, min(b, stored_len) - a)]
                hasher.update(valid)
                if dst is not None and not in_place:
                    dst[a : a + len(valid)] = valid
                if k + depth < len(spans):
                    pending.append(fetch(k + depth))  # span k's buffer (or place in dst) is free now
            found = decode_trailer(memoryview(trailer)[:TRAILER_BLOCK])
            if found is None:
                raise CorruptRecord(f"bad record trailer in segment {seg_id} at {offset}")
            if found.stored_len != stored_len:
                raise CorruptRecord(f"record length mismatch in segment {seg_id} at {offset}")
            if hasher.intdigest() != found.checksum:
                raise CorruptRecord(f"checksum mismatch in segment {seg_id} at {offset}")
            return found
        finally:
            for f in futs:
                f.exception()
            self.pool.give(trailer)
            for buf in bufs:
                self.pool.give(buf)

    def whole_read_fits(self, stored_len: int, dst: memoryview) -> bool:
        """Whether ``start_whole_read`` can take a record of ``stored_len`` payload bytes into
        ``dst``: O_DIRECT, a page-aligned ``dst`` that holds the payload, and a payload of
        whole pages (so that no padding lands in ``dst``)."""
        return (self.direct and stored_len > 0 and stored_len % ALIGN == 0 and len(dst) >= stored_len
                and is_aligned(dst))

    def start_whole_read(self, seg_id: int, offset: int, stored_len: int, dst: memoryview) -> WholeRead:
        """Start reading a record in one request, its payload straight into
        ``dst[:stored_len]`` and its trailer into a pooled block, on the I/O threads (up to
        ``depth`` records in flight: the disk's best read pattern for chunk-sized records).
        Only where ``whole_read_fits``. ``WholeRead.result()`` waits for it and verifies it
        in the calling thread (checks and errors as ``read_record``), while the I/O threads
        go on with the next records; it must be called before ``dst`` is reused."""
        try:
            fd = self._fd(seg_id)
        except FileNotFoundError:
            raise SegmentGone(seg_id) from None
        except ForeignSegment as exc:  # a file planted or swapped in under its name: a miss
            raise CorruptRecord(str(exc)) from None
        trailer = self.pool.take(TRAILER_BLOCK)
        try:
            fut = self._io.submit(_preadv_all, fd, [dst[:stored_len], memoryview(trailer)[:TRAILER_BLOCK]], offset)
        except BaseException:
            self.pool.give(trailer)
            raise
        return WholeRead(self.pool, fut, trailer, seg_id, offset, stored_len, dst)

    def scan(self, seg_id: int, size: int | None = None) -> Iterator[tuple[int, RecordTrailer]]:
        """Yield (offset, trailer) for every record whose trailer is intact.

        Trailers sit at 4 KiB boundaries after their payload, so the scan reads the
        segment sequentially and tests each boundary; garbage between records (a torn
        append) is skipped. The caller verifies payload checksums. Only a file of this store
        is read (``open_own``; ``ForeignSegment`` otherwise).
        """
        path = self.path(seg_id)
        with open(self.open_own(seg_id), "rb", buffering=0) as f:
            why = header_problem(os.pread(f.fileno(), SEGMENT_HEADER.size, 0))
            if why is not None:  # its records may mean something else: none is taken
                log.warning("skipped segment file %s: %s", path, why)
                return
            end = os.fstat(f.fileno()).st_size if size is None else min(size, os.fstat(f.fileno()).st_size)
            start = ALIGN  # after the segment header
            pos = ALIGN
            block = 8 << 20
            while pos < end:
                data = os.pread(f.fileno(), min(block, end - pos), pos)
                if not data:
                    break
                i = 0
                while True:
                    i = data.find(REC_MAGIC, i)
                    if i < 0:
                        break
                    if i % ALIGN == 0:
                        at = pos + i
                        head = data[i : i + TRAILER_BLOCK]
                        if len(head) < TRAILER_BLOCK:
                            head = os.pread(f.fileno(), TRAILER_BLOCK, at)
                        trailer = decode_trailer(head)
                        if trailer is not None:
                            rec = at - trailer.trailer_offset
                            if rec >= start:
                                yield rec, trailer
                                start = at + TRAILER_BLOCK
                    i += 1
                pos += len(data)

    def verify_payload(self, seg_id: int, offset: int, trailer: RecordTrailer) -> bool:
        try:
            self.read_record(seg_id, offset, trailer.stored_len, None)
            return True
        except CorruptRecord:
            return False

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._io.shutdown(wait=True)


class WholeRead:
    """One record read whole in flight (``SegmentIO.start_whole_read``)."""

    def __init__(self, pool: AlignedPool, fut: Future[int], trailer: mmap.mmap, seg_id: int, offset: int,
                 stored_len: int, dst: memoryview) -> None:
        self._pool, self._fut, self._trailer = pool, fut, trailer
        self.seg_id, self.offset, self.stored_len, self._dst = seg_id, offset, stored_len, dst

    def result(self) -> RecordTrailer:
        """Wait for the read and verify it: the trailer is valid, claims this payload length,
        and its checksum is that of the bytes read (``CorruptRecord`` otherwise)."""
        try:
            got = self._fut.result()
            seg_id, offset, n = self.seg_id, self.offset, self.stored_len
            if got != n + TRAILER_BLOCK:
                raise CorruptRecord(f"short read in segment {seg_id} at {offset}")
            found = decode_trailer(memoryview(self._trailer)[:TRAILER_BLOCK])
            if found is None:
                raise CorruptRecord(f"bad record trailer in segment {seg_id} at {offset}")
            if found.stored_len != n:
                raise CorruptRecord(f"record length mismatch in segment {seg_id} at {offset}")
            if checksum(self._dst[:n]) != found.checksum:
                raise CorruptRecord(f"checksum mismatch in segment {seg_id} at {offset}")
            return found
        finally:
            self._fut.exception()  # the trailer block is free only once the read is over
            self._pool.give(self._trailer)


class PendingWrite:
    """Writes of one record in flight on the I/O threads, and the buffers they use."""

    def __init__(self, pool: AlignedPool, length: int) -> None:
        self.pool = pool
        self.length = length
        self.checksum = 0
        self.futures: list[Future[int]] = []
        self.buffers: list[mmap.mmap] = []

    def result(self) -> tuple[int, int]:
        try:
            for f in self.futures:
                f.result()
        finally:
            self.cancel()
        return self.length, self.checksum

    def cancel(self) -> None:
        """Wait for whatever was submitted (buffers must outlive it), then free buffers."""
        for f in self.futures:
            f.exception()
        self.futures = []
        for b in self.buffers:
            self.pool.give(b)
        self.buffers = []


class CorruptRecord(StoreError):
    """A record failed its trailer, length or checksum check."""


class ForeignSegment(UnsafePath):
    """A file under a segment's name that is not this store's segment: a link, a FIFO,
    another user's file, or another store's segment. Never read, cut, indexed or removed."""


class SegmentGone(StoreError):
    """The segment file was removed (compacted) after the index was read."""

    def __init__(self, seg_id: int) -> None:
        super().__init__(f"segment {seg_id} is gone")
        self.seg_id = seg_id


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


_LIBC = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE = 1


def reserve(fd: int, offset: int, length: int) -> None:
    """Ask the file system for ``length`` bytes of blocks at ``offset`` before they are
    written, keeping the file's size (``FALLOC_FL_KEEP_SIZE``): a record's spans go out in
    parallel, and a file system that allocates blocks as writes arrive would otherwise lay
    a record out in as many scattered extents as it has spans (measured on ext4: 54 extents
    for 16 records of 32 MiB), each extent a request of its own when the record is read
    back. Only for records of several spans: writing into reserved (unwritten) blocks costs
    the file system a conversion per write, which slowed durable puts of single-span
    records measurably. A hint only: where it fails (not supported, no space) the write
    says what is wrong."""
    _LIBC.fallocate(fd, _FALLOC_FL_KEEP_SIZE, ctypes.c_long(offset), ctypes.c_long(length))


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> int:
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        n = os.pwritev(fd, _advance(views, done), offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
    return done


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        n = os.preadv(fd, _advance(views, done), offset + done)
        if n <= 0:
            break
        done += n
    return done
