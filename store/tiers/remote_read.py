"""The remote tier's reads: lookups (``contains_many``), chunk reads (``get``, ``get_into``) and
the aliases of partial chunks, each verified before anything is handed out; a failure is a miss,
counted. ``RemoteTier`` (remote.py) has them as its methods; see there for the layout and the
rules of a read.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import redis.exceptions as rx

from ..errors import StoreError
from ..format.remote_auth import (
    MODE_PLAIN,
    MODE_SEALED,
    Foreign,
    Forged,
    Keys,
    Torn,
    new_nonce,
)
from ..format.remote_value import (
    MAX_HEAD,
    MAX_STORED,
    Bounds,
    Head,
    Lane,
    Nonsense,
    Read,
    RemoteMeta,
)
from .resp import ReplyReader, pack_gets

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..clock import Clock


log = logging.getLogger("lmctl.store")

#: a read asks for at most this many pieces before it knows the chunk's piece count
MAX_GUESS = 64
#: reads of at least this many stored bytes MAC and decrypt on a lane (a helper thread; at most
#: LANES reads at once, others wait for one), overlapping with the receive, where the process
#: may run on at least LANE_CPUS cores (with two, the helper takes the core the Redis server or
#: the engine needs: measured, checking inline costs less CPU there)
LANE_MIN, LANES, LANE_CPUS = 1 << 20, 4, 4
_ALIAS = struct.Struct("<IIH")


def piece_names(tag: str, count: int, first: int = 0) -> list[str]:
    """The Redis names of pieces ``first`` .. ``count - 1`` of the chunk whose names share ``tag``."""
    return [f"{tag}:{i}" for i in range(first, count)]


class RemoteReads:
    """The read half of ``RemoteTier``, its base class."""

    if TYPE_CHECKING:  # what the reads use of the tier: ``RemoteTier`` sets and defines them
        clock: Clock
        keyring: list[Keys]
        mode: int
        ttl_s: float | None
        use_lanes: bool
        direct_reads: bool
        _lanes: ThreadPoolExecutor | None
        _pieces_hint: int
        _writes_paused_until: float
        _closed: bool
        _client_lock: threading.Lock

        def _count(self, **deltas: int) -> None: ...
        def _warn(self, kind: str, msg: str, *args: object) -> None: ...
        def _tag(self, key: bytes, keys: Keys | None = None) -> str: ...
        def _call(self, op: str, fast: bool, fn: Callable[[Any], Any]) -> tuple[bool, Any]: ...
        def head_key(self, key: bytes, keys: Keys | None = None) -> str: ...
        def _open(self, key: bytes, keys: Keys, name: str, raw: bytes) -> Head: ...

    # -- reads -------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` have a head on the server (under any secret of the keyring), in
        one pipelined round trip bounded by ``lookup_timeout_s``. A failure (or an open
        breaker) answers False for all. A head does not promise its pieces, nor that it
        verifies: ``get_into`` finds out."""
        found = self.contains_many_checked(keys)
        return [False] * len(keys) if found is None else found

    def contains_many_checked(self, keys: Sequence[bytes]) -> list[bool] | None:
        """``contains_many``, or None when the server did not answer (a failure, a timeout or
        an open breaker): a caller that must tell "not there" from "not asked" uses this."""
        heads = [self.head_key(k, ring) for k in keys for ring in self.keyring]
        if not heads:
            return []
        per = len(self.keyring)

        def look(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for h in heads:
                pipe.exists(h)
            there = [r is True or (isinstance(r, int) and r > 0) for r in pipe.execute(raise_on_error=False)]
            return [any(there[i:i + per]) for i in range(0, len(there), per)]

        self._count(lookups=len(keys))
        ok, found = self._call("lookup", True, look)
        return list(found) if ok else None

    def get(self, key: bytes, *, max_stored: int, raw_len: int | None = None,
            max_raw: int | None = None) -> tuple[RemoteMeta, bytearray] | None:
        """The chunk's metadata and stored bytes, verified; None for a miss. A chunk whose
        head claims more than ``max_stored`` stored bytes (or another ``raw_len``, or more
        than ``max_raw``) is a miss counted ``foreign``, before anything is allocated."""
        box: list[bytearray] = []

        def alloc(meta: RemoteMeta) -> bytearray:
            box.append(bytearray(meta.stored_len or 0))
            return box[0]

        meta = self.get_into(key, alloc, max_stored=max_stored, raw_len=raw_len, max_raw=max_raw)
        return None if meta is None else (meta, box[0])

    def get_into(self, key: bytes, out: Buffer | Callable[[RemoteMeta], Buffer], *,
                 max_stored: int | None = None,
                 raw_len: int | None = None, max_raw: int | None = None) -> RemoteMeta | None:
        """Read a chunk's stored bytes into ``out[:meta.stored_len]`` and return its metadata,
        verified (its head's MAC, the lengths, the payload's MAC); None for a miss (counted:
        absent, foreign, forged, torn, evicted pieces, an error, the breaker open). ``out``
        is a writable buffer, or a function that is given the verified metadata once the
        head is read and returns one (so the caller can size it; ``max_stored`` is then
        required). The head's claims are checked against ``max_stored``, ``raw_len`` and
        ``max_raw`` before ``out`` is called: a chunk that claims more, or another raw
        length, is a miss counted ``foreign``; a buffer smaller than the chunk is a miss
        counted ``too_small``. On a miss ``out`` may hold partial bytes.

        One round trip: the head and as many pieces as the last chunk read had, in one
        pipeline (a second round trip fetches the rest when this chunk has more; during a
        rotation, a chunk not found under the current secret's names is looked for under the
        previous one's). On a single server the pieces are received straight into ``out``,
        checked as they land; through a cluster client they are copied from redis-py's
        replies."""
        if callable(out):
            if max_stored is None:
                raise TypeError("get_into with a function for out needs max_stored (the most bytes it may allocate)")
        elif memoryview(out).readonly:
            raise TypeError("get_into needs a writable buffer")
        bounds = Bounds(MAX_STORED if max_stored is None else min(MAX_STORED, max_stored), raw_len, max_raw)
        bkey = bytes(key)
        read = self._read_direct if self.direct_reads else self._read_pipelined
        r = Read("absent", "no such chunk")
        for ring in self.keyring:
            guess = self._pieces_hint
            ok, got = self._call("read", False, lambda c: read(c, bkey, ring, out, guess, bounds))
            if not ok:
                self._count(misses=1)
                return None
            r = got
            r.asked = guess
            if r.kind != "absent":
                break
        if r.head is not None:
            self._pieces_hint = max(1, min(r.head.piece_count, MAX_GUESS))
        if r.problem is None and r.head is not None:
            self._count(hits=1, bytes_in=r.head.stored_len)
            return r.head.meta
        self._count(misses=1)
        self._note_miss(bkey, r)
        return None

    # -- aliases -----------------------------------------------------------------------
    def alias_name(self, alias: bytes, keys: Keys | None = None) -> str:
        """The Redis key of an alias value (a partial key that names the record holding its
        leading tokens), under ``keys`` (default: the current secret's)."""
        return self._tag(alias, keys) + ":a"

    def put_aliases(self, aliases: Sequence[tuple[bytes, bytes, int, int]]) -> bool:
        """Store alias values, each ``(alias key, record key, tokens, record tokens)``: the
        record of ``record key`` holds ``record tokens`` tokens, of which the first
        ``tokens`` are those the alias key names. One pipelined round trip (not a
        transaction: an alias is useful alone, and names of several records live on several
        cluster nodes). Authenticated like heads (and their body encrypted) under the current
        secret, bound to the alias's Redis name and key. True when the server took them all."""
        if not aliases or self.clock.monotonic() < self._writes_paused_until:
            return not aliases
        keys = self.keyring[0]
        values: list[tuple[str, bytes]] = []
        for alias, target, n, rec in aliases:
            if not (0 < n < rec < 1 << 32 and 0 < len(target) <= 1024 and len(alias) == len(target)):
                raise StoreError(f"an alias of {n} tokens into a record of {rec} cannot be put to the remote tier")
            name = self.alias_name(alias)
            body = _ALIAS.pack(n, rec, len(target)) + bytes(target)
            values.append((name, keys.seal_alias(self.mode, name, bytes(alias), new_nonce(), body)))
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))

        def write(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(name, value, px=px)
            for r in pipe.execute(raise_on_error=False):
                if isinstance(r, Exception):
                    raise r

        ok, _ = self._call("put aliases", False, write)
        return ok

    def lookup_partial(self, keys: Sequence[bytes], partials: Sequence[bytes]) -> \
            tuple[list[bool], list[bool], list[Callable[[], tuple[bytes, int, int] | None] | None]] | None:
        """One pipelined round trip (``lookup_timeout_s``) for a lookup at the block: which
        of ``keys`` have a head (``contains_many``), which of ``partials`` have a head of
        their own (a tail record), and the alias value of each partial key: None where there
        is none, else a call that verifies it (only the ones a caller needs are verified)
        and returns ``(record key, tokens, record tokens)`` or None. None when the server
        did not answer. An alias value that does not verify is None and counted (``forged``: a MAC
        that fails, a value of another purpose or name; ``torn``: without a secret, a
        checksum that fails; ``foreign``: another format); the caller checks the claims of
        one that does against what it looks for."""
        per = len(self.keyring)
        tags = [(ring, self._tag(p, ring)) for p in partials for ring in self.keyring]  # one digest each
        heads = [self.head_key(k, ring) for k in keys for ring in self.keyring] + [t + ":h" for _r, t in tags]
        names = [(p, ring, t + ":a") for p, (ring, t) in zip([p for p in partials for _ in self.keyring], tags,
                                                               strict=True)]
        if not heads:
            return [], [], []

        def look(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for h in heads:
                pipe.exists(h)
            for _p, _ring, name in names:
                pipe.get(name)
            return list(pipe.execute(raise_on_error=False))

        self._count(lookups=len(keys) + len(partials))
        ok, res = self._call("lookup", True, look)
        if not ok:
            return None
        there = [r is True or (isinstance(r, int) and r > 0) for r in res[: len(heads)]]
        found = [any(there[i:i + per]) for i in range(0, len(there), per)]
        values = res[len(heads):]

        def opener(i: int) -> Callable[[], tuple[bytes, int, int] | None] | None:
            mine = [(ring, name, raw) for (_p, ring, name), raw in zip(names[i * per:(i + 1) * per],
                                                                       values[i * per:(i + 1) * per], strict=True)
                    if raw is not None]
            if not mine:
                return None
            alias = bytes(partials[i])

            def open_it() -> tuple[bytes, int, int] | None:
                for ring, name, raw in mine:
                    got = self._open_alias(alias, ring, name, raw)
                    if got is not None:
                        return got
                return None
            return open_it

        return found[: len(keys)], found[len(keys):], [opener(i) for i in range(len(partials))]

    def _open_alias(self, alias: bytes, ring: Keys, name: str,
                    raw: object) -> tuple[bytes, int, int] | None:
        """A verified alias value's ``(record key, tokens, record tokens)``; None (counted)
        for anything else."""
        short = alias.hex()[32:48]
        try:
            if not isinstance(raw, bytes):
                raise Foreign(f"not a string value ({raw})")
            body = ring.open_alias(name, alias, raw)
            if len(body) < _ALIAS.size:
                raise Forged("an alias value too short for its fields")
            n, rec, tlen = _ALIAS.unpack_from(body, 0)
            target = body[_ALIAS.size:]
            if len(target) != tlen or tlen != len(alias):
                raise Forged("an alias value whose record key does not add up")
        except Foreign as exc:
            self._count(foreign=1)
            self._warn("foreign", "alias %s at %s: %s; a miss", short, name, exc)
            return None
        except Torn as exc:  # without a secret: a checksum that fails
            self._count(torn=1)
            self._warn("torn", "alias %s at %s: %s; a miss", short, name, exc)
            return None
        except Forged as exc:
            self._count(forged=1)
            self._warn("forged", "alias %s at %s: %s; a miss", short, name, exc)
            return None
        return target, n, rec

    def count_forged(self, key: bytes, problem: str) -> None:
        """An alias value that verified but whose claims do not fit what it was asked for (a
        record of another namespace, token counts that do not fit): a miss counted ``forged``
        (only a holder of the secret could have written it)."""
        self._count(forged=1)
        self._warn("forged", "alias %s: %s; a miss", bytes(key).hex()[32:48], problem)

    def count_foreign(self, key: bytes, problem: str) -> None:
        """A hit the caller found unusable after all (verified bytes that do not decode): a
        miss counted ``foreign``."""
        self._count(hits=-1, misses=1, foreign=1)
        self._warn("foreign", "chunk %s: %s; a miss", bytes(key).hex()[32:48], problem)

    def _note_miss(self, key: bytes, r: Read) -> None:
        """Count (and log, and for a bad value drop from the server) what made a read a miss."""
        short = key.hex()[32:48]
        if r.kind in ("absent", "too_small", "foreign"):
            if r.kind != "absent":
                self._count(**{r.kind: 1})
                self._warn(r.kind, "chunk %s: the value at %s is not one this read takes (%s); a miss", short,
                           r.name, r.problem)
            return
        if r.kind in ("forged-head", "torn-head"):
            # a head that does not verify tells no piece count: the names the read asked for go
            # with it (they are this chunk's own names, and while the head is unchanged no put
            # of ours has replaced any of them)
            kind, pieces = r.kind[:-5], piece_names(r.tag, r.asked)
        else:
            assert r.head is not None
            kind = "evicted_discovered" if r.kind == "missing" else r.kind
            pieces = piece_names(r.tag, r.head.piece_count)
        if self._drop_if_unchanged(r.name, r.head_raw or b"", pieces) is not False:
            # still the head we read (or we could not tell): the value really is bad or gone,
            # not replaced by a writer while we read
            self._count(**{kind: 1})
            self._warn(kind, "chunk %s at %s: %s; a miss, dropped", short, r.name, r.problem)

    def _open_head(self, key: bytes, ring: Keys, raw: bytes | rx.ResponseError | None,
                   out: Buffer | Callable[[RemoteMeta], Buffer], bounds: Bounds) -> Read:
        """Verify and parse a head read from the server and get the buffer for the chunk: a
        ``Read`` that says what is wrong, or one with ``dst`` set."""
        tag = self._tag(key, ring)
        name = tag + ":h"
        if raw is None:
            return Read("absent", "no such chunk", name, tag)
        if isinstance(raw, Exception):
            return Read("foreign", f"not a string value ({raw})", name, tag)
        try:
            head = self._open(key, ring, name, raw)
        except (Foreign, Nonsense) as exc:
            return Read("foreign", str(exc), name, tag, raw)
        except Forged as exc:
            return Read("forged-head", str(exc), name, tag, raw)
        except Torn as exc:
            return Read("torn-head", str(exc), name, tag, raw)
        wrong = bounds.problem(head)
        if wrong:
            return Read("foreign", wrong, name, tag, raw, head)
        dst = memoryview(out(head.meta) if callable(out) else out).cast("B")
        if dst.readonly:
            raise TypeError("get_into needs a writable buffer")
        if len(dst) < head.stored_len:
            return Read("too_small", f"it holds {head.stored_len} stored bytes, the buffer only {len(dst)}", name,
                         tag, raw, head)
        cipher = ring.pieces(name, key, head.nonce, head.piece_count) if head.mode == MODE_SEALED else None
        return Read("reading", None, name, tag, raw, head, dst[:head.stored_len],
                    ring.payload_mac(name, key, head.nonce), cipher,
                    lane=self._lane() if self.use_lanes and head.mode != MODE_PLAIN and head.stored_len >= LANE_MIN
                    else None)

    def _lane(self) -> Lane | None:
        """A lane for a read's MAC and decryption (None: none can start, the tier is closed)."""
        with self._client_lock:
            if self._closed:
                return None
            if self._lanes is None:
                self._lanes = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="lmctl-remote-check")
            return Lane(self._lanes)

    def _read_direct(self, client: Any, key: bytes, ring: Keys,
                     out: Buffer | Callable[[RemoteMeta], Buffer],
                     guess: int, bounds: Bounds) -> Read:
        """The read on a single server: the pipeline is sent on a connection of redis-py's
        pool and its replies are read with ``ReplyReader``, pieces straight into the buffer
        (RESP2 and RESP3 answer GET alike). A connection left in an unknown state (an error,
        a timeout, a push message among the replies) is closed."""
        pool = client.connection_pool
        conn = pool.get_connection()
        r: Read | None = None
        try:
            sock = conn._get_socket()
            if sock is None or getattr(pool, "cache", None) is not None:
                # not connected, or a client-side cache (whose invalidations arrive as push
                # messages between replies): redis-py's way
                pool.release(conn)
                conn = None
                return self._read_pipelined(client, key, ring, out, guess, bounds)
            tag = self._tag(key, ring)
            conn.send_packed_command([pack_gets([tag + ":h", *piece_names(tag, guess)])], check_health=False)
            rd = ReplyReader(sock)
            n = rd.header()
            if isinstance(n, int) and n > MAX_HEAD:
                rd.skip(n)  # never read into memory: no head of ours is that long
                r = Read("foreign", f"a head of {n} bytes", tag + ":h", tag)
            else:
                r = self._open_head(key, ring, rd.read_bytes(n) if isinstance(n, int) else n, out, bounds)
            self._receive(rd, r, 0, guess)
            if r.kind == "reading" and r.head is not None and r.head.piece_count > guess:
                count = r.head.piece_count
                conn.send_packed_command([pack_gets(piece_names(tag, count, guess))], check_health=False)
                self._receive(rd, r, guess, count)
            return r.finish()
        except BaseException:
            if conn is not None:
                conn.disconnect()
            if r is not None:
                r.settle()  # no check may touch the caller's buffer once the read has ended
            raise
        finally:
            if conn is not None:
                pool.release(conn)

    @staticmethod
    def _receive(rd: ReplyReader, r: Read, first: int, end: int) -> None:
        """Read the replies for pieces ``first`` .. ``end - 1`` into ``r`` (every reply is
        consumed, whatever ``r`` has found wrong)."""
        for i in range(first, end):
            n = rd.header()
            view = r.accept(i, n)
            if view is None:
                if isinstance(n, int):
                    rd.skip(n)
            elif r.cipher is None:
                rd.read_into(view, r.land)
            else:
                rd.read_into(view, r.land, end=False)
                rd.read_into(r.gcm_tag)
                r.end_piece(i)

    def _read_pipelined(self, client: Any, key: bytes, ring: Keys,
                        out: Buffer | Callable[[RemoteMeta], Buffer],
                        guess: int, bounds: Bounds) -> Read:
        """The read through redis-py's pipelines (a cluster client, or a client-side cache):
        redis-py reads every reply into memory, so the head comes first and each value is
        asked for with a GETRANGE no longer than it may be (a value planted longer is cut, never
        read whole); the replies are copied into the buffer."""
        tag = self._tag(key, ring)

        def ranges(wanted: list[tuple[str, int]]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, n in wanted:
                pipe.getrange(name, 0, n)  # one byte more than wanted: a longer value shows
            return list(pipe.execute(raise_on_error=False))

        head = ranges([(tag + ":h", MAX_HEAD)])[0]
        if isinstance(head, Exception) and not str(head).startswith("WRONGTYPE"):
            raise head
        if isinstance(head, bytes) and len(head) > MAX_HEAD:
            return Read("foreign", "a head longer than any of ours", tag + ":h", tag)
        r = self._open_head(key, ring, head or None, out, bounds)  # GETRANGE gives b"" for no key
        try:
            if r.kind == "reading" and r.head is not None:
                want = [r.piece_len(i) + r.extra for i in range(r.head.piece_count)]
                got = ranges(list(zip(piece_names(tag, len(want)), want, strict=True)))
                for i, piece in enumerate(got):
                    view = r.accept(i, len(piece) if isinstance(piece, bytes) else piece)
                    if view is not None:
                        view[:] = piece[:len(view)]
                        r.land(view)
                        if r.cipher is not None:
                            r.gcm_tag[:] = piece[len(view):]
                            r.end_piece(i)
            return r.finish()
        except BaseException:
            r.settle()  # no check may touch the caller's buffer once the read has ended
            raise

    def _drop_if_unchanged(self, head_key: str, head_raw: bytes, pieces: list[str]) -> bool | None:
        """Delete a bad chunk if its head is still ``head_raw`` (a writer may have replaced
        it since): True if it was (and is now deleted), False if it was not, None if the
        server could not be asked."""

        def drop(client: Any) -> bool:
            with client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(head_key)
                    if pipe.get(head_key) != head_raw:
                        return False
                    pipe.multi()
                    pipe.delete(head_key, *pieces)
                    pipe.execute()
                    return True
                except rx.WatchError:
                    return False

        ok, dropped = self._call("drop", False, drop)
        return bool(dropped) if ok else None


#: an alias value's body: tokens, record tokens, record key length; then the record key
