"""The remote tier's client: chunk payloads in Redis or Valkey, a single server or a Redis Cluster.

Several engine instances on several machines share chunks through one server. This module is
self-contained: it stores and fetches the *stored* bytes of a chunk (already encoded by the
caller's codec) with their metadata, and verifies them; decoding, the index and the choice of
tier stay with the caller. It needs redis-py, blake3 and, with a secret, cryptography
(``pip install 'lmctl[remote]'``).

API::

    tier = RemoteTier("redis://cache:6379/0", key_prefix="prod-a", secret_file="/etc/lmctl/remote.secret",
                      password_file="/etc/lmctl/redis.pass")
    tier.put(key, stored, RemoteMeta(raw_len=..., codec="raw", layout=..., tokens=256)) -> bool
    tier.get_into(key, out, max_stored=...) -> RemoteMeta | None   # out: a writable buffer, or meta -> buffer
    tier.get(key, max_stored=...) -> tuple[RemoteMeta, bytearray] | None
    tier.contains_many(keys) -> list[bool]           # one pipelined round trip
    tier.delete(keys) -> int                         # chunks removed
    tier.stats() -> RemoteStats                      # counters, breaker state, bytes in/out
    tier.close()
    redacted(url) -> str                             # the URL with its password replaced by ***

No call raises for anything the server does (down, slow, full, foreign or forged data): a
failed ``put`` returns False, a failed read is a miss (None, or False in ``contains_many``),
and every failure is counted in ``stats()`` and logged (rate-limited). Only programming errors
raise (a key that is not bytes, a read-only output buffer, bad metadata); bad settings raise
``StoreError`` from the constructor.

Trust: with ``secret_file`` (the deployment secret, store/remote_auth.py) every value carries
a keyed MAC and its names are keyed digests; ``previous_secret_file`` is also read (never
written) during a rotation; ``encrypt`` encrypts the pieces too. Without a secret the tier
starts only with ``trust="all-writers"``: every client that can write to the prefix is then
trusted, and nothing but accidents is detected.

URLs: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS; options such as
``ssl_ca_certs`` go in the query or as keyword arguments), ``unix:///path/redis.sock?db=N``.
``?cluster=1`` (or ``cluster=True``) talks to a Redis Cluster through ``redis.cluster.RedisCluster``.
The password comes from the URL or from ``password_file`` (its first line), never both; it is
never logged or shown (``repr``, messages and ``url`` use ``redacted(url)``).

Layout (all keys of a chunk share the hash tag ``{<name tag>}``, a keyed digest of the chunk
key (remote_auth.Keys.tag), so in a cluster a chunk lives on one node and each of its
operations is one node's round trip)::

    <prefix>:{<name tag>}:h      head record (below)
    <prefix>:{<name tag>}:<i>    piece i of the stored bytes, piece_bytes each (the last one
                                 shorter); encrypted, each is followed by its 16-byte GCM tag

The head (remote_auth.py frames it; remote_value.py lays out its metadata and follows a read
as it arrives) holds in clear only its format, a random nonce and the length of its metadata;
the metadata (stored and raw lengths, piece size and count, codec and level, tokens, write
time, the writer's id, the payload's MAC, the layout JSON) is encrypted under the secret, and
the whole head is under a MAC bound to its name and chunk key. A put
reads the old head, writes the pieces and then the new head in one MULTI/EXEC transaction
sent as one pipeline (one round trip): a chunk appears whole or not at all, and an OOM refusal
of any piece aborts all of it, so a full server keeps no partial chunks. If the chunk it
replaced had more pieces, the extra ones are then deleted.

A read is one round trip: the head and the pieces in one pipeline, as many pieces as the last
chunk this tier read had (a chunk with more takes a second round trip for the rest; keys that do
not exist cost the server next to nothing). On a single server the replies are read from the
socket by ``store/resp.py``, each piece received straight into the caller's buffer and its MAC
(or its decryption) computed as its bytes land; through a cluster client the head comes first
(bounded GETRANGEs, a second round trip) and redis-py's replies are copied. The head must
verify, its lengths must be within what the caller allows (``max_stored``, ``raw_len``,
``max_raw``: checked before anything is allocated), every piece present and of the right
length, and the payload must match the head's MAC. Anything else is a miss, never wrong bytes,
and is counted: ``foreign`` (not our format, version or deployment, or lengths the caller does
not expect), ``forged`` (a MAC or GCM tag fails: written without the secret, or copied from
another chunk), ``evicted_discovered`` (the head is there but pieces are gone: the server's
``maxmemory`` policy evicted them, or someone deleted them), ``torn`` (a piece of the wrong
length; without a secret, a checksum that fails). A put that lands between a read's head and
its pieces makes that read a miss, not a wrong answer, and is not counted. A forged, torn or
evicted chunk is deleted from the server if its head is still the one that was read (WATCH),
so that lookups stop finding it.

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
import logging
import math
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, urlsplit

import redis
import redis.exceptions as rx
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from .breaker import CircuitBreaker
from .clock import SYSTEM_CLOCK, Clock
from .codec import CODEC_IDS
from .errors import StoreError
from .remote_auth import (
    AEAD_TAG_BYTES,
    MODE_MAC,
    MODE_PLAIN,
    MODE_SEALED,
    Foreign,
    Forged,
    Keys,
    PieceCipher,
    Torn,
    check_trust,
    new_nonce,
)
from .remote_value import (
    MAX_HEAD,
    MAX_PIECE_BYTES,
    MAX_STORED,
    Bounds,
    Head,
    Lane,
    MiB,
    Nonsense,
    Read,
    RemoteMeta,
    pack_meta,
    unpack_meta,
)
from .resp import ReplyReader, pack_gets

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")

#: default piece size: Redis moves values of about 4 MB at full speed, larger ones slower
PIECE_BYTES = 4 * MiB
#: a read asks for at most this many pieces before it knows the chunk's piece count
MAX_GUESS = 64
#: reads of at least this many stored bytes MAC and decrypt on a lane (a helper thread; at most
#: LANES reads at once, others wait for one), overlapping with the receive, where the process
#: may run on at least LANE_CPUS cores (with two, the helper takes the core the Redis server or
#: the engine needs: measured, checking inline costs less CPU there)
LANE_MIN, LANES, LANE_CPUS = 1 << 20, 4, 4

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


# -- statistics ------------------------------------------------------------------------------
@dataclass
class RemoteStats:
    """Counters of one ``RemoteTier`` (this process only), and its breaker's state.

    ``calls`` went to the server; ``errors`` of them failed, whatever the reason (``timeouts``
    and ``oom`` are the ones that failed for those reasons). ``short_circuited`` calls were
    answered without the network (breaker open, or puts paused after an OOM). Of the reads,
    ``hits`` returned verified bytes and ``misses`` did not (absent, ``foreign``, ``forged``,
    ``torn``, ``evicted_discovered``, ``too_small``, an error or the breaker). ``bytes_out``
    and ``bytes_in`` count stored payload bytes put and read.
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
    forged: int = 0
    evicted_discovered: int = 0
    too_small: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    breaker: str = "closed"
    breaker_opened: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the client ----------------------------------------------------------------------------
class RemoteTier:
    """Chunks in Redis/Valkey (see the module docstring for the layout and the failure rules).

    ``url``: ``redis://``, ``rediss://`` or ``unix://`` (``?cluster=1`` for a Redis Cluster).
    ``key_prefix``: this deployment's namespace on the server (letters, digits and ``_.:/@+=-``;
    two prefixes never see each other's chunks). ``secret_file``: the deployment secret
    (``previous_secret_file``: the one it replaces, still read during a rotation; ``encrypt``:
    encrypt the pieces too); without one, ``trust`` must be ``"all-writers"``. ``writer``: the
    32-bit id this tier's heads name as their writer. ``piece_bytes``: the size of a piece.
    ``lookup_timeout_s`` bounds each round trip of ``contains_many``; ``io_timeout_s`` those of
    puts, reads and deletes. ``password_file``: a file whose first line is the password (instead
    of one in the URL). ``cluster``: None takes it from the URL. ``ttl_s``: chunks expire on the
    server after this long (None: never; the server's maxmemory policy decides). The breaker and
    OOM settings are described in the module docstring. ``redis_options`` go to redis-py's
    client (e.g. ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``username``).
    """

    def __init__(self, url: str, *, key_prefix: str, secret_file: str | os.PathLike[str] | None = None,
                 previous_secret_file: str | os.PathLike[str] | None = None, encrypt: bool = False,
                 trust: str | None = None, writer: int = 0, piece_bytes: int = PIECE_BYTES,
                 lookup_timeout_s: float = 0.05, io_timeout_s: float = 2.0, password_file: str | os.PathLike[str] |
                 None = None, cluster: bool | None = None, ttl_s: float | None = None, breaker_failures: int = 3,
                 breaker_backoff_s: float = 1.0, breaker_backoff_max_s: float = 30.0, oom_pause_s: float = 1.0,
                 clock: Clock = SYSTEM_CLOCK, **redis_options: Any) -> None:
        self.url = redacted(url)
        self.clock = clock  # heads' write times, backoffs and pauses
        if not isinstance(key_prefix, str) or not _PREFIX_RE.fullmatch(key_prefix):
            raise StoreError(f"remote key prefix {key_prefix!r} is not allowed: use 1-100 letters, digits "
                             "or _.:/@+=- (no braces: they would break the hash tag)")
        #: the keys of the secret values are written with, then those of the previous one (read only)
        self.keyring = _keyring(key_prefix, secret_file, previous_secret_file, encrypt, trust)
        self.mode = MODE_PLAIN if not self.keyring[0].authenticated else MODE_SEALED if encrypt else MODE_MAC
        if encrypt:
            PieceCipher(bytes(32), "", b"", 0)  # cryptography is there: found now, not at the first put
        if not 0 <= writer < 1 << 32:
            raise StoreError(f"remote writer id {writer} is not a 32-bit number")
        self.writer = writer
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
        self.breaker = CircuitBreaker(breaker_failures, breaker_backoff_s, breaker_backoff_max_s, clock.monotonic)
        self._clients: dict[bool, Any] = {}  # fast (lookups) -> client
        self._client_lock = threading.Lock()  # making a cluster client talks to the cluster
        self._lock = threading.Lock()  # counters
        self._stats = RemoteStats()
        self._writes_paused_until = 0.0
        self._last_warn: dict[str, float] = {}
        self._closed = False
        self._pieces_hint = 1  # the piece count of the last chunk read: how many pieces a read asks for
        self._lanes: ThreadPoolExecutor | None = None  # where reads MAC and decrypt (remote_value.Lane)
        self.use_lanes = len(os.sched_getaffinity(0)) >= LANE_CPUS
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
            lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.shutdown(wait=True)
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
    def _tag(self, key: bytes, keys: Keys | None = None) -> str:
        if not isinstance(key, bytes | bytearray) or not 0 < len(key) <= 1024:
            raise TypeError(f"a chunk key must be 1-1024 bytes, not {type(key).__name__} of length "
                            f"{len(key) if isinstance(key, bytes | bytearray) else '?'}")
        return f"{self.key_prefix}:{{{(keys or self.keyring[0]).tag(bytes(key))}}}"

    def head_key(self, key: bytes, keys: Keys | None = None) -> str:
        """The Redis key of a chunk's head record under ``keys`` (default: the current
        secret's), for operators and tests."""
        return self._tag(key, keys) + ":h"

    def piece_keys(self, key: bytes, count: int, first: int = 0, keys: Keys | None = None) -> list[str]:
        """The Redis keys of a chunk's pieces ``first`` .. ``count - 1``."""
        return _pieces(self._tag(key, keys), count, first)

    # -- bookkeeping -------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        now = self.clock.monotonic()
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
            self._writes_paused_until = self.clock.monotonic() + self.oom_pause_s
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
        """Store a chunk's stored bytes and metadata (replacing any chunk of that key), under
        the current secret. True when the server committed it; False (counted) when it did
        not: breaker open, OOM, timeout or any other failure."""
        keys = self.keyring[0]
        tag = self._tag(key)
        head_key = tag + ":h"
        data = memoryview(stored).cast("B")
        n = len(data)
        if meta.codec not in CODEC_IDS:
            raise StoreError(f"unknown codec {meta.codec!r}; choose one of {', '.join(CODEC_IDS)}")
        if n >= MAX_STORED or -(-n // self.piece_bytes) >= 1 << 32 or not 0 <= meta.raw_len < MAX_STORED \
                or (meta.codec == "raw" and n != meta.raw_len):
            raise StoreError(f"a chunk of {n} stored / {meta.raw_len} raw bytes ({meta.codec}) cannot be put to the "
                             "remote tier")
        if not (0 <= meta.tokens < 1 << 32 and -(1 << 15) <= meta.level < 1 << 15):
            raise StoreError("remote chunk metadata out of range (tokens, level)")
        if self.clock.monotonic() < self._writes_paused_until:
            self._count(short_circuited=1, put_failures=1)
            return False
        count = -(-n // self.piece_bytes)
        nonce = new_nonce()
        parts: list[Buffer] = [data[i * self.piece_bytes:(i + 1) * self.piece_bytes] for i in range(count)]
        if self.mode == MODE_SEALED:
            cipher = keys.pieces(head_key, key, nonce, count)
            parts = [cipher.seal(i, p) for i, p in enumerate(parts)]
        if self.mode == MODE_PLAIN:
            csum = xxhash.xxh3_64_intdigest(data) if meta.checksum is None else meta.checksum
            check = csum.to_bytes(8, "big") + bytes(24)
        else:
            mac = keys.payload_mac(head_key, key, nonce)
            for p in parts:  # the pieces; encrypted, their GCM tags (which authenticate them)
                mac.update(memoryview(p)[-AEAD_TAG_BYTES:] if self.mode == MODE_SEALED else p)
            check = mac.digest()
        head = keys.seal_head(self.mode, head_key, key, nonce,
                              pack_meta(meta, n, self.piece_bytes, self.clock.time(), self.writer, check))
        pieces = _pieces(tag, count)
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))

        def write(client: Any) -> Any:
            pipe = client.pipeline(transaction=True)
            pipe.get(head_key)  # the head this put replaces (an error reply if a foreign type is there)
            for pk, part in zip(pieces, parts, strict=True):
                pipe.set(pk, part, px=px)
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
            self._forget_pieces(key, keys, old, count)
        return True

    def _open(self, key: bytes, keys: Keys, name: str, raw: bytes) -> Head:
        """A head read from ``name``, verified and parsed (``Foreign``, ``Forged``, ``Torn``
        or ``Nonsense`` if it is not a good head of this chunk)."""
        mode, nonce, meta = keys.open_head(name, bytes(key), raw)
        return unpack_meta(meta, mode, nonce)

    def _forget_pieces(self, key: bytes, keys: Keys, old_head: bytes, count: int) -> None:
        """Delete the pieces of the chunk a put replaced that the new one does not overwrite
        (the old one had more of them; best effort: a head that does not verify names none)."""
        tag = self._tag(key, keys)
        try:
            old = self._open(key, keys, tag + ":h", old_head)
        except (Foreign, Forged, Torn, Nonsense):
            return
        if old.piece_count > count:
            stale = _pieces(tag, old.piece_count, count)
            self._call("delete", False, lambda c: _delete_each(c, stale))

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove chunks (head and pieces, under every secret of the keyring); how many were
        there. Failures are counted (0)."""
        chunks = [bytes(k) for k in keys]
        named = [(k, ring, self._tag(k, ring)) for ring in self.keyring for k in chunks]
        if not chunks:
            return 0

        def remove(client: Any) -> int:
            pipe = client.pipeline(transaction=False)
            for _k, _ring, tag in named:
                # the head we remove names the pieces we must remove, whatever a writer does next
                pipe.getdel(tag + ":h")
            found = pipe.execute(raise_on_error=False)
            pipe = client.pipeline(transaction=False)
            there: set[bytes] = set()
            for (k, ring, tag), raw in zip(named, found, strict=True):
                if not isinstance(raw, bytes):
                    continue
                there.add(k)
                try:
                    old = self._open(k, ring, tag + ":h", raw)
                except (Foreign, Forged, Torn, Nonsense):
                    continue
                for pk in _pieces(tag, old.piece_count):
                    pipe.delete(pk)  # one key per DEL: a cluster pipeline refuses multi-key commands
            if len(pipe):
                pipe.execute(raise_on_error=False)
            return len(there)

        ok, n = self._call("delete", False, remove)
        n = n if ok else 0
        self._count(deleted=n)
        return int(n)

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

    def get_into(self, key: bytes, out: Buffer | Callable[[RemoteMeta], Buffer], *, max_stored: int | None = None,
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

    def _open_alias(self, alias: bytes, ring: Keys, name: str, raw: object) -> tuple[bytes, int, int] | None:
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
            kind, pieces = r.kind[:-5], _pieces(r.tag, r.asked)
        else:
            assert r.head is not None
            kind, pieces = ("evicted_discovered" if r.kind == "missing" else r.kind), _pieces(r.tag, r.head.piece_count)
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

    def _read_direct(self, client: Any, key: bytes, ring: Keys, out: Buffer | Callable[[RemoteMeta], Buffer],
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
            conn.send_packed_command([pack_gets([tag + ":h", *_pieces(tag, guess)])], check_health=False)
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
                conn.send_packed_command([pack_gets(_pieces(tag, count, guess))], check_health=False)
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

    def _read_pipelined(self, client: Any, key: bytes, ring: Keys, out: Buffer | Callable[[RemoteMeta], Buffer],
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
                got = ranges(list(zip(_pieces(tag, len(want)), want, strict=True)))
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
_ALIAS = struct.Struct("<IIH")


def _pieces(tag: str, count: int, first: int = 0) -> list[str]:
    """The Redis names of pieces ``first`` .. ``count - 1`` of the chunk whose names share ``tag``."""
    return [f"{tag}:{i}" for i in range(first, count)]


def _keyring(prefix: str, secret_file: str | os.PathLike[str] | None, previous: str | os.PathLike[str] | None,
             encrypt: bool, trust: str | None) -> list[Keys]:
    """The keys a tier writes with, then (during a rotation) those it also reads with."""
    check_trust(prefix, secret_file, previous, encrypt, trust)
    if secret_file is None:
        return [Keys.derive(None)]
    ring = [Keys.from_file(secret_file)]
    if previous is not None:
        ring.append(Keys.from_file(previous, "remote.previous_secret_file"))
    return ring


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
