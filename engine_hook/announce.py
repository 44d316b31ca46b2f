"""KV events for lmctl's tiers: what the connector tells routers (Dynamo's KV indexer, llm-d)
about the chunks this instance holds.

The scheduler side builds them; the facade (``engine_hook.vllm``) hands them to vLLM's own
KV-events publisher through ``take_events()``, once per step, from the scheduler only, so
tensor-parallel ranks never disagree. Bookkeeping only: imports neither torch nor vllm; the
events leave here as ``Stored`` and ``Removed`` and become vLLM's ``BlockStored`` and
``BlockRemoved`` in the facade.

- ``Stored`` when a chunk is saved (announced when the save is planned: the workers write it
  within the step) or promoted to a faster tier: the engine's own block hashes for the blocks
  the chunk covers (vLLM's ``request.block_hashes``, of the engine's block size, which is what
  routers hash with), the parent block's hash, the chunk's token ids, the adapter's name, and
  the tier's medium and locality (``dram`` -> ``CPU``/``LOCAL``, ``nvme`` ->
  ``STORAGE``/``LOCAL``, ``remote`` -> ``STORAGE``/``REMOTE``). Never a cache salt: it only
  enters the block hashes, as vLLM hashes it.
- ``Removed`` when a chunk leaves this instance's tiers, whoever removed it (the daemon's
  eviction, ``lmctl evict``, a corrupt drop, a dropped save, another process on the store):
  learnt from the store's event log, which every process writes to.
- The re-announce: an engine that starts on a store that already holds chunks of its
  namespaces announces them again, chain roots first, in bounded batches per step.

What was announced of each chunk is kept in the store (``Store.announced``; the records of
store/observe/announce.py), so that a restarted engine can announce it again: block hashes depend
on the cache salt, which the store keeps only as a digest.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store import Store

log = logging.getLogger("lmctl.engine_hook")

#: tier -> (medium, locality) as vLLM's KV events name them
TIER_MEDIUM: dict[str, tuple[str, str]] = {"dram": ("CPU", "LOCAL"), "nvme": ("STORAGE", "LOCAL"),
                                           "remote": ("STORAGE", "REMOTE")}
#: chunks re-announced per step, at most (a step is never delayed by more than one page read)
REANNOUNCE_BATCH = 64
#: how long after start-up the re-announce begins: subscribers that were connected to the
#: previous run reconnect meanwhile (a ZMQ subscriber misses what is published before it is)
REANNOUNCE_DELAY_S = 3.0
#: how often the store's event log is read for removals
POLL_S = 0.5
#: how long a planned save may take to appear in the store before it counts as not stored
VERIFY_S = 60.0
#: chunks whose announced media are remembered (older ones are read back from the store)
MAP_LIMIT = 100_000
#: removal events read per poll, at most
EVENTS_PER_POLL = 1000
#: how often what was announced is written to the store: the records (for a restart), and the
#: ``announce`` events of its log (one per reason per write, so that a busy engine does not
#: push evictions out of the bounded log)
WRITE_S = 5.0
#: chunks an ``announce`` event names, at most (it counts them all)
LOG_KEYS = 64
REMOVAL_KINDS = ("evict", "corrupt", "save-dropped")
#: the log's kinds the announcer reads: removals, and copies to the remote tier (``lmctl drain``),
#: announced as held there too
LOG_KINDS = (*REMOVAL_KINDS, "remote-copy")

BlockHash = int | bytes


@dataclass(frozen=True)
class Stored:
    """A chunk's blocks are held in a tier (vLLM's ``BlockStored``)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    medium: str
    locality: str


@dataclass(frozen=True)
class Cleared:
    """Everything this instance held is gone (vLLM's ``AllBlocksCleared``): said at the first
    step after start-up (and again as the re-announce begins, if nothing was announced
    meanwhile), so that a router that kept the previous run's state forgets what left the
    store while no engine listened."""


@dataclass(frozen=True)
class Removed:
    """A chunk's blocks left a tier (vLLM's ``BlockRemoved``)."""

    block_hashes: list[BlockHash]
    medium: str
    locality: str


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Record:
    """What is announced of one chunk, as kept in the store."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None

    def encode(self) -> bytes:
        doc = {"v": 1, "h": [_hash_out(h) for h in self.block_hashes],
               "p": None if self.parent_block_hash is None else _hash_out(self.parent_block_hash),
               "t": self.token_ids, "b": self.block_size, "l": self.lora_name}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, block_size: int, chunk_size: int) -> Record | None:
        """A record read from the store, or None when it is not one this engine would have
        written (another block or chunk size, damaged, hostile)."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("v") != 1 or doc.get("b") != block_size:
                return None
            hashes = [_hash_in(h) for h in doc["h"]]
            parent = None if doc.get("p") is None else _hash_in(doc["p"])
            tokens = doc["t"]
            lora = doc.get("l")
        except (ValueError, KeyError, TypeError):
            return None
        if (not fits(len(hashes), tokens, block_size, chunk_size)
                or not all(type(x) is int and 0 <= x < 2**32 for x in tokens)
                or not (lora is None or (isinstance(lora, str) and len(lora) <= 256))):
            return None
        return cls(hashes, parent, tokens, block_size, lora)

    def stored(self, tier: str) -> Stored:
        medium, locality = TIER_MEDIUM[tier]
        return Stored(self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                      self.lora_name, medium, locality)


def fits(blocks: int, tokens: Any, block_size: int, chunk_size: int) -> bool:
    """Whether ``blocks`` hashes and ``tokens`` describe one record: a full chunk, or the
    whole blocks of a request's partial last chunk (a tail record)."""
    return (0 < blocks <= chunk_size // block_size and isinstance(tokens, list)
            and len(tokens) == blocks * block_size)


def _hash_out(h: BlockHash) -> int | str:
    return h if isinstance(h, int) else bytes(h).hex()


def _hash_in(v: Any) -> BlockHash:
    if type(v) is int and 0 <= v < 2**256:
        return v
    if isinstance(v, str) and len(v) <= 128:
        return bytes.fromhex(v)
    raise TypeError("not a block hash")


class Announcer:
    """The connector's KV events (see the module's docstring), on the scheduler side.

    ``ours(ns_id)``: whether a namespace is this engine's (same model, KV format and model
    fingerprint; any adapter, any salt): its chunks are re-announced. ``block_size``: the
    engine's block size; ``chunk_size``: the store's."""

    def __init__(self, store: Store, ours: Callable[[bytes], bool], block_size: int, chunk_size: int, *,
                 reannounce: bool = True, batch: int = REANNOUNCE_BATCH, poll_s: float = POLL_S,
                 reannounce_delay_s: float = REANNOUNCE_DELAY_S,
                 verify_s: float = VERIFY_S, map_limit: int = MAP_LIMIT, write_s: float = WRITE_S,
                 instance: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.ours = ours
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.batch = max(1, batch)
        self.poll_s = poll_s
        self.verify_s = verify_s
        self.map_limit = max(1, map_limit)
        self.write_s = write_s
        self.clock = clock
        self._next_write = clock() + write_s
        self.instance = instance  # who announced, in the store's event log (e.g. the events topic, pid)
        self._events: list[Event] = []
        # chunk key -> the (medium, locality) pairs announced for it
        self._media: OrderedDict[bytes, set[tuple[str, str]]] = OrderedDict()
        # saves announced when planned, not yet seen in the store: key -> (when, tier announced)
        self._verify: OrderedDict[bytes, tuple[float, str]] = OrderedDict()
        # loaded chunks: promoted? With what to announce them by, for chunks this engine did not
        # save (another instance saved them to the shared tier, a replacement warmed them)
        self._recheck: OrderedDict[bytes, tuple[int, Record] | None] = OrderedDict()
        self._note: dict[bytes, tuple[int, bytes]] = {}  # records not written yet: key -> (position, record)
        self._log: dict[str, list[bytes]] = {}  # reason -> the first LOG_KEYS chunks
        self._logged: dict[str, int] = {}  # reason -> chunks
        self._forget: list[bytes] = []
        self._after = store.last_event_seq()  # removals from here on
        self._next_poll = 0.0
        self._cursor: bytes | None = None
        self.reannouncing = reannounce
        self._start_at = clock() + max(0.0, reannounce_delay_s)
        self._cleared = False
        self._stored_since_start = False
        self.counts = {"stored": 0, "removed": 0, "reannounced": 0}

    # -- what the scheduler tells it ----------------------------------------------------------
    def saving(self, key: bytes, position: int, hashes: Sequence[BlockHash], parent: BlockHash | None,
               tokens: Sequence[int], lora_name: str | None) -> None:
        """A chunk's save was planned this step: announce it in the tier saves go to."""
        if not fits(len(hashes), tokens, self.block_size, self.chunk_size):
            return  # the engine did not hash these blocks (nothing to announce them by)
        rec = Record(list(hashes), parent, list(tokens), self.block_size, lora_name)
        tier = self.store.config.default_tier
        self._emit(key, rec.stored(tier), "stored")
        self._note[key] = (position, rec.encode())
        if key in self._forget:  # removed earlier in this write interval, and saved again
            self._forget.remove(key)
        self._verify[key] = (self.clock(), tier)
        self._verify.move_to_end(key)
        while len(self._verify) > self.map_limit:
            self._verify.popitem(last=False)

    def loaded(self, keys: Sequence[bytes], records: Sequence[tuple[int, Record] | None] | None = None) -> None:
        """Chunks were loaded (a hit promotes): check their tier at the next step. ``records``
        (chain position, what to announce), one per key where the scheduler could build it:
        a chunk the store holds no record of (saved by another instance into the shared tier,
        warmed by ``lmctl warm``, saved while events were off) is announced by it, where it
        is, and recorded for the re-announce after a restart."""
        for i, k in enumerate(keys):
            offered = records[i] if records is not None and i < len(records) else None
            if offered is not None and not fits(len(offered[1].block_hashes), offered[1].token_ids,
                                                self.block_size, self.chunk_size):
                offered = None
            self._recheck[k] = offered or self._recheck.get(k)
        while len(self._recheck) > self.map_limit:
            self._recheck.popitem(last=False)

    def pending(self) -> bool:
        """Whether a step would publish something without a request: the re-announce is not
        done (or waits for its start, ``reannounce_delay_s`` after start-up: the engine makes
        empty steps meanwhile), or the store's event log has news since the last look (due
        every ``poll_s``)."""
        if self.reannouncing:
            return True
        if self.clock() < self._next_poll:
            return False
        try:
            return self.store.last_event_seq() > self._after
        except Exception:
            return False

    # -- what vLLM takes ------------------------------------------------------------------------
    def take(self) -> list[Event]:
        """This step's events; then what they say is written to the store (one transaction).
        A cache problem costs events, never an engine error."""
        try:
            first = not self._cleared
            if first:
                # the engine's memory is empty at start: so is what it announced; before this
                # step's saves (the scheduler told them before vLLM takes the events)
                self._cleared = True
                self._events.insert(0, Cleared())
            if self.reannouncing and self.clock() >= self._start_at:
                if not first and self._cursor is None and not self._stored_since_start:
                    # said again for subscribers that were not back at the first step
                    self._events.insert(0, Cleared())
                self._reannounce()
            self._check_tiers()
            now = self.clock()
            if now >= self._next_poll:
                self._next_poll = now + self.poll_s
                self._poll_removals()
        except Exception as exc:
            log.warning("lmctl: KV events: %s", exc)
        out, self._events = self._events, []
        if self.clock() >= self._next_write or len(self._note) + len(self._forget) >= 4096:
            self.flush()
        return out

    def flush(self) -> None:
        """Write what was announced since the last write to the store: the records, and one
        ``announce`` event per reason (also at the engine's shutdown)."""
        self._next_write = self.clock() + self.write_s
        if self._note or self._forget or self._log:
            note = [(k, pos, rec) for k, (pos, rec) in self._note.items()]
            forget, logged, counts = self._forget, self._log, self._logged
            self._note, self._forget, self._log, self._logged = {}, [], {}, {}
            try:
                self.store.announced(note, forget, logged, detail=self.instance, counts=counts)
            except Exception as exc:
                log.warning("lmctl: KV events: could not record what was announced: %s", exc)

    def _emit(self, key: bytes, ev: Event, reason: str) -> None:
        self._events.append(ev)
        self.counts[reason] += 1
        named = self._log.setdefault(reason, [])
        if len(named) < LOG_KEYS:
            named.append(key)
        self._logged[reason] = self._logged.get(reason, 0) + 1
        media = self._media.pop(key, set())
        if isinstance(ev, Stored):
            self._stored_since_start = True
            media.add((ev.medium, ev.locality))
            self._media[key] = media
            while len(self._media) > self.map_limit:
                self._media.popitem(last=False)

    def _reannounce(self) -> None:
        page = self.store.announcements(self._cursor, self.batch)
        if len(page) < self.batch:
            self.reannouncing = False
        if not page:
            return
        self._cursor = page[-1][0]
        mine = [(pos, key, raw) for _row, pos, key, raw in page if self.ours(key[:16])]
        if not mine:
            return
        tiers = self.store.locate([k for _p, k, _r in mine], remote=False)
        gone = []
        for (_pos, key, raw), tier in zip(mine, tiers, strict=True):
            rec = Record.decode(raw, self.block_size, self.chunk_size)
            if rec is None:
                continue
            if tier is None:
                if not self.store.has_remote:
                    gone.append(key)  # left the store while no engine listened
                continue
            self._emit(key, rec.stored(tier), "reannounced")
        self._forget.extend(gone)

    def _check_tiers(self) -> None:
        """Saves announced when planned: seen in the store (in another tier than announced:
        announced there too), or, after ``verify_s``, counted as not stored. Loaded chunks:
        promoted to a faster tier: announced there."""
        now = self.clock()
        keys = list(self._verify)[:256] + [k for k in list(self._recheck)[:256] if k not in self._verify]
        offered = {k: o for k in keys if (o := self._recheck.pop(k, None)) is not None}
        if not keys:
            return
        tiers = self.store.locate(keys, remote=False)
        moved: list[tuple[bytes, str]] = []
        lost: list[bytes] = []
        for key, tier in zip(keys, tiers, strict=True):
            v = self._verify.get(key)
            if tier is None:
                if v is not None and now - v[0] >= self.verify_s:
                    del self._verify[key]
                    if not self.store.has_remote:
                        lost.append(key)
                continue
            self._verify.pop(key, None)
            if TIER_MEDIUM[tier] not in self._media.get(key, set()):
                moved.append((key, tier))
        if moved or lost:
            recs = self._records([k for k, _t in moved] + lost)
            for key, tier in moved:
                rec = self._record(recs.get(key))
                if rec is None and key in offered:  # never announced by any engine: by the scheduler's
                    pos, rec = offered[key]
                    self._note[key] = (pos, rec.encode())
                if rec is not None:
                    self._emit(key, rec.stored(tier), "stored")
            self._removed(lost, recs)

    def _poll_removals(self) -> None:
        top = self.store.last_event_seq()  # first: an event logged meanwhile is read next time
        evs = self.store.events(after=self._after, kinds=LOG_KINDS, limit=EVENTS_PER_POLL)
        if not evs:
            self._after = max(self._after, top)
            return
        keys: list[bytes] = []
        copied: list[bytes] = []
        for ev in evs:
            seq = int(ev.get("seq", 0))
            self._after = max(self._after, seq)
            if ev.get("kind") == "evict" and ev.get("reason") == "moved-remote":
                continue  # still held, in the remote tier: the tier check announces it there
            named = self.store.event_keys(seq) if int(ev.get("chunks", 0)) != 1 else []
            if not named and isinstance(ev.get("key"), str):
                try:
                    named = [bytes.fromhex(ev["key"])]
                except ValueError:
                    named = []
            (copied if ev.get("kind") == "remote-copy" else keys).extend(named)
        if copied:
            self._copied_remote(list(dict.fromkeys(copied)))
        if not keys:
            return
        for k in keys:
            self._verify.pop(k, None)
        keys = list(dict.fromkeys(keys))
        recs = self._records(keys)
        still = self.store.locate(list(recs), remote=False)  # saved again since: not gone
        self._removed([k for k, t in zip(recs, still, strict=True) if t is None], recs)

    def _copied_remote(self, keys: list[bytes]) -> None:
        """Chunks copied to the shared remote tier (``lmctl drain``, before a scale-down): held
        there too, so routers may send their prefixes to any instance of the fleet."""
        recs = self._records(keys)
        remote = TIER_MEDIUM["remote"]
        for key in keys:
            rec = self._record(recs.get(key))
            if rec is not None and remote not in self._media.get(key, set()):
                self._emit(key, rec.stored("remote"), "stored")

    def _removed(self, keys: Sequence[bytes], recs: dict[bytes, tuple[int, bytes]]) -> None:
        for key in keys:
            rec = self._record(recs.get(key))
            if rec is None:
                continue
            media = self._media.get(key) or {TIER_MEDIUM[self.store.config.default_tier]}
            for medium, locality in sorted(media):
                self._emit(key, Removed(rec.block_hashes, medium, locality), "removed")
            self._media.pop(key, None)
            self._note.pop(key, None)
            self._forget.append(key)

    def _records(self, keys: Sequence[bytes]) -> dict[bytes, tuple[int, bytes]]:
        """What was announced of ``keys``: the store's records, and those not written yet."""
        recs = self.store.announcement_of([k for k in keys if k not in self._note])
        recs.update((k, self._note[k]) for k in keys if k in self._note)
        return recs

    def _record(self, found: tuple[int, bytes] | None) -> Record | None:
        return None if found is None else Record.decode(found[1], self.block_size, self.chunk_size)

    def stats(self) -> dict[str, int]:
        return dict(self.counts)
