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

Trust: with ``secret_file`` (the deployment secret, store/format/remote_auth.py) every value carries
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
socket by ``store/tiers/resp.py``, each piece received straight into the caller's buffer and its MAC
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
import threading
from collections.abc import Callable, Iterable
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

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import StoreError
from ..format.codec import CODEC_IDS
from ..format.remote_auth import (
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
from ..format.remote_value import (
    MAX_PIECE_BYTES,
    MAX_STORED,
    Head,
    MiB,
    Nonsense,
    RemoteMeta,
    pack_meta,
    unpack_meta,
)
from .breaker import CircuitBreaker
from .remote_read import LANE_CPUS, RemoteReads, piece_names

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")

#: default piece size: Redis moves values of about 4 MB at full speed, larger ones slower
PIECE_BYTES = 4 * MiB

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
class RemoteTier(RemoteReads):
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
        return piece_names(self._tag(key, keys), count, first)

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
        pieces = piece_names(tag, count)
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
            self._forgetpiece_names(key, keys, old, count)
        return True

    def _open(self, key: bytes, keys: Keys, name: str, raw: bytes) -> Head:
        """A head read from ``name``, verified and parsed (``Foreign``, ``Forged``, ``Torn``
        or ``Nonsense`` if it is not a good head of this chunk)."""
        mode, nonce, meta = keys.open_head(name, bytes(key), raw)
        return unpack_meta(meta, mode, nonce)

    def _forgetpiece_names(self, key: bytes, keys: Keys, old_head: bytes, count: int) -> None:
        """Delete the pieces of the chunk a put replaced that the new one does not overwrite
        (the old one had more of them; best effort: a head that does not verify names none)."""
        tag = self._tag(key, keys)
        try:
            old = self._open(key, keys, tag + ":h", old_head)
        except (Foreign, Forged, Torn, Nonsense):
            return
        if old.piece_count > count:
            stale = piece_names(tag, old.piece_count, count)
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
                for pk in piece_names(tag, old.piece_count):
                    pipe.delete(pk)  # one key per DEL: a cluster pipeline refuses multi-key commands
            if len(pipe):
                pipe.execute(raise_on_error=False)
            return len(there)

        ok, n = self._call("delete", False, remove)
        n = n if ok else 0
        self._count(deleted=n)
        return int(n)

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
