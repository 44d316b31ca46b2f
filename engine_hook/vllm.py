"""lmctl's vLLM v1 KV connector: save prompt KV as adapter-tagged chunks, load cached prefixes.

Enable it with::

    KVTransferConfig(kv_connector="LMCtlConnector", kv_connector_module_path="engine_hook.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"store_path": "/var/cache/lmctl"})

or ``--kv-transfer-config '{"kv_connector": "LMCtlConnector", ...}'`` on ``vllm serve``.
Every extra-config key is documented in docs/engine-hook.md.

``LMCtlConnector`` is a thin facade, as vLLM's own connectors are: vLLM creates one per
role, and each builds only its side. The scheduler side (``engine_hook.scheduler``)
decides how many leading tokens the store can supply and which newly computed chunks to
save; the worker side (``engine_hook.worker``) does the copies. What the scheduler
decides crosses to the workers as ``LoadOp`` and ``SaveOp`` in ``LMCtlMetadata``.
Both sides share what ``engine_hook.context`` reads from vLLM's config, and, when they
live in one process, one store (``store.open_shared``).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .announce import Announcer, Cleared, Event, Stored
from .config import ConnectorSettings
from .context import ConnectorContext
from .metrics import LMCtlPromMetrics, LMCtlStats, build_stats
from .ops import LoadOp, SaveOp
from .scheduler import LMCtlConnectorScheduler
from .worker import LMCtlConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from store import Store

__all__ = ["LMCtlConnector", "LMCtlMetadata", "LoadOp", "SaveOp", "live_connectors"]

log = logging.getLogger("lmctl.engine_hook")
#: how long an idle step (nothing scheduled) waits for a load in flight to finish
IDLE_WAIT_S = 0.02
_LIVE: weakref.WeakSet[LMCtlConnector] = weakref.WeakSet()


@dataclass
class LMCtlMetadata(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler side to every worker. ``idle``: the
    step computes nothing (every request waits, e.g. for its load)."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    idle: bool = False


@dataclass
class LMCtlWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers loaded in one step, per tier: (bytes, seconds). The scheduler side's
    load policy learns each tier's speed from it."""

    loads: dict[str, tuple[int, float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        out = dict(self.loads)
        for tier, (b, s) in getattr(other, "loads", {}).items():
            ob, os_ = out.get(tier, (0, 0.0))
            out[tier] = (ob + b, max(os_, s))  # ranks load their shares in parallel
        return LMCtlWorkerMeta(out)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised: a single worker
        return 0


class LMCtlConnector(KVConnectorBase_V1):
    """vLLM v1 connector over an lmctl store (``engine_hook.vllm.LMCtlConnector``)."""

    _cache_hit_source = CacheHitSource.DISK  # vLLM's prompt_tokens_by_source label for our hits

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        settings = ConnectorSettings.parse(ktc.kv_connector_extra_config or {})
        # A chunk that fails to load is a cache miss: vLLM recomputes it. ("fail" would
        # end the request with an error, which a cache must never cause.)
        ktc.kv_load_failure_policy = "fail" if settings.on_load_error == "fail" else "recompute"
        tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.context = ConnectorContext.from_vllm(vllm_config, kv_cache_config, settings, tp_rank)
        self.connector_scheduler: LMCtlConnectorScheduler | None = None
        self.connector_worker: LMCtlConnectorWorker | None = None
        self.store: Store
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = LMCtlConnectorScheduler(self.context)
            self.store = self.connector_scheduler.store
            kec = getattr(vllm_config, "kv_events_config", None)
            if kec is not None and kec.enable_kv_cache_events:
                self._start_events(settings.reannounce)
        else:
            self.connector_worker = LMCtlConnectorWorker(self.context)
            self.store = self.connector_worker.store
        _LIVE.add(self)
        ctx = self.context
        log.info("lmctl connector (%s) on store %s, model %r, format %s, model fingerprint %s",
                 role.name.lower(), self.store.path, ctx.model_id, ctx.kv_format, ctx.fingerprint_note())

    @property
    def model_fingerprint(self) -> str | None:
        return self.context.model_fingerprint

    def _scheduler(self) -> LMCtlConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker-side connector"
        return self.connector_scheduler

    def _worker(self) -> LMCtlConnectorWorker:
        assert self.connector_worker is not None, "a worker-side call on a scheduler-side connector"
        return self.connector_worker

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        loads, saves = self._scheduler().plan(scheduler_output)
        return LMCtlMetadata(loads, saves, idle=scheduler_output.total_num_scheduled_tokens == 0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._scheduler().step_done(meta.loads if isinstance(meta, LMCtlWorkerMeta) else None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request)
        return False, None

    def _start_events(self, reannounce: bool) -> None:
        """KV events for lmctl's tiers (``engine_hook.announce``): vLLM publishes what
        ``take_events`` returns; an engine that starts on a store that already holds chunks
        of its namespaces announces them again."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        sched = self._scheduler()
        ctx = self.context
        mine = {rec.ns_id for rec, _doc in self.store.namespace_records().values()
                if rec.model == ctx.model_id and rec.kv_format == ctx.kv_format
                and rec.model_fingerprint == ctx.model_fingerprint}
        topic = str(getattr(self._vllm_config.kv_events_config, "topic", "") or "")
        sched.announcer = Announcer(self.store, mine.__contains__, ctx.block_size, ctx.kv_format.chunk_size,
                                    reannounce=reannounce and bool(mine),
                                    instance=(f"topic {topic}, " if topic else "") + f"pid {os.getpid()}")
        sched.convert_hash = maybe_convert_block_hash

    def take_events(self) -> Iterable[KVCacheEvent]:
        """This step's KV events for lmctl's tiers (scheduler side only: vLLM publishes them
        once, whatever the tensor-parallel size)."""
        sched = self.connector_scheduler
        if sched is None or sched.announcer is None:
            return ()
        return [to_vllm_event(e) for e in sched.announcer.take()]

    def has_pending_push_work(self) -> bool:
        """True while the re-announce after start-up is not done, and when the store's event
        log has news to look at (a removal to announce): vLLM then steps without requests
        (empty steps, a batch of chunks each) so that a restarted instance is routable before
        its first request. vLLM asks before it waits for requests: an engine already waiting
        publishes at its next step."""
        sched = self.connector_scheduler
        return sched is not None and sched.announcer is not None and sched.announcer.pending()

    # -- worker side -------------------------------------------------------------------
    def _metadata(self) -> LMCtlMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, LMCtlMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None:
            self._worker().load(meta.loads)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._metadata()
        # a step that computes nothing would come straight back: wait for a load instead of
        # spinning (a spinning engine loop holds the GIL the loader needs)
        done = self._worker().take_finished(IDLE_WAIT_S if meta is not None and meta.idle else 0.0)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.connector_worker is None else self.connector_worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker().take_load_report()
        return LMCtlWorkerMeta(report) if report else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._metadata()
        if meta is not None:
            self._worker().save(meta.saves)

    # -- either side -------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's figures since its last report (vLLM asks after every step and adds
        the workers' and the scheduler's up); None when there is nothing new."""
        side = self.connector_worker if self.connector_worker is not None else self.connector_scheduler
        report = None if side is None else side.take_stats()
        return None if report is None else LMCtlStats(data=report)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        # runs in vLLM's API server: the metrics that each step's report is recorded into
        return LMCtlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def lookups(self) -> int:
        return 0 if self.connector_scheduler is None else self.connector_scheduler.lookups

    @property
    def hit_tokens(self) -> int:
        return 0 if self.connector_scheduler is None else self.connector_scheduler.hit_tokens

    @property
    def loaded_chunks(self) -> int:
        return 0 if self.connector_worker is None else self.connector_worker.loaded_chunks

    @property
    def failed_loads(self) -> int:
        return 0 if self.connector_worker is None else self.connector_worker.failed_loads

    def stats(self) -> dict[str, Any]:
        """Counters of both sides; a side this connector does not have counts 0."""
        out: dict[str, Any] = {"lookups": 0, "hit_tokens": 0, "skipped_tokens": 0, "loaded_chunks": 0,
                               "failed_loads": 0, "load_s": 0.0}
        if self.connector_scheduler is not None:
            out.update(self.connector_scheduler.stats())
        if self.connector_worker is not None:
            out.update(self.connector_worker.stats())
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for loads in flight and queued saves (used by tests and at shutdown)."""
        if self.connector_worker is None:
            return True
        return self.connector_worker.wait_loads(timeout) and self.connector_worker.flush(timeout)

    def shutdown(self) -> None:
        """Write what is queued and let go of the store (safe to call more than once)."""
        if self.connector_worker is not None:
            self.connector_worker.close()
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()


def to_vllm_event(e: Event) -> KVCacheEvent:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` for one of the announcer's events."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    if isinstance(e, Cleared):
        return AllBlocksCleared()
    if isinstance(e, Stored):
        return BlockStored(block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                           token_ids=list(e.token_ids), block_size=e.block_size, lora_id=None, medium=e.medium,
                           lora_name=e.lora_name, locality=e.locality)
    return BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium, locality=e.locality)


def live_connectors() -> list[LMCtlConnector]:
    """The lmctl connectors alive in this process (single-process engines), for tests and
    demos that want to wait for saves or read counters."""
    return list(_LIVE)
