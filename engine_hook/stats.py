"""The connector's figures for vLLM's metrics: what each one means, and a thread-safe
recorder that the two sides add to between two reports.

Imports neither torch nor vllm: the worker side, the writer thread and the scheduler side
record here; ``engine_hook.metrics`` wraps a report in vLLM's ``KVConnectorStats`` and
exports it as Prometheus metrics.

A report (the payload vLLM carries from the engine to its API server) is a plain dict of
str keys, numbers and lists, so that it survives vLLM's serialization::

    {"counters": {key: {label value ("" when the metric has no label): number}},
     "histograms": {key: [observation, ...]}}
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Literal

#: every lmctl metric's Prometheus name starts with this (vLLM removes the collectors whose
#: names start with ``vllm:`` before it registers its metrics anew, and ours go with them)
PROM_PREFIX = "vllm:lmctl_"

#: histogram buckets, seconds: a chunk's copy on a fast tier up to a slow remote load
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Metric:
    """One figure: its key in a report, Prometheus type, meaning, and its one extra label
    (beside vLLM's ``model_name`` and ``engine``) with the values it always has."""

    key: str
    kind: Literal["counter", "histogram"]
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()

    @property
    def prom_name(self) -> str:
        """The name given to prometheus_client (it adds ``_total`` to a counter's samples)."""
        return PROM_PREFIX + self.key

    @property
    def exposed_name(self) -> str:
        """The name on ``/metrics`` (histograms add ``_bucket``, ``_sum`` and ``_count``)."""
        return self.prom_name + ("_total" if self.kind == "counter" else "")


#: store/config.py's TIER_LADDER (vLLM's API server loads these definitions without the store: a
#: test keeps the two equal)
TIERS = ("dram", "nvme", "remote")

METRICS: tuple[Metric, ...] = (
    Metric("loaded_chunks", "counter",
           "Chunks loaded from the lmctl store into the engine's KV cache, by the tier they came from.",
           "tier", TIERS),
    Metric("loaded_bytes", "counter",
           "Bytes of KV (uncompressed) loaded from the lmctl store into the engine's KV cache, by tier.",
           "tier", TIERS),
    Metric("load_seconds", "histogram",
           "Seconds one request waited for its load: from the worker receiving it to its last chunk "
           "in the engine's blocks (or its failure)."),
    Metric("failed_loads", "counter",
           "Requests whose load stopped at a chunk that could not be loaded: missing (gone from the store, "
           "or failed its checks: checksum, length, a disk error), bad_length (the store returned a chunk "
           "of another size than the KV format's) or error (a read or copy raised). vLLM recomputes from "
           "that chunk.",
           "reason", ("missing", "bad_length", "error")),
    Metric("failed_load_chunks", "counter",
           "Chunks that vLLM recomputes because a load failed: the failed chunk and every later one of "
           "the request.", "reason", ("missing", "bad_length", "error")),
    Metric("saved_chunks", "counter", "Chunks the lmctl connector wrote to the store."),
    Metric("saved_bytes", "counter", "Bytes of KV (uncompressed) the lmctl connector wrote to the store."),
    Metric("save_seconds", "histogram",
           "Seconds from a chunk's copy out of the engine's blocks to its write committed in the store "
           "(waiting for the background writer included)."),
    Metric("already_stored_chunks", "counter",
           "Chunks queued for saving that the store already held when the writer came to them "
           "(another engine or request wrote them first): not written again."),
    Metric("not_admitted_chunks", "counter",
           "Chunks the store did not write because its admission setting (admit = second-hit) keeps a chunk "
           "off NVMe until its prefix is seen again: a normal result, not a dropped save."),
    Metric("dropped_saves", "counter",
           "Chunks not saved, by reason: queue_full (every staging buffer waited for the writer), "
           "store_full (the store refused it: the tier is full of pinned chunks or too small), "
           "read_only (the store's filesystem is read-only), "
           "error (copying it out of the engine or writing it raised).",
           "reason", ("queue_full", "store_full", "read_only", "error")),
    Metric("lookups", "counter", "Requests the lmctl connector looked up in the store."),
    Metric("policy_recomputed_tokens", "counter",
           "Stored prompt tokens that the load policy chose to recompute, predicting that loading them "
           "would be slower."),
)
BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}


def empty_report() -> dict[str, Any]:
    return {"counters": {}, "histograms": {}}


def is_empty(report: dict[str, Any]) -> bool:
    return not report.get("counters") and not report.get("histograms")


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add ``other`` to ``into`` (in place; returns ``into``): counters add up per label,
    histogram observations are pooled. Keys this version does not know are kept."""
    counters = into.setdefault("counters", {})
    for key, by_label in other.get("counters", {}).items():
        mine = counters.setdefault(key, {})
        for label, n in by_label.items():
            mine[label] = mine.get(label, 0) + n
    hists = into.setdefault("histograms", {})
    for key, values in other.get("histograms", {}).items():
        hists.setdefault(key, []).extend(values)
    return into


def summary(report: dict[str, Any]) -> dict[str, int | float]:
    """A flat summary for vLLM's periodic log line: each counter's total (and per label
    where it has one), each histogram's count, mean and maximum in milliseconds."""
    out: dict[str, int | float] = {}
    for key, by_label in report.get("counters", {}).items():
        total = sum(by_label.values())
        out[key] = total
        metric = BY_KEY.get(key)
        if metric is not None and metric.label is not None:
            for label, n in sorted(by_label.items()):
                if n:
                    out[f"{key}[{label}]"] = n
    for key, values in report.get("histograms", {}).items():
        out[f"{key}_count"] = len(values)
        if values:
            out[f"{key}_avg_ms"] = round(1000 * sum(values) / len(values), 3)
            out[f"{key}_max_ms"] = round(1000 * max(values), 3)
    return out


class StatsRecorder:
    """Figures recorded since the last ``take``: counters per label and histogram
    observations. Safe to record from any thread (the step loop, the loader threads,
    the writer thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = empty_report()

    def record(self, counts: dict[str, float] | None = None, labels: dict[str, str] | None = None,
               observe: dict[str, float] | None = None) -> None:
        """Add ``counts`` (key -> amount; a labelled metric's label value from ``labels``)
        and ``observe`` (histogram key -> observation) as one update: a report never holds
        half of it."""
        labels = labels or {}
        with self._lock:
            counters = self._report["counters"]
            for key, n in (counts or {}).items():
                metric = BY_KEY[key]
                if metric.kind != "counter":
                    raise ValueError(f"{key} is not a counter")
                label = labels.get(metric.label, "") if metric.label else ""
                by_label = counters.setdefault(key, {})
                by_label[label] = by_label.get(label, 0) + n
            hists = self._report["histograms"]
            for key, value in (observe or {}).items():
                if BY_KEY[key].kind != "histogram":
                    raise ValueError(f"{key} is not a histogram")
                hists.setdefault(key, []).append(value)

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        with self._lock:
            if is_empty(self._report):
                return None
            out, self._report = self._report, empty_report()
        return out

    def peek(self) -> dict[str, Any]:
        """A copy of what was recorded since the last ``take`` (tests)."""
        with self._lock:
            return copy.deepcopy(self._report)
