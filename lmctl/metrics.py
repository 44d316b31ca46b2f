"""The daemon's Prometheus exporter (``lmctl serve --metrics ADDR:PORT``).

Every scrape reads the store: tier usage from its counters, and the metric cells that every
process using the store (engines, this daemon) adds to (store/index/metrics.py), so the figures
cover all of them, not only the daemon. Names carry the ``lmctl_`` prefix and follow
Prometheus' conventions (``_total`` counters, ``_bytes``, ``_seconds``). docs/operator-guide.md
lists them.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from store import Store, StoreError
from store.index.metrics import SECONDS_BUCKETS, Cell

from .errors import UsageError

log = logging.getLogger("lmctl.daemon")

#: store counters (index ``c:<name>``) exported as counters: counter -> (metric, help)
STORE_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("lmctl_chunk_hits_total", "Chunk reads that found their chunk (every process)."),
    "misses": ("lmctl_chunk_misses_total", "Chunk reads that found nothing (every process)."),
    "corrupt": ("lmctl_corrupt_chunks_total", "Chunks dropped because their bytes failed verification."),
    "evicted": ("lmctl_evicted_chunks_total", "Chunks removed from the store to make room or by operators."),
    "rejected_full": ("lmctl_saves_rejected_full_total", "Chunks not stored: the tier was full of pinned chunks."),
    "compacted_bytes": ("lmctl_compacted_bytes_total", "Bytes rewritten by segment compaction."),
    "payload_bytes": ("lmctl_payload_bytes_total", "Stored payload bytes written."),
    "written_bytes": ("lmctl_written_bytes_total", "Bytes written to segment files (payload, framing, compaction)."),
}

#: metric cells (store/index/metrics.py) -> help; the cell's name gets the ``lmctl_`` prefix
CELLS: dict[str, str] = {
    "lookups_total": "Engine lookups of a prompt's cached prefix, per model and adapter.",
    "lookup_hit_tokens_total": "Prompt tokens engine lookups found cached, per model and adapter.",
    "lookup_miss_tokens_total": "Prompt tokens engine lookups did not find, per model and adapter.",
    "loads_total": "Chunks read out of the store into a caller's buffer (engine loads), per tier read from.",
    "load_bytes_total": "Bytes of chunks loaded (decoded size), per tier.",
    "load_seconds": "Seconds to read, verify and decode one chunk, per tier.",
    "saves_total": "Chunks stored by put_many (engine saves, warm), per tier written to.",
    "save_bytes_total": "Bytes of chunks stored (decoded size), per tier.",
    "save_seconds": "Seconds of one put_many batch, per tier.",
    "saves_spilled_total": "Chunks saved to the next local tier because the default tier's disk was full or "
                           "read-only, by tier (from, to).",
    "read_failures_total": "Chunk reads that failed their checks, a miss each, by reason (bad-length, bad-record, "
                           "io-error, read-error) and tier.",
    "remote_calls_total": "Calls to the remote tier's server.",
    "remote_errors_total": "Remote calls that failed, by kind (timeout, oom, other).",
    "remote_short_circuited_total": "Remote calls answered without the network (breaker open, puts paused).",
    "remote_puts_total": "Chunks put to the remote tier, by result (stored, failed).",
    "remote_reads_total": "Chunk reads from the remote tier, by result (hit, miss).",
    "remote_lookups_total": "Chunk keys looked up in the remote tier.",
    "remote_bad_values_total": "Remote values found unusable, by kind (forged, torn, foreign, evicted, too_small).",
    "remote_bytes_total": "Stored bytes moved to (out) and from (in) the remote tier.",
    "not_admitted_total": "Chunks admit = second-hit kept off the nvme tier, by path (put: an engine's save, not "
                          "written until its key is saved again; spill: a chunk leaving dram unread and unseen "
                          "again, dropped). A normal result, not an error.",
    "not_admitted_bytes_total": "Bytes of the chunks admission kept off the nvme tier (decoded size), by path.",
}


#: ``Store.event_counters()`` kinds -> (metric, help); each by its ``reason`` label
EVENT_COUNTERS: dict[str, tuple[str, str]] = {
    "evictions_total": ("lmctl_evictions_total", "Chunks evicted, by reason (lru, retired, operator, moved-remote)."),
    "corrupt_total": ("lmctl_corrupt_drops_total", "Chunks dropped as corrupt, by how they were found."),
    "saves_dropped_total": ("lmctl_saves_dropped_total", "Engine saves dropped, by reason (queue-full, disk-full, "
                            "failed)."),
    "pins_total": ("lmctl_pins_total", "Pin references added, by reason."),
    "unpins_total": ("lmctl_unpins_total", "Pin references removed, by reason."),
    "remote_copies_total": ("lmctl_remote_copies_total", "Chunks copied to the remote tier with their local copy "
                            "kept, by reason (drain)."),
    "announced_total": ("lmctl_announced_total", "Chunks engines announced to routers in KV events, by reason "
                        "(stored, reannounced, removed)."),
}


#: gauges processes set (``Store.set_gauge``) -> help; exported while younger than a minute
GAUGES: dict[str, str] = {
    "engine_save_queue": "Chunks an engine process has queued for its writer (or is writing), per pid.",
    "engine_loads_in_flight": "Requests whose chunks an engine process is loading, per pid.",
}


def parse_listen(value: str) -> tuple[str, int]:
    """``PORT`` (loopback), ``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"--metrics {value!r}: give PORT or ADDR:PORT (e.g. 9464 or 0.0.0.0:9464)") from None
    if not 0 < number < 65536:
        raise UsageError(f"--metrics {value!r}: the port must be 1-65535")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise UsageError(f"--metrics {value!r}: {host!r} is not an IP address") from None
    return host, number


class StoreCollector(Collector):
    """Builds every metric family from the store at scrape time. ``extra()`` returns the
    daemon's own figures (jobs, requests, the remote breaker's state)."""

    def __init__(self, store: Callable[[], Store], extra: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.extra = extra

    def collect(self) -> Iterator[Metric]:
        try:
            store = self.store()
        except AttributeError:  # scraped while the daemon is still opening its store
            return
        stats = store.stats()
        cells = store.metric_cells()
        tiers = {
            "chunks": GaugeMetricFamily("lmctl_tier_chunks", "Chunks in a tier.", labels=["tier"]),
            "bytes": GaugeMetricFamily("lmctl_tier_bytes", "Stored bytes of the chunks in a tier.", labels=["tier"]),
            "capacity": GaugeMetricFamily("lmctl_tier_capacity_bytes", "A tier's capacity.", labels=["tier"]),
            "pinned_bytes": GaugeMetricFamily("lmctl_tier_pinned_bytes", "Stored bytes of pinned chunks in a tier.",
                                              labels=["tier"]),
            "disk_bytes": GaugeMetricFamily("lmctl_tier_disk_bytes", "Bytes of a tier's segment files.",
                                            labels=["tier"]),
        }
        for name, t in stats.tiers.items():
            for field, fam in tiers.items():
                fam.add_metric([name], float(getattr(t, field)))
        yield from tiers.values()
        for counter, (metric, doc) in STORE_COUNTERS.items():
            yield CounterMetricFamily(metric, doc, value=float(stats.counters.get(counter, 0)))
        yield GaugeMetricFamily("lmctl_write_amplification", "Bytes written to segment files per payload byte.",
                                value=stats.write_amplification)
        yield from _endurance_families(store)
        yield from _cell_families(cells)
        gauges: dict[str, GaugeMetricFamily] = {}
        for g in store.metric_gauges():
            if g.name in GAUGES:
                fam = gauges.setdefault(g.name, GaugeMetricFamily("lmctl_" + g.name, GAUGES[g.name], labels=["pid"]))
                fam.add_metric([g.labels.get("pid", "")], g.value)
        yield from gauges.values()
        events = store.event_counters()
        for kind, (metric, doc) in EVENT_COUNTERS.items():
            events_fam = CounterMetricFamily(metric, doc, labels=["reason"])
            for reason, n in sorted(events.get(kind, {}).items()):
                events_fam.add_metric([reason], float(n))
            yield events_fam
        extra = self.extra()
        jobs = GaugeMetricFamily("lmctl_daemon_jobs", "Long operations running in the daemon, per command.",
                                 labels=["cmd"])
        for cmd, n in sorted(extra.get("jobs", {}).items()):
            jobs.add_metric([cmd], float(n))
        yield jobs
        yield CounterMetricFamily("lmctl_daemon_requests_total", "Requests the daemon answered.",
                                  value=float(extra.get("requests", 0)))
        yield CounterMetricFamily("lmctl_daemon_request_errors_total", "Requests that ended in an error.",
                                  value=float(extra.get("errors", 0)))
        yield CounterMetricFamily("lmctl_daemon_maintenance_failures_total",
                                  "Background maintenance passes (evict, compact) that failed.",
                                  value=float(extra.get("maintenance_failures", 0)))
        if stats.remote is not None:
            state = GaugeMetricFamily("lmctl_remote_breaker_state",
                                      "The daemon's remote circuit breaker: 1 for its current state.",
                                      labels=["state"])
            for s in ("closed", "half-open", "open"):
                state.add_metric([s], 1.0 if stats.remote.get("breaker") == s else 0.0)
            yield state


#: the nvme tier's writes against its budget (``Store.write_rates``) and the ghost list
ENDURANCE: dict[str, str] = {
    "lmctl_tier_written_bytes_total": "Bytes written to a tier's segment files (records, segment headers, "
                                      "compaction, spills from dram), every process's; the nvme tier's.",
    "lmctl_tier_written_last_day_bytes": "Bytes written to a tier in the last 24 hours (hourly rows in the index).",
    "lmctl_tier_write_rate_bytes_per_day": "A tier's writes per day, projected from the last 24 hours (from the "
                                           "time counting began when that is less, and at least an hour).",
    "lmctl_tier_write_budget_bytes_per_day": "The operator's write budget of a tier (tiers.nvme.write_budget), "
                                             "where one is set.",
    "lmctl_tier_write_budget_exceeded": "1 when a tier is on course to write more per day than its budget.",
    "lmctl_admission_ghosts": "Chunk keys the ghost list of admit = second-hit remembers.",
}


def _endurance_families(store: Store) -> Iterator[Metric]:
    rates = store.write_rates()
    fams = {name: (CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily)(
        name, doc, labels=["tier"]) for name, doc in ENDURANCE.items() if name != "lmctl_admission_ghosts"}
    for tier, r in rates.items():
        fams["lmctl_tier_written_bytes_total"].add_metric([tier], float(r.written_bytes))
        fams["lmctl_tier_written_last_day_bytes"].add_metric([tier], float(r.written_24h_bytes))
        fams["lmctl_tier_write_rate_bytes_per_day"].add_metric([tier], float(r.per_day_bytes))
        if r.budget_bytes_per_day is not None:
            fams["lmctl_tier_write_budget_bytes_per_day"].add_metric([tier], float(r.budget_bytes_per_day))
            fams["lmctl_tier_write_budget_exceeded"].add_metric([tier], 1.0 if r.over_budget else 0.0)
    yield from fams.values()
    yield GaugeMetricFamily("lmctl_admission_ghosts", ENDURANCE["lmctl_admission_ghosts"],
                            value=float(store.admission_stats()["ghosts"]))


def _cell_families(cells: list[Cell]) -> Iterator[Metric]:
    by_name: dict[str, list[Cell]] = {}
    for c in cells:
        if c.name in CELLS:
            by_name.setdefault(c.name, []).append(c)
    for name, group in sorted(by_name.items()):
        labels = sorted({k for c in group for k in c.labels})
        metric = "lmctl_" + name
        if group[0].histogram:
            hfam = HistogramMetricFamily(metric, CELLS[name], labels=labels)
            for c in group:
                if not c.histogram:
                    continue
                running, buckets = 0.0, []
                for bound, n in zip(SECONDS_BUCKETS, c.buckets, strict=True):
                    running += n
                    buckets.append((_bound(bound), running))
                buckets.append(("+Inf", c.count))
                hfam.add_metric([c.labels.get(k, "") for k in labels], buckets, c.sum)
            yield hfam
        else:
            cfam = CounterMetricFamily(metric, CELLS[name], labels=labels)
            for c in group:
                cfam.add_metric([c.labels.get(k, "") for k in labels], c.value)
            yield cfam


def _bound(x: float) -> str:
    return repr(float(x))


class Exporter:
    """The HTTP server that Prometheus scrapes, on a thread of its own."""

    def __init__(self, listen: str, store: Callable[[], Store], extra: Callable[[], dict[str, Any]]) -> None:
        """Listen on ``listen`` ([ADDR:]PORT); scrapes read ``store()`` (the daemon's store,
        which may be opened after this). A port that cannot be bound is a ``StoreError``."""
        from prometheus_client import start_http_server

        self.host, self.port = parse_listen(listen)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(store, extra))
        try:
            self._server, self._thread = start_http_server(self.port, self.host, registry=registry)
        except OSError as exc:
            raise StoreError(f"--metrics {listen}: cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", self.host if ":" not in self.host else f"[{self.host}]",
                 self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        t: threading.Thread = self._thread
        t.join(timeout=5)
