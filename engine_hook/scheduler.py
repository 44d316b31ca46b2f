"""The connector's scheduler side: how many leading tokens of a request the store supplies,
and, each step, which chunks the workers load and which they save.

Bookkeeping only, no KV: imports neither torch nor vllm. It decides from token ids, the
model, the KV format, the LoRA adapter's identity and the cache salt; what it decides
crosses to the workers as ``LoadOp`` and ``SaveOp``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from store import (
    AdapterIdentity,
    KVFormat,
    LookupResult,
    Namespace,
    PartialHit,
    open_shared,
    record_key,
    release_shared,
)

from .announce import Announcer, BlockHash, Record
from .identity import AdapterCache
from .ops import LoadOp, SaveOp
from .policy import LoadPolicy
from .stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from .context import ConnectorContext

log = logging.getLogger("lmctl.engine_hook")

#: how long the scheduler waits for the remote tier's answer before telling vLLM to ask again
REMOTE_ASK_WAIT_S = 0.005


class RecentKeys:
    """Keys claimed for saving in the last ``ttl`` seconds (at most ``limit`` of them).

    The scheduler uses it so that requests in flight with the same prefix save each chunk
    once. A claim expires, so a chunk whose save was dropped (a full writer queue) is
    saved again by a later request instead of being skipped for good.
    """

    def __init__(self, ttl: float = 30.0, limit: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.limit = limit
        self.clock = clock
        self._at: OrderedDict[bytes, float] = OrderedDict()

    def claim(self, key: bytes) -> bool:
        """True if the caller should save ``key`` (nobody claimed it recently)."""
        now = self.clock()
        while self._at and (len(self._at) >= self.limit or now - next(iter(self._at.values())) >= self.ttl):
            self._at.popitem(last=False)
        if key in self._at:
            return False
        self._at[key] = now
        return True


@dataclass
class _Req:
    ns: Namespace
    keys: list[bytes]              # keys of the prompt's full chunks
    stored: list[bool]             # whether the store held each chunk at lookup time
    prompt: list[int] = field(default_factory=list)
    prefixes: list[bytes] | None = None  # prefix ids of the chunks, made at the first save
    load_start: int = 0            # tokens [load_start, load_end) come from the store
    load_end: int = 0
    load_pending: bool = False     # blocks allocated, the load not sent to the workers yet
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0             # first chunk index not yet considered for saving
    block_hashes: Any = None       # vLLM's hashes of the request's blocks (KV events name blocks by them)
    lora_name: str | None = None
    partial: PartialHit | None = None  # the leading blocks of the chunk after the stored ones
    tail_done: bool = False        # the prompt's partial last chunk was considered for saving


class LMCtlConnectorScheduler:
    """The scheduler side of ``LMCtlConnector``, on its own reference to the process's store.

    It applies the connector's store settings (codec, capacity) and records the base
    model's namespace when it starts."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.store = open_shared(ctx.settings.store_path)
        self._closed = False
        ctx.settings.apply(self.store)
        self.book = ctx.namespace_book(self.store)
        self.adapters = AdapterCache()
        self._reqs: dict[str, _Req] = {}
        self._recent_saves = RecentKeys()
        self._loads_ready: list[str] = []  # requests whose blocks are allocated for an async load
        # the remote tier is asked off the scheduler's thread: vLLM asks again meanwhile
        self._remote_asks: dict[str, Future[LookupResult]] = {}
        self._remote_pool: ThreadPoolExecutor | None = None
        self.policy = LoadPolicy(ctx.settings.load_policy)
        self._last_step: tuple[float, int, int] | None = None  # when, prefill tokens, longest context
        self.lookups = 0
        self.hit_tokens = 0
        self.skipped_tokens = 0  # stored tokens the policy chose to recompute
        self.recorder = StatsRecorder()  # figures for vLLM's metrics, since the last step's report
        #: KV events for routers (``engine_hook.announce``), when vLLM publishes them
        self.announcer: Announcer | None = None
        self.convert_hash: Callable[[Any], BlockHash] = bytes

    def _namespace(self, request: Request, kv_format: KVFormat) -> Namespace:
        lora = getattr(request, "lora_request", None)
        adapter: AdapterIdentity | None = None
        path = None
        if lora is not None:
            path = str(lora.lora_path)
            adapter = self.adapters.identity(str(lora.lora_name), path)
        return self.book.get(kv_format, adapter, getattr(request, "cache_salt", None), path)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` that the store supplies (as many as the load
        policy finds worth loading), and whether they load asynchronously: always, when
        there are any. The request waits while the workers load them; other requests keep
        stepping. A failed lookup is a miss."""
        try:
            n = self._match(request, num_computed_tokens)
            if n is None:
                return None, False
            return n, n > 0
        except Exception as exc:  # a cache problem is a miss, never an engine error
            log.warning("lmctl: lookup for request %s failed, recomputing: %s", request.request_id, exc)
            self._reqs.pop(request.request_id, None)
            return 0, False

    def _match(self, request: Request, num_computed_tokens: int) -> int | None:
        prompt = list(request.prompt_token_ids or [])
        ns = self._namespace(request, self.ctx.kv_format)
        bs = self.ctx.block_size
        found = self.store.lookup(ns, prompt, remote=False, block=bs)
        # the remote tier is asked where it could add a block vLLM would load (never the last token's)
        if self.store.has_remote and self.store.remote_reachable and found.hit_tokens < (len(prompt) - 1) // bs * bs:
            answer = self._ask_remote(request.request_id, ns, prompt, found, bs)
            if answer is None:
                return None  # asked; vLLM asks again next step
            found = answer
        # the last prompt token is always computed (vLLM needs its logits)
        end = min(found.hit_tokens, (len(prompt) - 1) // bs * bs) if prompt else 0
        st = _Req(ns, found.keys, [t is not None for t in found.tiers], prompt, partial=found.partial)
        if self.announcer is not None:
            st.block_hashes = getattr(request, "block_hashes", None)
            lora = getattr(request, "lora_request", None)
            st.lora_name = None if lora is None else str(lora.lora_name)
        self._reqs[request.request_id] = st
        self.lookups += 1
        self.store.count_lookup(ns, min(found.hit_tokens, len(prompt)), len(prompt))
        if end <= num_computed_tokens:
            self.recorder.record({"lookups": 1})
            return 0
        cs = self.ctx.kv_format.chunk_size
        tiers = [t or "" for t in found.tiers[: found.hit_chunks]]
        if found.partial is not None:  # the chunk after the stored ones, in part
            tiers.append(found.partial.tier)
        d = self.policy.decide(num_computed_tokens, end, cs, self.ctx.kv_format.chunk_bytes, tiers)
        skipped = d.stored_tokens - num_computed_tokens - d.load_tokens
        self.skipped_tokens += skipped
        self.recorder.record({"lookups": 1, "policy_recomputed_tokens": skipped})
        if d.load_tokens <= 0:
            return 0
        st.load_start, st.load_end = num_computed_tokens, num_computed_tokens + d.load_tokens
        self.hit_tokens += d.load_tokens
        return d.load_tokens

    def _ask_remote(self, req_id: str, ns: Namespace, prompt: list[int], found: LookupResult,
                    bs: int) -> LookupResult | None:
        """``found`` with the remote tier's answer for what the local tiers lack (full chunks,
        and the partial keys of the first chunk not stored whole), or None while it is being
        asked (in the background, within the tier's lookup deadline)."""
        fut = self._remote_asks.get(req_id)
        if fut is None:
            if self._remote_pool is None:
                self._remote_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmctl-remote-lookup")
            fut = self._remote_asks[req_id] = self._remote_pool.submit(self.store.lookup_remote, ns, prompt,
                                                                       found, bs)
            wait([fut], timeout=REMOTE_ASK_WAIT_S)  # a near server answers within this: no extra step
        if not fut.done():
            return None
        del self._remote_asks[req_id]
        try:
            return fut.result()
        except Exception as exc:  # the remote tier never raises on purpose; a bug is a local-only answer
            log.warning("lmctl: remote lookup for request %s failed: %s", req_id, exc)
            return found

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks | None,
                                 num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks; with ``num_external_tokens`` the store's
        tokens go into them (the load is sent with the next step's metadata). vLLM calls
        this again, with 0, when an async load has finished: nothing to do then."""
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        st.load_end = st.load_start + num_external_tokens
        st.load_pending = True
        if blocks is not None:
            st.block_ids = list(blocks.get_block_ids()[0])
        self._loads_ready.append(request.request_id)

    def plan(self, scheduler_output: SchedulerOutput) -> tuple[list[LoadOp], list[SaveOp]]:
        """This step's loads (of requests that wait for them) and saves (of the blocks
        vLLM scheduled)."""
        loads: list[LoadOp] = []
        saves: list[SaveOp] = []
        so = scheduler_output
        self._observe_step(so)
        for req_id in self._loads_ready:
            st = self._reqs.get(req_id)
            if st is not None and st.load_pending:
                self._plan_load(loads, req_id, st)
        self._loads_ready.clear()
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan(loads, saves, new.req_id, st,
                       new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._plan(loads, saves, req_id, st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0))
        for req_id in so.finished_req_ids:
            self._reqs.pop(req_id, None)
        return loads, saves

    def _plan(self, loads: list[LoadOp], saves: list[SaveOp], req_id: str, st: _Req, computed_after: int) -> None:
        cs, bs = self.ctx.kv_format.chunk_size, self.ctx.block_size
        bpc = cs // bs
        if st.load_pending:  # not sent by update_state_after_alloc's path (no blocks were given)
            self._plan_load(loads, req_id, st)
        # chunks whose KV exists after this step and that the store lacked
        done = min(len(st.keys), computed_after // cs, len(st.block_ids) // bpc)
        while st.next_save < done:
            c = st.next_save
            st.next_save += 1
            key = st.keys[c]
            if st.stored[c] or not self._recent_saves.claim(key):
                continue
            prefixes = self._prefixes(st)
            saves.append(SaveOp(req_id, key, st.block_ids[c * bpc : (c + 1) * bpc],
                                prefixes[c] if c < len(prefixes) else None,
                                aliases=self._aliases(st, c)))
            if self.announcer is not None:
                self._announce(st, c, key)
        if not st.tail_done and st.next_save >= len(st.keys) and computed_after >= len(st.prompt):
            st.tail_done = True
            try:
                self._plan_tail(saves, req_id, st)
            except Exception as exc:  # a save that cannot be planned is not made, never an engine error
                log.warning("lmctl: the tail of request %s is not saved: %s", req_id, exc)

    def _aliases(self, st: _Req, c: int) -> list[tuple[bytes, int]]:
        """The partial keys at the block boundaries inside full chunk ``c``, with their token
        counts: what the index finds the record's leading blocks by. A failure costs only those."""
        try:
            return record_key(st.ns, st.keys, st.prompt, c, self.ctx.block_size)[1]
        except Exception as exc:
            log.warning("lmctl: aliases of chunk %d not made: %s", c, exc)
            return []

    def _plan_tail(self, saves: list[SaveOp], req_id: str, st: _Req) -> None:
        """Save the prompt's partial last chunk, in whole blocks, where the store lacks it:
        a short prefix (a system prompt) shorter than a chunk is then found by the next
        request that shares it, with its own question after it."""
        cs, bs = self.ctx.kv_format.chunk_size, self.ctx.block_size
        c = len(st.keys)
        n = (len(st.prompt) - c * cs) // bs * bs
        have = st.partial.tokens if st.partial is not None and st.partial.chunk == c else 0
        first = c * (cs // bs)
        if n <= have or len(st.block_ids) < first + n // bs:
            return
        key, aliases = record_key(st.ns, st.keys, st.prompt, c, bs, n)
        if not self._recent_saves.claim(key):
            return
        saves.append(SaveOp(req_id, key, st.block_ids[first : first + n // bs], None, tokens=n, aliases=aliases))
        if self.announcer is not None:
            rec = self._record(st, c, n)
            if rec is not None:
                self.announcer.saving(key, c, rec.block_hashes, rec.parent_block_hash, rec.token_ids, rec.lora_name)

    def _announce(self, st: _Req, c: int, key: bytes) -> None:
        """Announce chunk ``c``'s save to routers, by the engine's hashes of its blocks."""
        assert self.announcer is not None
        rec = self._record(st, c)
        if rec is not None:
            self.announcer.saving(key, c, rec.block_hashes, rec.parent_block_hash, rec.token_ids, rec.lora_name)

    def _record(self, st: _Req, c: int, tokens: int | None = None) -> Record | None:
        """What to announce chunk ``c`` of a request by: the engine's hashes of its blocks (of
        its first ``tokens``: a tail record's), its tokens and adapter (None where the engine
        did not hash those blocks)."""
        cs, bs = self.ctx.kv_format.chunk_size, self.ctx.block_size
        n = cs if tokens is None else tokens
        bpc = cs // bs
        hashes = st.block_hashes
        try:
            if hashes is None or len(hashes) < c * bpc + n // bs or len(st.prompt) < c * cs + n:
                return None
            ours = [self.convert_hash(h) for h in hashes[c * bpc : c * bpc + n // bs]]
            parent = self.convert_hash(hashes[c * bpc - 1]) if c else None
            return Record(ours, parent, list(st.prompt[c * cs : c * cs + n]), bs, st.lora_name)
        except Exception as exc:  # events are hints: a failure costs only the event
            log.warning("lmctl: KV event for chunk %d not built: %s", c, exc)
            return None

    def _prefixes(self, st: _Req) -> list[bytes]:
        """The prefix ids of a request's chunks (one pass over its prompt, at its first save):
        stored with each chunk, they let ``lmctl lookup --explain`` find the same tokens in
        another namespace. A failure costs only that."""
        if st.prefixes is None:
            try:
                st.prefixes = self.store.prefix_ids(st.prompt, self.ctx.kv_format.chunk_size, len(st.keys))
            except Exception as exc:
                log.warning("lmctl: prefix ids could not be computed: %s", exc)
                st.prefixes = []
        return st.prefixes

    def _plan_load(self, loads: list[LoadOp], req_id: str, st: _Req) -> None:
        cs, bs = self.ctx.kv_format.chunk_size, self.ctx.block_size
        bpc = cs // bs
        st.load_pending = False
        first, last = st.load_start // cs, (st.load_end - 1) // cs
        keys, blocks, sizes = [], [], []
        part = st.partial
        for c in range(first, last + 1):
            row: list[int | None] = []
            if part is not None and c == part.chunk:  # a tail record, or a full one's leading blocks
                key, n = part.key, part.record_tokens
            else:
                key, n = st.keys[c], cs
            for j in range(n // bs):
                tok = c * cs + j * bs
                bi = c * bpc + j  # the request's block index of that token
                inside = st.load_start <= tok and tok + bs <= st.load_end
                row.append(st.block_ids[bi] if inside and bi < len(st.block_ids) else None)
            keys.append(key)
            blocks.append(row)
            sizes.append(n)
        loads.append(LoadOp(req_id, keys, blocks, None if all(n == cs for n in sizes) else sizes))
        if self.announcer is not None:
            # a tail record is announced by its own blocks; a full chunk's record that lent only
            # its leading blocks (an alias) holds another request's tokens after them: not this one's
            recs = [self._record(st, c) if part is None or c != part.chunk else
                    self._record(st, c, part.tokens) if part.alias is None else None
                    for c in range(first, last + 1)]
            self.announcer.loaded(keys, [None if r is None else (c, r)
                                         for c, r in zip(range(first, last + 1), recs, strict=True)])

    def _observe_step(self, so: SchedulerOutput) -> None:
        """Note the prompt tokens this step computes; ``step_done`` times it (the engine's
        prefill speed, for the load policy)."""
        tokens = context = 0
        for new in so.scheduled_new_reqs:
            n = so.num_scheduled_tokens.get(new.req_id, 0)
            if n > 1:  # a prefill (a decode step schedules one token)
                tokens += n
                context = max(context, new.num_computed_tokens + n)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            n = so.num_scheduled_tokens.get(req_id, 0)
            if n > 1:
                tokens += n
                context = max(context, cached.num_computed_tokens[i] + n)
        self._last_step = (time.monotonic(), tokens, context) if tokens else None

    def step_done(self, loads: dict[str, tuple[int, float]] | None) -> None:
        """A step's output arrived: time it, and take what the workers reported of their
        loads (bytes and seconds per tier)."""
        if self._last_step is not None:
            at, tokens, context = self._last_step
            self._last_step = None
            self.policy.observe_prefill(tokens, time.monotonic() - at, context)
        for tier, (nbytes, seconds) in (loads or {}).items():
            self.policy.observe_load(tier, nbytes, seconds)

    def request_finished(self, request: Request) -> None:
        self._reqs.pop(request.request_id, None)
        self._remote_asks.pop(request.request_id, None)

    def take_stats(self) -> dict[str, object] | None:
        """The figures recorded since the last call, for vLLM's metrics (None if none)."""
        return self.recorder.take()

    def stats(self) -> dict[str, object]:
        return {"lookups": self.lookups, "hit_tokens": self.hit_tokens, "skipped_tokens": self.skipped_tokens,
                **self.policy.stats()}

    def close(self) -> None:
        """Let go of the store (safe to call more than once)."""
        if not self._closed:
            self._closed = True
            if self.announcer is not None:
                self.announcer.flush()
            if self._remote_pool is not None:
                self._remote_pool.shutdown(wait=True)
            release_shared(self.store)
