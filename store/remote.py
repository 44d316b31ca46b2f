"""The remote tier's client: chunk payloads in Redis or Valkey, a single server or a Redis Cluster.

Several engine instances on several machines share chunks through one server. This module is
self-contained: it stores and fetches the *stored* bytes of a chunk (already encoded by the
caller's codec) with their metadata, and verifies them; decoding, the index and the choice of
tier stay with the caller. It needs redis-py (``pip install 'lmctl[remote]'``).

API::

    tier = RemoteTier("redis://cache:6379/0", key_prefix="prod-a", password_file="/etc/lmctl/redis.pass")
    tier.put(key, stored, RemoteMeta(raw_len=..., codec="raw", layout=..., tokens=256)) -> bool
    tier.get_into(key, out) -> RemoteMeta | None     # out: a writable buffer, or meta -> buffer
    tier.get(key) -> tuple[RemoteMeta, bytearray] | None
    tier.contains_many(keys) -> list[bool]           # one pipelined round trip
    tier.delete(keys) -> int                         # chunks removed
    tier.stats() -> RemoteStats                      # counters, breaker state, bytes in/out
    tier.close()
    redacted(url) -> str                             # the URL with its password replaced by ***

No call raises for anything the server does (down, slow, full, foreign data): a failed
``put`` returns False, a failed read is a miss (None, or False in ``contains_many``), and
every failure is counted in ``stats()`` and logged (rate-limited). Only programming errors
raise (a key that is not bytes, a read-only output buffer, bad metadata); bad settings raise
``StoreError`` from the constructor.

URLs: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS; options such as
``ssl_ca_certs`` go in the query or as keyword arguments), ``unix:///path/redis.sock?db=N``.
``?cluster=1`` (or ``cluster=True``) talks to a Redis Cluster through ``redis.cluster.RedisCluster``.
The password comes from the URL or from ``password_file`` (its first line), never both; it is
never logged or shown (``repr``, messages and ``url`` use ``redacted(url)``).

Layout (all keys of a chunk share the hash tag ``{<hex chunk key>}``, so in a cluster a chunk
lives on one node and each of its operations is one node's round trip)::

    <prefix>:{<hex key>}:h      head record (below)
    <prefix>:{<hex key>}:<i>    piece i of the stored bytes, piece_bytes each (the last one shorter)

The head packs (little-endian) magic ``LMRC``, version, codec id, codec level, stored length,
raw length, xxh3-64 of the stored bytes, piece size, piece count, token count, write time, then
the chunk key, the layout JSON and an xxh3-64 of the head itself. A put reads the old head,
writes the pieces and then the new head in one MULTI/EXEC transaction sent as one pipeline (one
round trip): a chunk appears whole or not at all, and an OOM refusal of any piece aborts all of
it, so a full server keeps no partial chunks. If the chunk it replaced had more pieces, the
extra ones are then deleted.

A read is one round trip: the head and the pieces in one pipeline, as many pieces as the last
chunk this tier read had (a chunk with more takes a second round trip for the rest; keys that do
not exist cost the server next to nothing). On a single server the replies are read from the
socket by ``store/resp.py``, each piece received straight into the caller's buffer; through a
cluster client, redis-py's replies are copied. The head must be ours (magic, version, its own
checksum, the same chunk key), every piece present and of the right length, and the bytes must
match the head's length and checksum. Anything else is a miss, never wrong bytes, and is
counted: ``foreign`` (not our format or version, or another key's head), ``evicted_discovered``
(the head is there but pieces are gone: the server's ``maxmemory`` policy evicted them, or
someone deleted them), ``torn`` (a piece or the whole of the wrong length or checksum, a damaged
head). A put that lands between a read's head and its pieces makes that read a miss (the
checksum fails), not a wrong answer. A torn or evicted chunk is deleted from the server if its
head is still the one that was read (WATCH), so that lookups stop finding it.

Deadlines and the circuit breaker: lookups (``contains_many``) run on connections whose socket
timeouts are ``lookup_timeout_s``; puts, reads and deletes on connections with
``io_timeout_s``. redis-py's own retries are off, so each round trip is bounded by its timeout
(a slow server cannot stretch one call past a few timeouts). ``breaker_failures`` consecutive
failures (timeouts, connection errors, error replies other than OOM) open the breaker: calls
then return a miss or False at once without touching the network (``short_circuited``). After
``breaker_backoff_s`` one call goes through as a probe (half-open): success closes the breaker,
failure opens it again for twice as long, up to ``breaker_backoff_max_s``. So when the server
comes back, sharing resumes by itself. An OOM reply (``maxmemory`` with ``noeviction``) is
counted as ``oom`` and pauses puts for ``oom_pause_s`` (they return False, counted as
``short_circuited``); reads go on.

Remote space is the server's: lmctl never assumes a chunk it wrote is still there, and a put
with ``ttl_s`` lets the server expire chunks on its own. A writer killed between a put's commit
and the deletion of the extra pieces of the chunk it replaced leaves those behind; with an
eviction policy or ``ttl_s`` the server reclaims them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlsplit

import redis
import redis.exceptions as rx
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from .breaker import CircuitBreaker
from .codec import CODEC_IDS, CODEC_NAMES
from .errors import StoreError
from .resp import ReplyReader, pack_gets

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")

MiB = 1 << 20
#: default piece size: Redis moves values of about 4 MB at full speed, larger ones slower
PIECE_BYTES = 4 * MiB
#: no stored payload is this large (as store/index.py's MAX_CHUNK_BYTES)
MAX_STORED = 1 << 34
#: Redis refuses bulk strings over proto-max-bulk-len (512 MB by default)
MAX_PIECE_BYTES = 512 * MiB

HEAD_MAGIC = b"LMRC"
HEAD_VERSION = 2
# magic, version, codec, level, stored_len, raw_len, checksum, piece_bytes, piece_count,
# tokens, written, key_len, layout_len; then key, layout JSON, xxh3-64 of everything before it
_HEAD = struct.Struct("<4sHBhQQQIIIdHI")
_U64 = struct.Struct("<Q")
#: a read asks for at most this many pieces before it knows the chunk's piece count
MAX_GUESS = 64

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:/@+=-]{1,100}")
_SECRET_QUERY_KEYS = {"password", "pass", "passwd", "auth", "ssl_password", "token", "secret"}
#: one warning per kind of failure per this many seconds (a dead server must not flood the log)
WARN_EVERY_S = 10.0


def redacted(url: str) -> str:
    """``url`` with its password (and any password-like query value) replaced by ``***``, for
    every message and listing that names a remote server."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable remote URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"{user}@{hostport}"
    query = "&".join(
        f"{k}=***" if k.lower() in _SECRET_QUERY_KEYS else (f"{k}={v}" if v or "=" in pair else k)
        for pair in parts.query.split("&") if pair
        for k, _, v in [pair.partition("=")]
    )
    return _join(parts.scheme, netloc, parts.path, query)


def _join(scheme: str, netloc: str, path: str, query: str) -> str:
    """A URL from its parts (``urlunsplit`` would turn ``unix:///x`` into ``unix:/x``)."""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


# -- metadata and statistics -----------------------------------------------------------------
@dataclass(frozen=True)
class RemoteMeta:
    """What a remote chunk carries besides its stored bytes.

    For ``put``: ``raw_len`` (decoded length), ``codec`` (a name of store/codec.py) and its
    ``level``, ``layout`` and ``tokens``; ``checksum`` (xxh3-64 of the stored bytes, as the
    store's index keeps it) is computed when None. The rest is filled in by the tier:
    ``stored_len``, ``written`` (Unix time of the put), ``piece_bytes``.
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


@dataclass
class RemoteStats:
    """Counters of one ``RemoteTier`` (this process only), and its breaker's state.

    ``calls`` went to the server; ``errors`` of them failed, whatever the reason (``timeouts``
    and ``oom`` are the ones that failed for those reasons). ``short_circuited`` calls were
    answered without the network (breaker open, or puts paused after an OOM). Of the reads,
    ``hits`` returned verified bytes and ``misses`` did not (absent, ``foreign``, ``torn``,
    ``evicted_discovered``, ``too_small``, an error or the breaker). ``bytes_out`` and
    ``bytes_in`` count stored payload bytes put and read.
    """

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    oom: int = 0
    short_circuited: int = 0
    puts: int = 0
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    deleted: int = 0
    torn: int = 0
    foreign: int = 0
    evicted_discovered: int = 0
    too_small: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    breaker: str = "closed"
    breaker_opened: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the head record -----------------------------------------------------------------------
class _Foreign(Exception):
    """The value at a head key is not a head of ours (another format, version or key)."""


class _Torn(Exception):
    """A head of ours that does not add up (damaged)."""


@dataclass(frozen=True)
class _Head:
    meta: RemoteMeta
    checksum: int
    stored_len: int
    piece_bytes: int
    piece_count: int


@dataclass
class _Read:
    """What one read found: ``kind`` is ``reading`` while the pieces arrive, then ``ok``, or
    what made it a miss (``absent``, ``foreign``, ``torn-head``, ``too_small``, ``missing``
    pieces, ``torn`` pieces)."""

    kind: str
    problem: str | None
    head_raw: bytes | None = None
    head: _Head | None = None
    dst: memoryview | None = None
    hasher: Any = None
    missing: int = 0

    def piece_len(self, i: int) -> int:
        assert self.head is not None
        return min(self.head.piece_bytes, self.head.stored_len - i * self.head.piece_bytes)

    def slot(self, i: int) -> memoryview:
        assert self.head is not None and self.dst is not None
        pos = i * self.head.piece_bytes
        return self.dst[pos:pos + self.piece_len(i)]

    def fail(self, problem: str) -> None:
        if self.kind == "reading":
            self.kind, self.problem = "torn", problem

    def accept(self, i: int, reply: object) -> memoryview | None:
        """Piece ``i``'s reply, seen by its length (an int), None (the key is gone) or
        anything else (not a string): the slice of the buffer its bytes go to, or None when
        they are not wanted (noted as missing or torn, or the read has already failed)."""
        if self.kind != "reading" or self.head is None or i >= self.head.piece_count:
            return None
        want = self.piece_len(i)
        if reply is None:
            self.missing += 1
        elif not isinstance(reply, int):
            self.fail(f"piece {i} is not a string ({reply!r})")
        elif reply != want:
            self.fail(f"piece {i} has {reply} bytes, not {want}")
        else:
            return self.slot(i)
        return None

    def finish(self) -> _Read:
        """The verdict once every piece has been received."""
        if self.kind == "reading" and self.head is not None:
            if self.missing:
                self.kind, self.problem = "missing", f"{self.missing} of {self.head.piece_count} pieces are gone"
            elif self.hasher.intdigest() != self.head.checksum:
                self.kind, self.problem = "torn", "checksum mismatch"
            else:
                self.kind = "ok"
        self.dst = None  # the caller's buffer is not kept
        return self


def _pack_head(key: bytes, meta: RemoteMeta, stored_len: int, checksum: int, piece_bytes: int,
               written: float) -> bytes:
    layout = json.dumps(meta.layout, separators=(",", ":"), sort_keys=True).encode()
    count = -(-stored_len // piece_bytes)
    body = _HEAD.pack(HEAD_MAGIC, HEAD_VERSION, CODEC_IDS[meta.codec], meta.level, stored_len, meta.raw_len,
                      checksum, piece_bytes, count, meta.tokens, written, len(key),
                      len(layout)) + key + layout
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body))


def _unpack_head(raw: bytes, key: bytes) -> _Head:
    """Parse a head; ``_Foreign`` if it is not ours, ``_Torn`` if it is damaged."""
    if len(raw) < _HEAD.size + _U64.size or raw[:4] != HEAD_MAGIC:
        raise _Foreign("not an lmctl remote head")
    (_m, version, codec, level, stored_len, raw_len, checksum, piece_bytes, count, tokens, written,
     key_len, layout_len) = _HEAD.unpack_from(raw, 0)
    if version != HEAD_VERSION:
        raise _Foreign(f"head of format version {version}, this lmctl reads {HEAD_VERSION}")
    end = _HEAD.size + key_len + layout_len
    if end + _U64.size != len(raw) or _U64.unpack_from(raw, end)[0] != xxhash.xxh3_64_intdigest(raw[:end]):
        raise _Torn("the head fails its own checksum")
    if raw[_HEAD.size:_HEAD.size + key_len] != key:
        raise _Foreign("the head names another chunk key")
    if codec not in CODEC_NAMES or not 0 < piece_bytes <= MAX_PIECE_BYTES or stored_len >= MAX_STORED \
            or count != -(-stored_len // piece_bytes) or not math.isfinite(written):
        raise _Foreign("the head's codec, lengths or time make no sense")
    try:
        layout = json.loads(raw[_HEAD.size + key_len:end] or b"{}")
    except ValueError:
        raise _Foreign("the head's layout is not JSON") from None
    if not isinstance(layout, dict):
        raise _Foreign("the head's layout is not a JSON object")
    meta = RemoteMeta(raw_len=raw_len, codec=CODEC_NAMES[codec], level=level, layout=layout, tokens=tokens,
                      checksum=checksum, stored_len=stored_len, written=written, piece_bytes=piece_bytes)
    return _Head(meta, checksum, stored_len, piece_bytes, count)


# -- the client ----------------------------------------------------------------------------
class RemoteTier:
    """Chunks in Redis/Valkey (see the module docstring for the layout and the failure rules).

    ``url``: ``redis://``, ``rediss://`` or ``unix://`` (``?cluster=1`` for a Redis Cluster).
    ``key_prefix``: this deployment's namespace on the server (letters, digits and ``_.:/@+=-``;
    two prefixes never see each other's chunks). ``piece_bytes``: the size of a piece.
    ``lookup_timeout_s`` bounds each round trip of ``contains_many``; ``io_timeout_s`` those of
    puts, reads and deletes. ``password_file``: a file whose first line is the password (instead
    of one in the URL). ``cluster``: None takes it from the URL. ``ttl_s``: chunks expire on the
    server after this long (None: never; the server's maxmemory policy decides). The breaker and
    OOM settings are described in the module docstring. ``redis_options`` go to redis-py's
    client (e.g. ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``username``).
    """

    def __init__(self, url: str, *, key_prefix: str, piece_bytes: int = PIECE_BYTES,
                 lookup_timeout_s: float = 0.05, io_timeout_s: float = 2.0, password_file: str | os.PathLike[str] |
                 None = None, cluster: bool | None = None, ttl_s: float | None = None, breaker_failures: int = 3,
                 breaker_backoff_s: float = 1.0, breaker_backoff_max_s: float = 30.0, oom_pause_s: float = 1.0,
                 **redis_options: Any) -> None:
        self.url = redacted(url)
        if not isinstance(key_prefix, str) or not _PREFIX_RE.fullmatch(key_prefix):
            raise StoreError(f"remote key prefix {key_prefix!r} is not allowed: use 1-100 letters, digits "
                             "or _.:/@+=- (no braces: they would break the hash tag)")
        if not 0 < piece_bytes <= MAX_PIECE_BYTES:
            raise StoreError(f"remote piece_bytes must be between 1 and {MAX_PIECE_BYTES}, not {piece_bytes}")
        if not (lookup_timeout_s > 0 and io_timeout_s > 0):
            raise StoreError("remote timeouts must be positive")
        if ttl_s is not None and ttl_s <= 0:
            raise StoreError("remote ttl_s must be positive (or None for no expiry)")
        if oom_pause_s < 0:
            raise StoreError("remote oom_pause_s must not be negative")
        reserved = {"socket_timeout", "socket_connect_timeout", "retry", "password", "url"} & set(redis_options)
        if reserved:
            raise StoreError(f"remote: {', '.join(sorted(reserved))} cannot be given as a redis option; "
                             "use the timeouts, the URL or password_file")
        self.key_prefix = key_prefix
        self.piece_bytes = piece_bytes
        self.lookup_timeout_s = lookup_timeout_s
        self.io_timeout_s = io_timeout_s
        self.ttl_s = ttl_s
        self.oom_pause_s = oom_pause_s
        self._target, self.cluster, password = self._parse_url(url, cluster, password_file)
        self._options = dict(redis_options)
        if password is not None:
            self._options["password"] = password
        self.breaker = CircuitBreaker(breaker_failures, breaker_backoff_s, breaker_backoff_max_s)
        self._clients: dict[bool, Any] = {}  # fast (lookups) -> client
        self._client_lock = threading.Lock()  # making a cluster client talks to the cluster
        self._lock = threading.Lock()  # counters
        self._stats = RemoteStats()
        self._writes_paused_until = 0.0
        self._last_warn: dict[str, float] = {}
        self._closed = False
        self._pieces_hint = 1  # the piece count of the last chunk read: how many pieces a read asks for
        #: reads receive pieces straight into the caller's buffer (single server; see _read_direct)
        self.direct_reads = not self.cluster

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r}, key_prefix={self.key_prefix!r}, cluster={self.cluster})"

    # -- settings ----------------------------------------------------------------------
    def _parse_url(self, url: str, cluster: bool | None,
                   password_file: str | os.PathLike[str] | None) -> tuple[str, bool, str | None]:
        """The URL to give redis-py (lmctl's own query options removed), cluster or not, and
        the password from the password file."""
        if not isinstance(url, str):
            raise StoreError("the remote URL must be a string")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise StoreError(f"remote URL {self.url} cannot be parsed: {exc}") from None
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise StoreError(f"remote URL {self.url} must start with redis://, rediss:// or unix://")
        query, flag = [], None
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k == "cluster":
                flag = v.lower() in ("1", "true", "yes", "on")
            else:
                query.append(f"{quote(k, safe='')}={quote(v, safe='/:')}")
        cluster = flag if cluster is None else cluster
        cluster = bool(cluster)
        if cluster and parts.scheme == "unix":
            raise StoreError(f"remote URL {self.url}: redis-py cannot reach a Redis Cluster over a Unix socket")
        if cluster and parts.path.strip("/") not in ("", "0"):
            raise StoreError(f"remote URL {self.url}: a Redis Cluster has only database 0")
        password = None
        if password_file is not None:
            if parts.password:
                raise StoreError(f"remote URL {self.url} has a password and a password file was given too: "
                                 "give it once")
            password = _read_password(Path(password_file))
        return _join(parts.scheme, parts.netloc, parts.path, "&".join(query)), cluster, password

    def _client(self, fast: bool) -> Any:
        """The client for lookups (``fast``) or for I/O, made on first use (a cluster client
        asks the cluster for its slots when it is made)."""
        client = self._clients.get(fast)
        if client is None:
            with self._client_lock:
                client = self._clients.get(fast)
                if client is None:
                    if self._closed:
                        raise StoreError(f"remote tier {self.url} is closed")
                    timeout = self.lookup_timeout_s if fast else self.io_timeout_s
                    opts = dict(self._options, socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry=Retry(NoBackoff(), 0))
                    if self.cluster:
                        from redis.cluster import RedisCluster

                        client = RedisCluster(url=self._target, **opts)
                    else:
                        client = redis.Redis.from_url(self._target, **opts)
                    self._clients[fast] = client
        return client

    def close(self) -> None:
        """Close the connections. Calls made after this count as errors."""
        with self._client_lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            try:
                c.close()
            except Exception as exc:  # closing a broken connection is not worth an error
                log.debug("closing a remote client of %s: %s", self.url, exc)

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys --------------------------------------------------------------------------
    def _tag(self, key: bytes) -> str:
        if not isinstance(key, bytes | bytearray) or not 0 < len(key) <= 1024:
            raise TypeError(f"a chunk key must be 1-1024 bytes, not {type(key).__name__} of length "
                            f"{len(key) if isinstance(key, bytes | bytearray) else '?'}")
        return f"{self.key_prefix}:{{{bytes(key).hex()}}}"

    def head_key(self, key: bytes) -> str:
        """The Redis key of a chunk's head record (for operators and tests)."""
        return self._tag(key) + ":h"

    def piece_keys(self, key: bytes, count: int, first: int = 0) -> list[str]:
        """The Redis keys of a chunk's pieces ``first`` .. ``count - 1``."""
        tag = self._tag(key)
        return [f"{tag}:{i}" for i in range(first, count)]

    # -- bookkeeping -------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_warn.get(kind, -math.inf) < WARN_EVERY_S:
                return
            self._last_warn[kind] = now
        log.warning("remote tier %s: " + msg, self.url, *args)

    def stats(self) -> RemoteStats:
        """A snapshot of the counters and the breaker's state."""
        with self._lock:
            s = dataclasses.replace(self._stats)
        s.breaker, s.breaker_opened = self.breaker.state, self.breaker.opened
        return s

    def _call(self, op: str, fast: bool, fn: Callable[[Any], Any]) -> tuple[bool, Any]:
        """Run ``fn(client)`` under the breaker: (True, its result), or (False, None) when the
        breaker is open or the call failed (counted and logged, never raised)."""
        if not self.breaker.allow():
            self._count(short_circuited=1)
            return False, None
        self._count(calls=1)
        verdict = False
        try:
            result = fn(self._client(fast))
            verdict = True
            if self.breaker.success():
                log.warning("remote tier %s: the server answers again; circuit breaker closed", self.url)
            return True, result
        except rx.OutOfMemoryError as exc:
            verdict = True
            self.breaker.success()  # it answered: the server is up, only full
            self._count(errors=1, oom=1)
            self._writes_paused_until = time.monotonic() + self.oom_pause_s
            self._warn("oom", "%s refused: the server is out of memory (maxmemory with noeviction); chunks are "
                       "not being stored: %s", op, exc)
        except (rx.RedisError, rx.RedisClusterException, OSError, StoreError) as exc:
            verdict = True
            timeout = isinstance(exc, rx.TimeoutError | TimeoutError)
            self._count(errors=1, timeouts=int(timeout))
            kind = "timed out" if timeout else "failed"
            self._warn(f"{op} {kind}", "%s %s: %s", op, kind, exc or type(exc).__name__)
            if self.breaker.failure():
                log.warning("remote tier %s: circuit breaker open after %d failure(s); remote calls are misses "
                            "for %.1f s, then one call probes the server", self.url, self.breaker.failures,
                            self.breaker.backoff)
        finally:
            if not verdict:
                self.breaker.release()
        return False, None

    # -- writes ------------------------------------------------------------------------
    def put(self, key: bytes, stored: Buffer, meta: RemoteMeta) -> bool:
        """Store a chunk's stored bytes and metadata (replacing any chunk of that key).
        True when the server committed it; False (counted) when it did not: breaker open,
        OOM, timeout or any other failure."""
        head_key = self.head_key(key)
        data = memoryview(stored).cast("B")
        n = len(data)
        if meta.codec not in CODEC_IDS:
            raise StoreError(f"unknown codec {meta.codec!r}; choose one of {', '.join(CODEC_IDS)}")
        if n >= MAX_STORED or -(-n // self.piece_bytes) >= 1 << 32 or not 0 <= meta.raw_len < MAX_STORED:
            raise StoreError(f"a chunk of {n} stored / {meta.raw_len} raw bytes is too large for the remote tier")
        if not (0 <= meta.tokens < 1 << 32 and -(1 << 15) <= meta.level < 1 << 15):
            raise StoreError("remote chunk metadata out of range (tokens, level)")
        if time.monotonic() < self._writes_paused_until:
            self._count(short_circuited=1, put_failures=1)
            return False
        checksum = xxhash.xxh3_64_intdigest(data) if meta.checksum is None else meta.checksum
        head = _pack_head(bytes(key), meta, n, checksum, self.piece_bytes, time.time())
        count = -(-n // self.piece_bytes)
        pieces = self.piece_keys(key, count)
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))

        def write(client: Any) -> Any:
            pipe = client.pipeline(transaction=True)
            pipe.get(head_key)  # the head this put replaces (an error reply if a foreign type is there)
            for i, pk in enumerate(pieces):
                pipe.set(pk, data[i * self.piece_bytes:(i + 1) * self.piece_bytes], px=px)
            pipe.set(head_key, head, px=px)
            res = pipe.execute(raise_on_error=False)
            for r in res[1:]:
                if isinstance(r, Exception):
                    raise r
            return res[0]

        ok, old = self._call("put", False, write)
        if not ok:
            self._count(put_failures=1)
            return False
        self._count(puts=1, bytes_out=n)
        if isinstance(old, bytes) and old != head:
            self._forget_pieces(key, old, count)
        return True

    def _forget_pieces(self, key: bytes, old_head: bytes, count: int) -> None:
        """Delete the pieces of the chunk a put replaced that the new one does not overwrite
        (the old one had more of them; best effort)."""
        try:
            old = _unpack_head(old_head, bytes(key))
        except (_Foreign, _Torn):
            return
        if old.piece_count > count:
            stale = self.piece_keys(key, old.piece_count, count)
            self._call("delete", False, lambda c: _delete_each(c, stale))

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove chunks (head and pieces); how many were there. Failures are counted (0)."""
        keys = list(keys)
        heads = [self.head_key(k) for k in keys]
        if not keys:
            return 0

        def remove(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            for h in heads:
                pipe.getdel(h)  # the head we remove names the pieces we must remove, whatever a writer does next
            found = pipe.execute(raise_on_error=False)
            pipe = client.pipeline(transaction=False)
            n = 0
            for k, raw in zip(keys, found, strict=True):
                if not isinstance(raw, bytes):
                    continue
                n += 1
                try:
                    old = _unpack_head(raw, bytes(k))
                except (_Foreign, _Torn):
                    continue
                for pk in self.piece_keys(k, old.piece_count):
                    pipe.delete(pk)  # one key per DEL: a cluster pipeline refuses multi-key commands
            if len(pipe):
                pipe.execute(raise_on_error=False)
            return n

        ok, n = self._call("delete", False, remove)
        n = n if ok else 0
        self._count(deleted=n)
        return int(n)

    # -- reads -------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` have a head on the server, in one pipelined round trip bounded by
        ``lookup_timeout_s``. A failure (or an open breaker) answers False for all. A head does
        not promise its pieces: ``get_into`` finds out."""
        heads = [self.head_key(k) for k in keys]
        if not heads:
            return []

        def look(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for h in heads:
                pipe.exists(h)
            return [r is True or (isinstance(r, int) and r > 0) for r in pipe.execute(raise_on_error=False)]

        self._count(lookups=len(heads))
        ok, found = self._call("lookup", True, look)
        return list(found) if ok else [False] * len(heads)

    def get(self, key: bytes) -> tuple[RemoteMeta, bytearray] | None:
        """The chunk's metadata and stored bytes, verified; None for a miss."""
        box: list[bytearray] = []

        def alloc(meta: RemoteMeta) -> bytearray:
            box.append(bytearray(meta.stored_len or 0))
            return box[0]

        meta = self.get_into(key, alloc)
        return None if meta is None else (meta, box[0])

    def get_into(self, key: bytes, out: Buffer | Callable[[RemoteMeta], Buffer]) -> RemoteMeta | None:
        """Read a chunk's stored bytes into ``out[:meta.stored_len]`` and return its metadata,
        verified against the head's length and checksum; None for a miss (counted: absent,
        foreign, torn, evicted pieces, an error, the breaker open). ``out`` is a writable
        buffer, or a function that is given the metadata once the head is read and returns
        one (so the caller can size it); a buffer smaller than the chunk is a miss
        (``too_small``). On a miss ``out`` may hold partial bytes.

        One round trip: the head and as many pieces as the last chunk read had, in one
        pipeline (a second round trip fetches the rest when this chunk has more). On a single
        server the pieces are received straight into ``out``; through a cluster client they
        are copied from redis-py's replies."""
        if not callable(out) and memoryview(out).readonly:
            raise TypeError("get_into needs a writable buffer")
        bkey = bytes(key)
        guess = self._pieces_hint
        read = self._read_direct if self.direct_reads else self._read_pipelined
        ok, got = self._call("read", False, lambda c: read(c, bkey, out, guess))
        if not ok:
            self._count(misses=1)
            return None
        r: _Read = got
        if r.head is not None:
            self._pieces_hint = max(1, min(r.head.piece_count, MAX_GUESS))
        if r.problem is None and r.head is not None:
            self._count(hits=1, bytes_in=r.head.stored_len)
            return r.head.meta
        self._count(misses=1)
        if r.kind == "absent":
            return None
        if r.kind == "foreign":
            self._count(foreign=1)
            self._warn("foreign", "chunk %s: the value at %s is foreign (%s); a miss", bkey.hex()[:16],
                       self.head_key(key), r.problem)
        elif r.kind == "torn-head":
            self._count(torn=1)
            self._warn("torn", "chunk %s is torn (%s); a miss, dropped", bkey.hex()[:16], r.problem)
            self._drop_if_unchanged(key, r.head_raw or b"", [])
        elif r.kind == "too_small":
            self._count(too_small=1)
            self._warn("too_small", "chunk %s: %s; a miss", bkey.hex()[:16], r.problem)
        elif r.head is not None:
            pieces = self.piece_keys(key, r.head.piece_count)
            if self._drop_if_unchanged(key, r.head_raw or b"", pieces) is not False:
                # still the head we read (or we could not tell): its pieces really are gone or
                # wrong, not replaced by a writer while we read
                self._count(**{"evicted_discovered" if r.kind == "missing" else "torn": 1})
                self._warn("evicted" if r.kind == "missing" else "torn", "chunk %s: %s; a miss, dropped",
                           bkey.hex()[:16], r.problem)
        return None

    def _open_head(self, key: bytes, raw: bytes | rx.ResponseError | None,
                   out: Buffer | Callable[[RemoteMeta], Buffer]) -> _Read:
        """Parse a head read from the server and get the buffer for the chunk: a ``_Read``
        that says what is wrong, or one with ``dst`` set."""
        if raw is None:
            return _Read("absent", "no such chunk")
        if isinstance(raw, Exception):
            return _Read("foreign", f"not a string value ({raw})")
        try:
            head = _unpack_head(raw, key)
        except _Foreign as exc:
            return _Read("foreign", str(exc), raw)
        except _Torn as exc:
            return _Read("torn-head", str(exc), raw)
        dst = memoryview(out(head.meta) if callable(out) else out).cast("B")
        if dst.readonly:
            raise TypeError("get_into needs a writable buffer")
        if len(dst) < head.stored_len:
            return _Read("too_small", f"it holds {head.stored_len} stored bytes, the buffer only {len(dst)}", raw,
                         head)
        return _Read("reading", None, raw, head, dst[:head.stored_len], xxhash.xxh3_64())

    def _read_direct(self, client: Any, key: bytes, out: Buffer | Callable[[RemoteMeta], Buffer],
                     guess: int) -> _Read:
        """The read on a single server: the pipeline is sent on a connection of redis-py's
        pool and its replies are read with ``ReplyReader``, pieces straight into the buffer
        (RESP2 and RESP3 answer GET alike). A connection left in an unknown state (an error,
        a timeout, a push message among the replies) is closed."""
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            sock = conn._get_socket()
            if sock is None or getattr(pool, "cache", None) is not None:
                # not connected, or a client-side cache (whose invalidations arrive as push
                # messages between replies): redis-py's way
                pool.release(conn)
                conn = None
                return self._read_pipelined(client, key, out, guess)
            names = [self.head_key(key), *self.piece_keys(key, guess)]
            conn.send_packed_command([pack_gets(names)], check_health=False)
            rd = ReplyReader(sock)
            n = rd.header()
            r = self._open_head(key, rd.read_bytes(n) if isinstance(n, int) else n, out)
            self._receive(rd, r, 0, guess)
            if r.kind == "reading" and r.head is not None and r.head.piece_count > guess:
                count = r.head.piece_count
                conn.send_packed_command([pack_gets(self.piece_keys(key, count, guess))], check_health=False)
                self._receive(rd, r, guess, count)
            return r.finish()
        except BaseException:
            if conn is not None:
                conn.disconnect()
            raise
        finally:
            if conn is not None:
                pool.release(conn)

    @staticmethod
    def _receive(rd: ReplyReader, r: _Read, first: int, end: int) -> None:
        """Read the replies for pieces ``first`` .. ``end - 1`` into ``r`` (every reply is
        consumed, whatever ``r`` has found wrong)."""
        for i in range(first, end):
            n = rd.header()
            view = r.accept(i, n)
            if view is not None:
                rd.read_into(view)
                r.hasher.update(view)
            elif isinstance(n, int):
                rd.skip(n)

    def _read_pipelined(self, client: Any, key: bytes, out: Buffer | Callable[[RemoteMeta], Buffer],
                        guess: int) -> _Read:
        """The read through redis-py's pipelines (a cluster client, or a client-side cache):
        the replies come as ``bytes``, copied into the buffer."""

        def gets(names: list[str]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return list(pipe.execute(raise_on_error=False))

        replies = gets([self.head_key(key), *self.piece_keys(key, guess)])
        head = replies[0]
        if isinstance(head, Exception) and not str(head).startswith("WRONGTYPE"):
            raise head
        r = self._open_head(key, head, out)
        if r.kind == "reading" and r.head is not None:
            count = r.head.piece_count
            pieces = replies[1:1 + count]
            if count > guess:
                pieces += gets(self.piece_keys(key, count, guess))
            for i, piece in enumerate(pieces):
                view = r.accept(i, len(piece) if isinstance(piece, bytes) else piece)
                if view is not None:
                    view[:] = piece
                    r.hasher.update(piece)
        return r.finish()

    def _drop_if_unchanged(self, key: bytes, head_raw: bytes, pieces: list[str]) -> bool | None:
        """Delete a broken chunk if its head is still ``head_raw`` (a writer may have replaced
        it since): True if it was (and is now deleted), False if it was not, None if the
        server could not be asked."""
        head_key = self.head_key(key)

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


def _delete_each(client: Any, names: list[str]) -> None:
    """DEL each name, in one pipeline (one key per DEL: a cluster pipeline refuses multi-key
    commands)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute(raise_on_error=False)


def _read_password(path: Path) -> str:
    """The first line of a password file. A file others can read is used, with a warning."""
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"cannot read the remote password file {path}: {exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("remote password file %s can be read by other users (mode %o); chmod 600 it", path,
                    stat.S_IMODE(st.st_mode))
    password = text.splitlines()[0] if text else ""
    if not password:
        raise StoreError(f"the remote password file {path} is empty")
    return password
