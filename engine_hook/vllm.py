"""lmctl's vLLM v1 KV connector: save prompt KV as adapter-tagged chunks, load cached prefixes.

Enable it with::

    KVTransferConfig(kv_connector="LMCtlConnector", kv_connector_module_path="engine_hook.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"store_path": "/var/cache/lmctl"})

or ``--kv-transfer-config '{"kv_connector": "LMCtlConnector", ...}'`` on ``vllm serve``.
Every extra-config key is documented in docs/engine-hook.md.

The scheduler side decides (from token ids, model, KV format, LoRA adapter identity and
cache salt) how many leading tokens the store can supply, and which newly computed
chunks to save. The worker side does the copies: loads before the forward pass,
gathers after it, and hands the gathered chunks to a background writer. Failures never
reach the step loop: a chunk that cannot be loaded is reported to vLLM, which
recomputes it; a chunk that cannot be saved is dropped and counted.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from store import AdapterIdentity, KVFormat, Namespace, StoreError, open_shared, release_shared
from store.tensors import dtype_name

from .api import NamespaceBook
from .config import ConnectorSettings
from .fingerprint import ModelFingerprint, id_fingerprint, model_fingerprint
from .identity import AdapterCache, RecentKeys
from .transfer import ChunkWriter, PagedKV, StagingPool, chunk_layout, chunk_tensor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("lmctl.engine_hook")
_LIVE: weakref.WeakSet[LMCtlConnector] = weakref.WeakSet()


# -- what crosses from the scheduler to the workers ----------------------------------
@dataclass
class LoadOp:
    """Load chunks into a request's blocks. ``blocks[i]`` are chunk i's block ids in
    token order; ``None`` marks a block the engine already holds (not overwritten)."""

    req_id: str
    keys: list[bytes]
    blocks: list[list[int | None]]


@dataclass
class SaveOp:
    """Save one chunk whose KV sits in ``blocks`` (token order) after this step."""

    req_id: str
    key: bytes
    blocks: list[int]


@dataclass
class LMCtlMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


# -- scheduler-side bookkeeping ------------------------------------------------------
@dataclass
class _Req:
    ns: Namespace
    keys: list[bytes]              # keys of the prompt's full chunks
    stored: list[bool]             # whether the store held each chunk at lookup time
    load_start: int = 0            # tokens [load_start, load_end) come from the store
    load_end: int = 0
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0             # first chunk index not yet considered for saving


def kv_format_from(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int,
                   tp_rank: int) -> tuple[KVFormat, list[str], int]:
    """The KV format, the attention layer names and the block size of this engine.

    The block size is not part of the format (nor of the key): payloads use one canonical
    layout, so chunks move between engines with different block sizes."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise StoreError(f"lmctl supports models with one KV cache group (plain attention); this one has {len(groups)}")
    from vllm.v1.kv_cache_interface import AttentionSpec

    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise StoreError(f"lmctl supports attention KV caches only, not {type(spec).__name__}")
    layers = list(groups[0].layer_names)
    head_v = getattr(spec, "head_size_v", spec.head_size)
    if head_v != spec.head_size or getattr(spec, "sliding_window", None):
        raise StoreError("lmctl does not support attention with a different V head size or a sliding window yet")
    block_size = int(spec.block_size)
    fmt = KVFormat(
        dtype=dtype_name(spec.dtype), num_layers=len(layers), num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size), tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank, chunk_size=chunk_size,
    )
    return fmt, layers, block_size


def _served_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


def fingerprint_for(vllm_config: VllmConfig, setting: str) -> tuple[str | None, ModelFingerprint | None]:
    """The model fingerprint for the connector setting ``model_fingerprint``: None for
    ``off``, the string itself for an explicit one, else computed from the checkpoint
    (the same on the scheduler and on every worker: same files, same inputs)."""
    if setting == "off":
        return None, None
    if setting != "auto":
        return setting, None
    mc = vllm_config.model_config
    model = str(mc.model)
    revision = getattr(mc, "revision", None)
    quant = getattr(mc, "quantization", None)
    kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    try:
        fp = model_fingerprint(model, revision, None if quant is None else str(quant), kv_dtype)
    except Exception as exc:  # never serve without a fingerprint because of a bug here
        log.warning("lmctl: computing the model fingerprint failed (%s); using a digest of the model id instead",
                    exc, exc_info=True)
        fp = id_fingerprint(model, revision, None if quant is None else str(quant), kv_dtype, str(exc))
    return fp.digest, fp


class LMCtlConnector(KVConnectorBase_V1):
    """vLLM v1 connector over an lmctl store (``engine_hook.vllm.LMCtlConnector``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(ktc.kv_connector_extra_config or {})
        s = self.settings
        # A chunk that fails to load is a cache miss: vLLM recomputes it. ("fail" would
        # end the request with an error, which a cache must never cause.)
        ktc.kv_load_failure_policy = "fail" if s.on_load_error == "fail" else "recompute"

        self.model_id = s.model_id or _served_name(vllm_config)
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            try:
                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # not initialised: a single worker
                tp_rank = 0
        self.kv_format, self.layer_names, self.block_size = kv_format_from(
            vllm_config, kv_cache_config, s.chunk_size, tp_rank)
        if s.chunk_size % self.block_size:
            raise StoreError(f"chunk_size {s.chunk_size} must be a multiple of vLLM's block size {self.block_size}")

        self.store = open_shared(s.store_path)
        self._released = False
        if role == KVConnectorRole.SCHEDULER:
            s.apply(self.store)
        mc = vllm_config.model_config
        info = {
            "engine": "vllm",
            "tokenizer": str(mc.tokenizer),
            "tokenizer_mode": str(getattr(mc, "tokenizer_mode", "auto")),
            "tokenizer_revision": getattr(mc, "tokenizer_revision", None),
            "model_path": str(mc.model),
            "block_size": self.block_size,
        }
        self.model_fingerprint, self.fingerprint = fingerprint_for(vllm_config, s.model_fingerprint)
        info["fingerprint_source"] = self.fingerprint.source if self.fingerprint else s.fingerprint_mode()
        self.book = NamespaceBook(self.store, self.model_id, info, self.model_fingerprint)
        self.adapters = AdapterCache()
        self._layout = chunk_layout(self.kv_format)
        # Record the base model's namespace now, so that operators can look up, pin and
        # warm documents for this model before its first request (and, with tensor
        # parallelism, every rank's KV format is known: each worker records its own).
        try:
            self.book.get(self.kv_format, None, None)
        except Exception as exc:  # an unwritable store must not stop the engine here
            log.warning("lmctl: could not record the model's namespace: %s", exc)

        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._recent_saves = RecentKeys()
        self.lookups = 0
        self.hit_tokens = 0

        # worker side
        self._paged: PagedKV | None = None
        self._pool: StagingPool | None = None
        self._writer: ChunkWriter | None = None
        self._load_errors: set[int] = set()
        self.loaded_chunks = 0
        self.load_failures = 0
        self.load_s = 0.0
        _LIVE.add(self)
        log.info("lmctl connector (%s) on store %s, model %r, format %s, model fingerprint %s",
                 role.name.lower(), self.store.path, self.model_id, self.kv_format, self._fingerprint_note())

    def _fingerprint_note(self) -> str:
        fp = self.fingerprint
        if self.model_fingerprint is None:
            return "off"
        if fp is None:
            return f"{self.model_fingerprint[:12]} (explicit)"
        if fp.source != "files":
            return f"{fp.short} (model id only: weights not readable)"
        how = "cached" if fp.cached else f"{fp.bytes_read / 2**10:.0f} KiB read in {fp.seconds * 1e3:.0f} ms"
        return f"{fp.short} ({fp.files} files, {how})"

    # ======================= scheduler side =======================
    def _namespace(self, request: Request, kv_format: KVFormat) -> Namespace:
        lora = getattr(request, "lora_request", None)
        adapter: AdapterIdentity | None = None
        path = None
        if lora is not None:
            path = str(lora.lora_path)
            adapter = self.adapters.identity(str(lora.lora_name), path)
        return self.book.get(kv_format, adapter, getattr(request, "cache_salt", None), path)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._match(request, num_computed_tokens), False
        except Exception as exc:  # a cache problem is a miss, never an engine error
            log.warning("lmctl: lookup for request %s failed, recomputing: %s", request.request_id, exc)
            self._reqs.pop(request.request_id, None)
            return 0, False

    def _match(self, request: Request, num_computed_tokens: int) -> int:
        prompt = list(request.prompt_token_ids or [])
        ns = self._namespace(request, self.kv_format)
        found = self.store.lookup(ns, prompt)
        bs = self.block_size
        # the last prompt token is always computed (vLLM needs its logits)
        end = min(found.hit_tokens, (len(prompt) - 1) // bs * bs) if prompt else 0
        st = _Req(ns, found.keys, [t is not None for t in found.tiers])
        self._reqs[request.request_id] = st
        self.lookups += 1
        if end <= num_computed_tokens:
            return 0
        st.load_start, st.load_end = num_computed_tokens, end
        self.hit_tokens += end - num_computed_tokens
        return end - num_computed_tokens

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.load_pending = num_external_tokens > 0
        if st.load_pending:
            st.load_end = st.load_start + num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LMCtlMetadata()
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
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
            self._plan(meta, req_id, st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0))
        for req_id in so.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def _plan(self, meta: LMCtlMetadata, req_id: str, st: _Req, computed_after: int) -> None:
        cs, bs = self.kv_format.chunk_size, self.block_size
        bpc = cs // bs
        if st.load_pending:
            st.load_pending = False
            first, last = st.load_start // cs, (st.load_end - 1) // cs
            keys, blocks = [], []
            for c in range(first, last + 1):
                row: list[int | None] = []
                for j in range(bpc):
                    tok = c * cs + j * bs
                    bi = c * bpc + j  # the request's block index of that token
                    inside = st.load_start <= tok and tok + bs <= st.load_end
                    row.append(st.block_ids[bi] if inside and bi < len(st.block_ids) else None)
                keys.append(st.keys[c])
                blocks.append(row)
            meta.loads.append(LoadOp(req_id, keys, blocks))
        # chunks whose KV exists after this step and that the store lacked
        done = min(len(st.keys), computed_after // cs, len(st.block_ids) // bpc)
        while st.next_save < done:
            c = st.next_save
            st.next_save += 1
            key = st.keys[c]
            if st.stored[c] or not self._recent_saves.claim(key):
                continue
            meta.saves.append(SaveOp(req_id, key, st.block_ids[c * bpc : (c + 1) * bpc]))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # ======================= worker side =======================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = [kv_caches[n] for n in self.layer_names if n in kv_caches]
        if len(layers) != len(self.layer_names):
            layers = list(kv_caches.values())
        self._paged = PagedKV(layers, self.kv_format, self.block_size, self.settings.kv_layout)
        self._pool = StagingPool(self.kv_format.chunk_bytes, self.settings.save_queue + 2)
        self._writer = ChunkWriter(self.store, self._pool)
        log.info("lmctl: KV layout %s, %d layers, chunk %.1f MiB, %d save buffers", self._paged.layout,
                 len(layers), self.kv_format.chunk_bytes / 2**20, self.settings.save_queue)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCtlMetadata) or not meta.loads or self._paged is None:
            return
        t0 = time.perf_counter()
        for op in meta.loads:
            self._load(op)
        self.load_s += time.perf_counter() - t0

    def _load(self, op: LoadOp) -> None:
        assert self._paged is not None and self._pool is not None
        buf = self._pool.acquire(wait=True)
        assert buf is not None
        try:
            chunk = chunk_tensor(buf, self.kv_format)
            failed_at = None
            for i, key in enumerate(op.keys):
                try:
                    ok = self.store.get_into(key, buf.numpy().data) is not None
                except Exception as exc:
                    log.warning("lmctl: reading chunk %s failed: %s", key.hex()[:16], exc)
                    ok = False
                if not ok:
                    failed_at = i
                    break
                self._paged.scatter(chunk, op.blocks[i])
                self.loaded_chunks += 1
            if failed_at is not None:
                self.load_failures += 1
                for row in op.blocks[failed_at:]:
                    self._load_errors.update(b for b in row if b is not None)
                log.warning("lmctl: request %s: chunk %d of %d could not be loaded; vLLM recomputes from there",
                            op.req_id, failed_at + 1, len(op.keys))
        finally:
            self._pool.release(buf)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, LMCtlMetadata) or not meta.saves or self._paged is None:
            return
        assert self._pool is not None and self._writer is not None
        for op in meta.saves:
            buf = self._pool.acquire()
            if buf is None:
                self._writer.drop()
                continue
            try:
                self._paged.gather(op.blocks, chunk_tensor(buf, self.kv_format))
            except Exception as exc:
                log.warning("lmctl: gathering a chunk of request %s failed: %s", op.req_id, exc)
                self._pool.release(buf)
                continue
            self._writer.submit(op.key, buf, self._layout, self.kv_format.chunk_size)

    # ======================= both =======================
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lookups": self.lookups, "hit_tokens": self.hit_tokens,
                               "loaded_chunks": self.loaded_chunks, "load_failures": self.load_failures,
                               "load_s": round(self.load_s, 4)}
        if self._writer is not None:
            out["writer"] = dict(self._writer.stats.__dict__)
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves (used by tests and at shutdown)."""
        return True if self._writer is None else self._writer.flush(timeout)

    def shutdown(self) -> None:
        """Write what is queued and let go of the store (safe to call more than once)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._released:
            self._released = True
            release_shared(self.store)


def live_connectors() -> list[LMCtlConnector]:
    """The lmctl connectors alive in this process (single-process engines), for tests and
    demos that want to wait for saves or read counters."""
    return list(_LIVE)
