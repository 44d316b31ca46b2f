"""The connector's figures in vLLM's own metrics: ``LMCtlStats`` carries one report from the
engine to vLLM's loggers, ``LMCtlPromMetrics`` exports them on vLLM's ``/metrics``.

vLLM asks the connector of each side for its stats after every step
(``get_kv_connector_stats``), adds up the workers' and the scheduler's, sends the sum to
its API server, and there logs ``reduce()`` periodically and hands each report to the
Prometheus metrics that ``build_prom_metrics`` registered. The figures and their meanings
are in ``engine_hook.stats``; their names start with ``vllm:lmctl_``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .stats import BY_KEY, METRICS, SECONDS_BUCKETS, Metric, empty_report, is_empty, merge, summary

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

log = logging.getLogger("lmctl.engine_hook")


@dataclass
class LMCtlStats(KVConnectorStats):
    """One or more reports of ``engine_hook.stats`` (``data`` is the report itself)."""

    def __post_init__(self) -> None:
        if is_empty(self.data):
            self.reset()

    def reset(self) -> None:
        self.data = empty_report()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


def build_stats(data: dict[str, Any] | None) -> LMCtlStats:
    """Stats over a copy of ``data``: vLLM hands the same report to its log and Prometheus
    loggers, and aggregating mutates the stats' data."""
    return LMCtlStats(data=copy.deepcopy(data) if data else empty_report())


class LMCtlPromMetrics(KVConnectorPromMetrics):
    """Registers every metric of ``engine_hook.stats.METRICS`` with vLLM's labels
    (``model_name``, ``engine``) plus the metric's own, and records reports into them."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        self._children: dict[tuple[int, str, str], Any] = {}
        histogram: Any = self._histogram_cls  # typed by vLLM as any metric class
        for m in METRICS:
            names = list(labelnames) + ([m.label] if m.label else [])
            if m.kind == "counter":
                family = self._counter_cls(name=m.prom_name, documentation=m.help, labelnames=names)
            else:
                family = histogram(name=m.prom_name, documentation=m.help, labelnames=names,
                                   buckets=list(SECONDS_BUCKETS))
            self._families[m.key] = family
            # every series exists from the start (at 0), so a scrape sees it before the first event
            for engine_idx in per_engine_labelvalues:
                for value in (m.values if m.label else ("",)):
                    self._child(engine_idx, m, value)

    def _child(self, engine_idx: int, m: Metric, label: str) -> Any:
        child = self._children.get((engine_idx, m.key, label))
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if m.label else [])
            child = self._children[(engine_idx, m.key, label)] = self._families[m.key].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one report. Figures this version does not know are skipped, never raised
        (this runs in vLLM's API server)."""
        for key, by_label in transfer_stats_data.get("counters", {}).items():
            m = BY_KEY.get(key)
            if m is None or m.kind != "counter":
                continue
            for label, n in by_label.items():
                if n > 0:
                    self._child(engine_idx, m, str(label) if m.label else "").inc(n)
        for key, values in transfer_stats_data.get("histograms", {}).items():
            m = BY_KEY.get(key)
            if m is None or m.kind != "histogram":
                continue
            child = self._child(engine_idx, m, "")
            for v in values:
                child.observe(v)
