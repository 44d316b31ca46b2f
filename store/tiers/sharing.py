"""Sharing: the remote tier as a store sees it.

The local tiers come first; the remote tier (``store/tiers/remote.py``) is asked only about what
they lack: lookups extend the local prefix with one pipelined round trip, a read that misses
locally is read remotely (verified there and decoded here) and, with ``promote``, stored in
the local default tier. With ``write = "always"`` every chunk stored locally is put remotely
too, on the writer's thread. Nothing the server does raises: a slow, full or dead server
costs misses and counted errors (see ``RemoteTier``).
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..clock import SYSTEM_CLOCK, Clock
from ..config import RemoteConfig
from ..errors import StoreError
from ..format.codec import CODEC_NAMES, Codec, codec_id
from ..format.keys import DTYPE_SIZES, NS_ID_BYTES, Namespace, boundary_keys, chain_hash
from ..types import ChunkInfo, LookupResult, Origin, PartialHit, PutItem, RewriteResult

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..index.metrics import Meter
    from .remote import RemoteMeta, RemoteTier

log = logging.getLogger("lmctl.store")

#: what the write path hands over of a chunk it stored: key, stored bytes, raw length, codec
#: id, codec level, layout, tokens, checksum of the stored bytes
Stored = tuple[bytes, "Buffer", int, int, int, dict[str, Any], int, int]


#: records found remotely through an alias or as a tail, whose aliases (the partial keys the
#: lookup confirmed) are recorded locally when the record is promoted: at most this many
LEARNED_MAX = 1024

#: ``move --to remote`` drops the chunks it has put from the local tiers this many at a time
MOVE_BATCH = 64

#: a compressed chunk's stored bytes are at most its raw bytes plus this share and this much
#: (zstd's worst case on incompressible data is far below: a frame header and a block header
#: per 128 KiB)
STORED_SLACK, STORED_SLACK_BYTES = 1 / 128, 64 << 10


def stored_bound(raw_limit: int) -> int:
    """The most stored bytes a chunk of at most ``raw_limit`` raw bytes can have."""
    return raw_limit + int(raw_limit * STORED_SLACK) + STORED_SLACK_BYTES


def writer_id(store_path: str) -> int:
    """This store's 32-bit writer id, which its remote heads name: a digest of the host name
    and the store's folder (so a chunk's provenance says which host and store wrote it)."""
    h = hashlib.blake2s(f"{socket.gethostname()}\0{store_path}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") or 1


#: RemoteStats fields -> (metric cell, labels) that ``Sharing.meter`` adds up
REMOTE_CELLS: dict[str, tuple[str, dict[str, str]]] = {
    "calls": ("remote_calls_total", {}), "timeouts": ("remote_errors_total", {"kind": "timeout"}),
    "oom": ("remote_errors_total", {"kind": "oom"}), "short_circuited": ("remote_short_circuited_total", {}),
    "puts": ("remote_puts_total", {"result": "stored"}),
    "put_failures": ("remote_puts_total", {"result": "failed"}),
    "hits": ("remote_reads_total", {"result": "hit"}), "misses": ("remote_reads_total", {"result": "miss"}),
    "lookups": ("remote_lookups_total", {}), "torn": ("remote_bad_values_total", {"kind": "torn"}),
    "foreign": ("remote_bad_values_total", {"kind": "foreign"}),
    "forged": ("remote_bad_values_total", {"kind": "forged"}),
    "evicted_discovered": ("remote_bad_values_total", {"kind": "evicted"}),
    "too_small": ("remote_bad_values_total", {"kind": "too_small"}),
    "bytes_out": ("remote_bytes_total", {"direction": "out"}),
    "bytes_in": ("remote_bytes_total", {"direction": "in"}),
}


class Sharing:
    """The remote tier of one store."""

    def __init__(self, cfg: RemoteConfig, codec: Callable[[], Codec],
                 writer: int = 0, clock: Clock = SYSTEM_CLOCK) -> None:
        from .remote import RemoteTier, redacted

        self.cfg = cfg
        self.url = redacted(cfg.url)
        self._codec = codec
        self._lock = threading.Lock()
        self.promoted = 0
        self._metered: dict[str, Any] = {}  # the tier's counters at the last ``meter``
        #: record key -> the aliases a remote lookup confirmed for it, until it is promoted
        self._learned: OrderedDict[bytes, list[tuple[bytes, int]]] = OrderedDict()
        self.tier: RemoteTier = RemoteTier(cfg.url, key_prefix=cfg.key_prefix, secret_file=cfg.secret_file,
                                           previous_secret_file=cfg.previous_secret_file, encrypt=cfg.encrypt,
                                           trust=cfg.trust, writer=writer, piece_bytes=cfg.piece_bytes,
                                           lookup_timeout_s=cfg.lookup_timeout_s, io_timeout_s=cfg.io_timeout_s,
                                           password_file=cfg.password_file, clock=clock)

    # -- lookups ---------------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes], tiers: list[str | None]) -> list[str | None]:
        """``tiers`` (the local answer) with ``remote`` where only the remote tier holds a key."""
        return self.locate_checked(keys, tiers)[0]

    def locate_checked(self, keys: Sequence[bytes], tiers: list[str | None]) -> tuple[list[str | None], int]:
        """``locate``, and how many keys the remote tier was asked about and did not answer
        for (they stay None: not known to be anywhere)."""
        missing = [i for i, t in enumerate(tiers) if t is None]
        if not missing:
            return tiers, 0
        answer = self.tier.contains_many_checked([keys[i] for i in missing])
        if answer is None:
            return tiers, len(missing)
        found = answer
        out = list(tiers)
        for i, there in zip(missing, found, strict=True):
            if there:
                out[i] = "remote"
        return out, 0

    def lookup(self, ns: Namespace, tokens: Sequence[int], found: LookupResult, block: int | None) -> LookupResult:
        """``found`` (the local answer) extended by the remote tier: the full chunks the local
        tiers lack and, with ``block``, the partial keys of the first chunk not stored whole
        (a tail record under its own key, or a full record's leading blocks through an alias
        value), in one pipelined round trip; a second one only where the remote tier's full
        chunks moved the first missing chunk further and short of the last (the partial
        keys after the last full chunk are asked with the first ones). The longest partial hit wins; one the
        local tiers have already is not asked for again. A server that does not answer
        leaves ``found`` as it is."""
        keys = found.keys
        missing = [i for i, t in enumerate(found.tiers) if t is None]
        c0 = found.hit_chunks
        have = found.partial.tokens if found.partial is not None and found.partial.chunk == c0 else 0
        cands = self._candidates(ns, tokens, keys, c0, block, have)
        # where the remote tier holds every full chunk, the partial one after them: asked too
        last = self._candidates(ns, tokens, keys, len(keys), block, 0) if missing and c0 < len(keys) else []
        if not missing and not cands:
            return found
        answer = self.tier.lookup_partial([keys[i] for i in missing], [k for _n, k in cands + last])
        if answer is None:
            return found
        full, tails, aliases = answer
        tiers = list(found.tiers)
        for i, there in zip(missing, full, strict=True):
            if there:
                tiers[i] = "remote"
        found.set_tiers(tiers)
        c = found.hit_chunks
        if c == c0:
            tails, aliases = tails[: len(cands)], aliases[: len(cands)]
        elif c == len(keys):  # asked already
            cands, tails, aliases = last, tails[len(cands):], aliases[len(cands):]
        else:  # the first chunk not stored whole is further on: ask about its partial keys
            cands = self._candidates(ns, tokens, keys, c, block, 0)
            again = self.tier.lookup_partial([], [k for _n, k in cands]) if cands else None
            if again is None:
                return found
            _, tails, aliases = again
        hit = self._pick(c, cands, tails, aliases, ns.kv_format.chunk_size)
        if hit is not None:
            found.partial = hit
        return found

    @staticmethod
    def _candidates(ns: Namespace, tokens: Sequence[int], keys: list[bytes], c: int, block: int | None,
                    have: int) -> list[tuple[int, bytes]]:
        """The partial keys of chunk ``c`` (at ``block`` boundaries, short of the whole chunk)
        that would give more than ``have`` tokens of it."""
        cs = ns.kv_format.chunk_size
        if block is None or not 0 < block < cs or cs % block or c > len(keys):
            return []
        cands = boundary_keys(ns, chain_hash(ns, keys, c), tokens[c * cs : (c + 1) * cs], block)
        return [(n, k) for n, k in cands if have < n < cs]

    def _pick(self, c: int, cands: list[tuple[int, bytes]], tails: list[bool],
              aliases: Sequence[Callable[[], tuple[bytes, int, int] | None] | None], cs: int) -> PartialHit | None:
        """The longest partial hit the remote tier's answer gives; whatever an alias value
        claims is checked (its record's namespace is the alias's, its tokens are the
        boundary's, its record holds more and at most a chunk): else a miss, counted."""
        for i in reversed(range(len(cands))):
            n, k = cands[i]
            hit = None
            if tails[i]:
                hit = PartialHit(c, k, n, n, "remote")
            elif (opener := aliases[i]) is not None and (got := opener()) is not None:
                target, tok, rec = got
                if target[:NS_ID_BYTES] != k[:NS_ID_BYTES]:
                    self.tier.count_forged(k, "it names a record of another namespace")
                elif tok != n or not n < rec <= cs:
                    self.tier.count_forged(k, f"it claims {tok} of {rec} tokens at a boundary of {n}")
                else:
                    hit = PartialHit(c, bytes(target), n, rec, "remote", alias=k)
            if hit is not None:
                self._learn(hit.key, [(a, m) for m, a in cands[:i + 1] if m < hit.record_tokens])
                return hit
        return None

    def _learn(self, key: bytes, aliases: list[tuple[bytes, int]]) -> None:
        with self._lock:
            self._learned[key] = aliases
            self._learned.move_to_end(key)
            while len(self._learned) > LEARNED_MAX:
                self._learned.popitem(last=False)

    # -- reads -----------------------------------------------------------------------------
    def fetch_into(self, key: bytes, out: memoryview | None, *, expect: int | None = None,
                   limit: int) -> tuple[ChunkInfo, Buffer] | None:
        """Read ``key`` from the remote tier into ``out`` (None: a new buffer of its size),
        verified and decoded (``to_promote`` says what to store locally). ``expect``: the exact
        raw length the caller wants (None: any); ``limit``: the most raw bytes it may allocate
        or take. A chunk whose head claims other lengths is a miss (counted ``foreign``) before
        anything is allocated. A raw chunk is received straight into ``out``. Returns its
        metadata and the buffer."""
        if out is not None:
            limit = min(limit, len(out))
        made: list[Buffer] = []

        def into(m: RemoteMeta) -> Buffer:
            if m.codec != "raw":
                made.append(bytearray(m.stored_len or 0))
            else:  # stored bytes are raw bytes: straight into the caller's buffer
                made.append(out if out is not None else bytearray(m.raw_len))
            return made[0]

        m = self.tier.get_into(key, into, max_stored=stored_bound(limit), raw_len=expect, max_raw=limit)
        if m is None:
            return None
        data: Buffer = made[0]
        if m.codec != "raw":
            data = out if out is not None else bytearray(m.raw_len)
            try:
                itemsize = DTYPE_SIZES.get(m.layout.get("dtype", "uint8"), 1)
                self._codec().decode_into(codec_id(m.codec), made[0], memoryview(data).cast("B"), m.raw_len, itemsize)
            except StoreError as exc:  # verified bytes that do not decode: a trusted writer's bug, a miss
                self.tier.count_foreign(key, f"it does not decode: {exc}")
                return None
        origin = Origin("remote", m.writer, self.tier.clock.time())
        return ChunkInfo(key, "remote", m.codec, m.stored_len or 0, m.raw_len, m.stored_len or 0, m.tokens, 0,
                         m.written or 0.0, m.written or 0.0, 0, m.layout, -1, -1, m.level, origin), data

    def to_promote(self, info: ChunkInfo, data: Buffer) -> PutItem | None:
        """What to store locally of a chunk ``fetch_into`` read (None: promotion is off). The
        store writes it (its write path: this tier never calls back into it), then
        ``promoted`` counts it."""
        with self._lock:
            aliases = self._learned.pop(bytes(info.key), None)
        if not self.cfg.promote:
            return None
        return PutItem(info.key, memoryview(data)[: info.raw_bytes], info.layout, info.tokens, "raw",
                       origin=info.origin, aliases=aliases or None)

    def count_promoted(self) -> None:
        with self._lock:
            self.promoted += 1

    # -- writes ----------------------------------------------------------------------------
    def push(self, chunks: Sequence[Stored],
             aliases: Mapping[bytes, Sequence[tuple[bytes, int]] | None] | None = None) -> int:
        """Put chunks just stored locally to the remote tier too; how many it took.
        ``aliases``: the aliases of some of them (``PutItem.aliases``), put as alias values
        (one round trip for the batch) once their record is there."""
        from .remote import RemoteMeta

        n = 0
        values: list[tuple[bytes, bytes, int, int]] = []
        for key, stored, raw_len, cid, level, layout, tokens, checksum in chunks:
            try:
                meta = RemoteMeta(raw_len=raw_len, codec=CODEC_NAMES[cid], level=level, layout=layout, tokens=tokens,
                                  checksum=checksum)
                if self.tier.put(key, stored, meta):
                    n += 1
                    mine = (aliases or {}).get(key) or ()
                    values.extend((a, key, t, tokens) for a, t in mine if 0 < t < tokens and len(a) == len(key))
            except StoreError as exc:  # a chunk the tier refuses (too large, odd metadata): not shared
                log.warning("remote tier refused chunk %s: %s", key[16:24].hex(), exc)
        if values:
            try:
                self.tier.put_aliases(values)
            except StoreError as exc:
                log.warning("remote tier refused aliases: %s", exc)
        return n

    def push_entries(self, victims: Sequence[tuple[bytes, Any]],
                     stored_of: Callable[[bytes, Any], Buffer | None]) -> int:
        """Put chunks that eviction is about to drop locally (``write = "evict"``): their
        stored bytes as they are, verified on the way out. How many the server took."""
        chunks: list[Stored] = []
        for key, e in victims:
            data = stored_of(key, e)
            if data is not None:
                chunks.append((key, data, e.raw_len, e.codec, e.level, e.layout, e.tokens, e.checksum))
        return self.push(chunks)

    def move_here(self, keys: Sequence[bytes], read: Callable[[bytes], Any], evict: Callable[[list[bytes]], Any],
                  pinned: Callable[[bytes], int], progress: Callable[[int, int], None] | None,
                  dry_run: bool) -> RewriteResult:
        """``move --to remote``: put each chunk remotely, then drop it locally (a pinned chunk
        is skipped: the server may evict what it holds)."""
        from .remote import RemoteMeta

        out = RewriteResult()
        stored: list[bytes] = []  # put remotely, to drop locally (a batch per transaction and event)
        for n, key in enumerate(keys):
            if progress is not None:
                progress(n, len(keys))
            if len(stored) >= MOVE_BATCH:
                evict(stored)
                stored = []
            if pinned(key):
                out.skipped += 1
                continue
            got = read(key)
            if got is None:
                out.missing += 1
                continue
            chunk, info = got
            if dry_run:
                out.chunks += 1
                out.bytes_before += info.stored_bytes
                continue
            data = memoryview(chunk.data).cast("B")
            meta = RemoteMeta(raw_len=info.raw_bytes, codec="raw", layout=chunk.layout, tokens=chunk.tokens)
            if self.tier.put(key, data, meta):
                stored.append(key)
                out.chunks += 1
                out.bytes_before += info.stored_bytes
                out.bytes_after += len(data)
            else:
                out.skipped += 1
        if stored:
            evict(stored)
        if progress is not None:
            progress(len(keys), len(keys))
        return out

    def stats(self) -> dict[str, Any]:
        """Settings and counters for ``status``: ``trust`` is ``secret`` (values carry a MAC),
        ``secret+encrypt`` or ``all-writers`` (none); ``rotating`` when a previous secret is
        read too; ``writer`` is the id this store's heads name."""
        trust = self.cfg.trust or ("secret+encrypt" if self.cfg.encrypt else "secret")
        return {"url": self.url, "key_prefix": self.cfg.key_prefix, "write": self.cfg.write, "trust": trust,
                "rotating": self.cfg.previous_secret_file is not None, "writer": f"{self.tier.writer:08x}",
                "promoted": self.promoted, **self.tier.stats().to_dict()}

    def meter(self, meter: Meter) -> None:
        """Add what the remote tier's counters did since the last call to the metrics."""
        now = self.tier.stats().to_dict()
        before, self._metered = self._metered, now
        for field, (cell, labels) in REMOTE_CELLS.items():
            meter.inc(cell, now[field] - before.get(field, 0), **labels)
        other = (now["errors"] - now["timeouts"] - now["oom"]) - (
            before.get("errors", 0) - before.get("timeouts", 0) - before.get("oom", 0))
        meter.inc("remote_errors_total", other, kind="other")

    def close(self) -> None:
        self.tier.close()
