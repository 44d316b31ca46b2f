"""The layout of a remote tier value, and what a read checks as its pieces arrive.

``RemoteMeta`` is what a chunk carries besides its stored bytes. A head's metadata
(``pack_meta``/``unpack_meta``) sits inside the envelope store/format/remote_auth.py seals: stored
and raw lengths, piece size and count, codec and level, tokens, write time, the writer's id,
the payload's MAC and the layout JSON. ``Bounds`` are what a reader allows a head to claim,
checked before anything is allocated. ``Read`` is one read in progress: it takes each
piece's reply as it arrives (its length first, then its bytes, MAC'd, or decrypted in place,
as they land) and gives the verdict. store/tiers/remote.py, the client, does the talking.
"""

from __future__ import annotations

import hmac
import json
import math
import queue
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .codec import CODEC_IDS, CODEC_NAMES
from .remote_auth import AEAD_TAG_BYTES, MODE_PLAIN, PieceCipher, invalid_tag

MiB = 1 << 20
#: no stored payload is this large (as store/index/__init__.py's MAX_CHUNK_BYTES)
MAX_STORED = 1 << 34
#: Redis refuses bulk strings over proto-max-bulk-len (512 MB by default)
MAX_PIECE_BYTES = 512 * MiB
#: no head of ours is longer (its layout JSON is a few hundred bytes): a longer value is skipped unread
MAX_HEAD = 64 * 1024
_BLOCK = 16  # AES's block: cryptography's update_into may want this much room beyond the data
#: an encrypted piece is decrypted this much at a time, through a scratch buffer of this size
#: (plus ``_BLOCK``): the memory a read holds for it does not grow with the sizes a value claims
_SCRATCH = 256 * 1024
# the head's metadata: stored_len, raw_len, piece_bytes, piece_count, codec, level, tokens,
# written, writer, the payload's MAC (xxh3-64 in its first 8 bytes without a secret); then
# the layout JSON
_META = struct.Struct("<QQIIBhIdI32s")


@dataclass(frozen=True)
class RemoteMeta:
    """What a remote chunk carries besides its stored bytes.

    For ``put``: ``raw_len`` (decoded length), ``codec`` (a name of store/format/codec.py) and its
    ``level``, ``layout`` and ``tokens``; ``checksum`` (xxh3-64 of the stored bytes, as the
    store's index keeps it) spares a tier without a secret hashing them again. The rest is
    filled in by the tier: ``stored_len``, ``written`` (Unix time of the put), ``piece_bytes``
    and ``writer`` (the id of the tier that wrote it, which its authenticated head names; 0:
    none).
    """

    raw_len: int
    codec: str = "raw"
    level: int = 0
    layout: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0
    checksum: int | None = None
    stored_len: int | None = None
    written: float | None = None
    piece_bytes: int | None = None
    writer: int = 0


class Nonsense(Exception):
    """A verified head whose fields do not add up (a trusted writer's bug): foreign."""


@dataclass(frozen=True)
class Head:
    meta: RemoteMeta
    stored_len: int
    piece_bytes: int
    piece_count: int
    mode: int
    nonce: bytes
    check: bytes  # the payload's MAC (or xxh3-64)


@dataclass(frozen=True)
class Bounds:
    """What a reader allows a chunk to claim, checked against its head before anything is
    allocated: at most ``max_stored`` stored bytes, exactly ``raw_len`` raw bytes (None: any)
    and at most ``max_raw``."""

    max_stored: int
    raw_len: int | None = None
    max_raw: int | None = None

    def problem(self, h: Head) -> str | None:
        raw = h.meta.raw_len
        if h.stored_len > self.max_stored:
            return f"it claims {h.stored_len} stored bytes, more than the {self.max_stored} this read allows"
        if self.raw_len is not None and raw != self.raw_len:
            return f"it claims {raw} raw bytes, not the {self.raw_len} this read expects"
        if self.max_raw is not None and raw > self.max_raw:
            return f"it claims {raw} raw bytes, more than the {self.max_raw} this read allows"
        return None


@dataclass
class Read:
    """What one read found: ``kind`` is ``reading`` while the pieces arrive, then ``ok``, or
    what made it a miss (``absent``, ``foreign``, ``forged-head``, ``torn-head``,
    ``too_small``, ``missing`` pieces, ``torn`` or ``forged`` pieces). ``name`` is the head's
    Redis name, ``tag`` the names' hash tag."""

    kind: str
    problem: str | None
    name: str = ""
    tag: str = ""
    head_raw: bytes | None = None
    head: Head | None = None
    dst: memoryview | None = None
    check: Any = None  # the payload's MAC, updated as the bytes land
    cipher: PieceCipher | None = None
    opener: Any = None  # the decryptor of the piece being received
    gcm_tag: memoryview = field(default_factory=lambda: memoryview(bytearray(AEAD_TAG_BYTES)))
    missing: int = 0
    asked: int = 0  # the pieces the read asked for before it knew the chunk's count
    lane: Lane | None = None  # where the checks run (None: here, as the bytes land)
    forged_piece: str | None = None  # what the checks found (they may run on the lane)
    plain: bytearray = field(default_factory=bytearray)  # where a piece is decrypted to (``_SCRATCH``)

    @property
    def extra(self) -> int:
        """Bytes a stored piece has beyond its payload (the GCM tag of an encrypted one)."""
        return 0 if self.cipher is None else AEAD_TAG_BYTES

    def piece_len(self, i: int) -> int:
        assert self.head is not None
        return min(self.head.piece_bytes, self.head.stored_len - i * self.head.piece_bytes)

    def slot(self, i: int) -> memoryview:
        assert self.head is not None and self.dst is not None
        pos = i * self.head.piece_bytes
        return self.dst[pos:pos + self.piece_len(i)]

    def fail(self, kind: str, problem: str) -> None:
        if self.kind == "reading":
            self.kind, self.problem = kind, problem

    def accept(self, i: int, reply: object) -> memoryview | None:
        """Piece ``i``'s reply, seen by its length (an int), None or 0 (the key is gone) or
        anything else (not a string): the slice of the buffer its payload goes to, or None
        when it is not wanted (noted as missing or torn, or the read has already failed)."""
        if self.kind != "reading" or self.head is None or i >= self.head.piece_count:
            return None
        want = self.piece_len(i) + self.extra
        if reply is None or reply == 0:
            self.missing += 1
        elif not isinstance(reply, int):
            self.fail("torn", f"piece {i} is not a string ({reply!r})")
        elif reply != want:
            self.fail("torn", f"piece {i} has {reply} bytes, not {want}")
        else:
            if self.cipher is not None:
                self.opener = self.cipher.opener(i)
            return self.slot(i)
        return None

    def land(self, view: memoryview) -> None:
        """Bytes of a piece have arrived in ``view``: MAC them, or (encrypted) decrypt them
        where they lie (its GCM tag authenticates them); on the read's lane when it has one."""
        self._do(self._take, self.opener, view)

    def _take(self, opener: Any, view: memoryview) -> None:
        if opener is None:
            self.check.update(view)
        else:
            # cryptography refuses overlapping buffers since 46 (and may write up to a block
            # more than it is given): decrypt a slice at a time to a scratch buffer, copy back
            if not self.plain:
                self.plain = bytearray(_SCRATCH + _BLOCK)
            plain = memoryview(self.plain)
            for start in range(0, len(view), _SCRATCH):
                part = view[start:start + _SCRATCH]
                if opener.update_into(part, self.plain) != len(part):  # GCM is a stream: never
                    self.forged_piece = self.forged_piece or "a piece did not decrypt whole"
                part[:] = plain[:len(part)]

    def end_piece(self, i: int) -> None:
        """An encrypted piece's GCM tag has arrived (in ``gcm_tag``): check it, and MAC it
        (the payload's MAC covers the pieces' tags in order)."""
        self._do(self._seal, i, self.opener, bytes(self.gcm_tag))
        self.opener = None

    def _seal(self, i: int, opener: Any, tag: bytes) -> None:
        self.check.update(tag)
        try:
            opener.finalize_with_tag(tag)
        except invalid_tag():
            self.forged_piece = self.forged_piece or f"piece {i} fails its GCM tag"

    def _do(self, fn: Callable[..., None], *args: Any) -> None:
        if self.lane is None:
            fn(*args)
        else:
            self.lane.put(fn, *args)

    def settle(self) -> None:
        """Wait until the lane has done everything given to it: after this nothing touches
        the caller's buffer."""
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.close()

    def finish(self) -> Read:
        """The verdict once every piece has been received (and checked)."""
        self.settle()
        if self.forged_piece:
            self.fail("forged", self.forged_piece)
        if self.kind == "reading" and self.head is not None:
            want = self.head.check if self.head.mode != MODE_PLAIN else self.head.check[:8]
            if self.missing:
                self.kind, self.problem = "missing", f"{self.missing} of {self.head.piece_count} pieces are gone"
            elif not hmac.compare_digest(self.check.digest(), want):
                self.kind = "torn" if self.head.mode == MODE_PLAIN else "forged"
                self.problem = "the payload fails its " + ("checksum" if self.head.mode == MODE_PLAIN else "MAC")
            else:
                self.kind = "ok"
        self.dst = None  # the caller's buffer is not kept
        return self


class Lane:
    """The checks of one read (its MAC, its decryption), done in order on a helper thread, so
    that they run while the next bytes are being received instead of between receives (a
    client whose own core is the limit then reads about as fast as without them).
    ``close`` waits for all of them and raises what one raised."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        pool.submit(self._run)  # RuntimeError once the pool is shut down: the caller checks inline

    def put(self, fn: Callable[..., None], *args: Any) -> None:
        self._q.put((fn, args))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self._error is None:  # after a failure the rest is only drained
                try:
                    item[0](*item[1])
                except BaseException as exc:
                    self._error = exc
        self._done.set()

    def close(self) -> None:
        self._q.put(None)
        self._done.wait()
        if self._error is not None:
            raise self._error


def pack_meta(meta: RemoteMeta, stored_len: int, piece_bytes: int, written: float, writer: int,
               check: bytes) -> bytes:
    layout = json.dumps(meta.layout, separators=(",", ":"), sort_keys=True).encode()
    count = -(-stored_len // piece_bytes)
    return _META.pack(stored_len, meta.raw_len, piece_bytes, count, CODEC_IDS[meta.codec], meta.level, meta.tokens,
                      written, writer, check) + layout


def unpack_meta(raw: bytes, mode: int, nonce: bytes) -> Head:
    """Parse a verified head's metadata; ``Nonsense`` if its fields do not add up."""
    if len(raw) < _META.size:
        raise Nonsense("the head's metadata is too short")
    stored_len, raw_len, piece_bytes, count, codec, level, tokens, written, writer, check = _META.unpack_from(raw, 0)
    if codec not in CODEC_NAMES or not 0 < piece_bytes <= MAX_PIECE_BYTES or stored_len >= MAX_STORED \
            or raw_len >= MAX_STORED or count != -(-stored_len // piece_bytes) or not math.isfinite(written) \
            or (CODEC_NAMES[codec] == "raw" and stored_len != raw_len):
        raise Nonsense("the head's codec, lengths or time make no sense")
    try:
        layout = json.loads(raw[_META.size:] or b"{}")
    except ValueError:
        raise Nonsense("the head's layout is not JSON") from None
    if not isinstance(layout, dict):
        raise Nonsense("the head's layout is not a JSON object")
    meta = RemoteMeta(raw_len=raw_len, codec=CODEC_NAMES[codec], level=level, layout=layout, tokens=tokens,
                      checksum=int.from_bytes(check[:8], "big") if mode == MODE_PLAIN else None,
                      stored_len=stored_len, written=written, piece_bytes=piece_bytes, writer=writer)
    return Head(meta, stored_len, piece_bytes, count, mode, nonce, check)
