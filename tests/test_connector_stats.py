"""The connector's figures for vLLM's metrics (engine_hook.stats, engine_hook.metrics):
what each side records, the stats object vLLM aggregates, reduces and resets, and the
Prometheus metrics it registers. Without an engine: the worker side on a real store,
faults injected; tests/test_vllm_metrics.py scrapes them from a real `vllm serve`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_connector_sides import EXTRA, FMT, LAYERS, PROMPT, empty_step, fake_vllm, kv_caches, request, step

from engine_hook.config import ConnectorSettings
from engine_hook.context import ConnectorContext
from engine_hook.metrics import LMCtlPromMetrics, LMCtlStats, build_stats
from engine_hook.ops import LoadOp, SaveOp
from engine_hook.stats import BY_KEY, METRICS, StatsRecorder
from engine_hook.worker import LMCtlConnectorWorker
from store import Namespace

CHUNK = FMT.chunk_bytes


@pytest.fixture
def worker(tmp_path: Path) -> Any:
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "store"), **EXTRA})
    ctx = ConnectorContext(settings, "m", FMT, LAYERS, 16, None, None, {"engine": "test"})
    w = LMCtlConnectorWorker(ctx)
    w.register_kv_caches(kv_caches())
    yield w
    w.close()


def counters(report: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    assert report is not None
    return report["counters"]


def save_prompt(worker: LMCtlConnectorWorker) -> list[bytes]:
    keys = Namespace("m", FMT).chunk_keys(PROMPT)
    worker.save([SaveOp("r1", keys[0], [0, 1]), SaveOp("r1", keys[1], [2, 3])])
    assert worker.flush(10)
    return keys


def load(worker: LMCtlConnectorWorker, keys: list[bytes], req_id: str = "r2") -> None:
    blocks: list[list[int | None]] = [[4, 5], [6, 7]]
    worker.load([LoadOp(req_id, keys, blocks[: len(keys)])])
    assert worker.wait_loads(30)
    assert worker.take_finished() == {req_id}


# -- the recorder ------------------------------------------------------------------------
def test_the_recorder_adds_up_per_label_and_starts_afresh_after_each_take() -> None:
    r = StatsRecorder()
    assert r.take() is None  # nothing recorded: nothing to report
    r.record({"loaded_chunks": 1, "loaded_bytes": 100}, {"tier": "nvme"})
    r.record({"loaded_chunks": 2, "loaded_bytes": 200}, {"tier": "dram"}, observe={"load_seconds": 0.5})
    r.record({"loaded_chunks": 1, "loaded_bytes": 100}, {"tier": "nvme"}, observe={"load_seconds": 0.25})
    r.record({"saved_chunks": 1})
    report = r.take()
    assert report == {"counters": {"loaded_chunks": {"nvme": 2, "dram": 2}, "loaded_bytes": {"nvme": 200, "dram": 200},
                                   "saved_chunks": {"": 1}},
                      "histograms": {"load_seconds": [0.5, 0.25]}}
    assert r.take() is None  # reset by the take
    r.record({"lookups": 1})
    assert r.take() == {"counters": {"lookups": {"": 1}}, "histograms": {}}


def test_the_recorder_refuses_a_figure_it_does_not_define() -> None:
    r = StatsRecorder()
    with pytest.raises(KeyError):
        r.record({"no_such_figure": 1})
    with pytest.raises(ValueError, match="not a counter"):
        r.record({"load_seconds": 1})
    with pytest.raises(ValueError, match="not a histogram"):
        r.record(observe={"saved_chunks": 1.0})
    assert r.take() is None


# -- the stats object vLLM aggregates, reduces and resets --------------------------------
def rank_report(tier: str, chunks: int, seconds: list[float], dropped: int = 0) -> dict[str, Any]:
    r = StatsRecorder()
    for s in seconds:
        r.record(observe={"load_seconds": s})
    r.record({"loaded_chunks": chunks, "loaded_bytes": chunks * CHUNK}, {"tier": tier})
    if dropped:
        r.record({"dropped_saves": dropped}, {"reason": "queue_full"})
    report = r.take()
    assert report is not None
    return report


def test_stats_aggregate_over_ranks_and_reduce_to_a_summary() -> None:
    first = rank_report("nvme", 2, [0.010, 0.030])
    second_data = rank_report("nvme", 2, [0.020], dropped=3)
    third_data = rank_report("remote", 1, [0.100])
    stats = build_stats(first)
    second = build_stats(second_data)
    out = stats.aggregate(second).aggregate(build_stats(third_data))
    assert out is stats and not stats.is_empty()
    c = stats.data["counters"]
    assert c["loaded_chunks"] == {"nvme": 4, "remote": 1} and c["loaded_bytes"] == {"nvme": 4 * CHUNK, "remote": CHUNK}
    assert c["dropped_saves"] == {"queue_full": 3}
    assert sorted(stats.data["histograms"]["load_seconds"]) == [0.010, 0.020, 0.030, 0.100]
    # the reports it was built from are untouched (vLLM hands one report to several loggers)
    assert first["counters"]["loaded_chunks"] == {"nvme": 2} and len(first["histograms"]["load_seconds"]) == 2
    assert second_data["counters"]["loaded_chunks"] == {"nvme": 2}

    summary = stats.reduce()
    assert summary["loaded_chunks"] == 5 and summary["loaded_chunks[nvme]"] == 4
    assert summary["loaded_chunks[remote]"] == 1 and summary["loaded_bytes"] == 5 * CHUNK
    assert summary["dropped_saves"] == 3 and summary["dropped_saves[queue_full]"] == 3
    assert summary["load_seconds_count"] == 4
    assert summary["load_seconds_avg_ms"] == pytest.approx(40.0) and summary["load_seconds_max_ms"] == 100.0
    assert all(isinstance(v, int | float) for v in summary.values())

    stats.reset()
    assert stats.is_empty() and stats.reduce() == {}
    # aggregating an empty one changes nothing
    again = build_stats(first)
    before = again.reduce()
    assert again.aggregate(LMCtlStats()).reduce() == before
    assert build_stats(None).is_empty() and LMCtlStats().is_empty()


def test_stats_keep_figures_a_newer_version_sends() -> None:
    stats = build_stats({"counters": {"future_figure": {"": 2}}, "histograms": {}})
    stats.aggregate(build_stats({"counters": {"future_figure": {"": 3}}, "histograms": {}}))
    assert stats.reduce() == {"future_figure": 5}


# -- Prometheus ------------------------------------------------------------------------
def registry_classes(reg: CollectorRegistry) -> dict[type, Any]:
    """prometheus_client's metric classes, bound to a registry of the test's own."""

    def bound(cls: type) -> Any:
        class Bound(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, registry=reg, **kw)
        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_prometheus_metrics_are_registered_at_zero_and_record_reports() -> None:
    reg = CollectorRegistry()
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = LMCtlPromMetrics(vllm_config, registry_classes(reg), ["model_name", "engine"],  # type: ignore[arg-type]
                            {0: ["m", "0"], 1: ["m", "1"]})

    def value(name: str, engine: str = "0", **labels: str) -> float | None:
        return reg.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})

    # every series exists before the first report, so dashboards and alerts see 0, not nothing
    for m in METRICS:
        for label in m.values or ("",):
            extra = {m.label: label} if m.label else {}
            sample = m.exposed_name + ("_count" if m.kind == "histogram" else "")
            assert value(sample, **extra) == 0, sample
            assert value(sample, engine="1", **extra) == 0, sample
    assert all(m.exposed_name.startswith("vllm:lmctl_") for m in METRICS)

    report = rank_report("nvme", 2, [0.004, 0.2], dropped=1)
    report["counters"]["future_figure"] = {"": 1}  # unknown figures are skipped, not raised
    prom.observe(report, engine_idx=1)
    prom.observe(rank_report("remote", 1, [3.0]), engine_idx=1)
    assert value("vllm:lmctl_loaded_chunks_total", engine="1", tier="nvme") == 2
    assert value("vllm:lmctl_loaded_chunks_total", engine="1", tier="remote") == 1
    assert value("vllm:lmctl_loaded_bytes_total", engine="1", tier="nvme") == 2 * CHUNK
    assert value("vllm:lmctl_dropped_saves_total", engine="1", reason="queue_full") == 1
    assert value("vllm:lmctl_load_seconds_count", engine="1") == 3
    assert value("vllm:lmctl_load_seconds_sum", engine="1") == pytest.approx(3.204)
    assert value("vllm:lmctl_load_seconds_bucket", engine="1", le="0.005") == 1
    assert value("vllm:lmctl_load_seconds_bucket", engine="1", le="0.25") == 2
    assert value("vllm:lmctl_loaded_chunks_total", engine="0", tier="nvme") == 0  # the other engine's


def test_vllms_own_loggers_find_the_connectors_stats_and_metrics(tmp_path: Path) -> None:
    """vLLM's API-server side, from the connector named in the config: the periodic log
    line (aggregate + reduce + reset) and the Prometheus metrics, in a private registry."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    from testsupport.connector import kv_transfer_config

    ktc = kv_transfer_config(tmp_path / "s")
    reg = CollectorRegistry()
    classes = registry_classes(reg)

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = classes[Gauge], classes[Counter], classes[Histogram]

    prom = Prom(SimpleNamespace(kv_transfer_config=ktc), ["model_name", "engine"],  # type: ignore[arg-type]
                {0: ["m", "0"]})
    assert isinstance(prom.prom_metrics, LMCtlPromMetrics)
    logging_ = KVConnectorLogging(ktc)
    lines: list[str] = []
    for tier, chunks in (("nvme", 2), ("dram", 1)):
        data = LMCtlStats(data=rank_report(tier, chunks, [0.01])).to_dict()  # as the engine sends it
        logging_.observe(data)
        prom.observe(data, 0)
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "loaded_chunks=3" in lines[0] and "loaded_chunks[dram]=1" in lines[0]
    assert "load_seconds_count=2" in lines[0]
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset after logging: nothing new, no line
    assert reg.get_sample_value("vllm:lmctl_loaded_chunks_total", {"model_name": "m", "engine": "0",
                                                                  "tier": "nvme"}) == 2


# -- what the worker side records --------------------------------------------------------
def test_the_worker_reports_saves_and_loads_with_their_tier_bytes_and_times(worker: LMCtlConnectorWorker) -> None:
    keys = save_prompt(worker)
    report = worker.take_stats()
    c = counters(report)
    assert c == {"saved_chunks": {"": 2}, "saved_bytes": {"": 2 * CHUNK}}
    assert report is not None and len(report["histograms"]["save_seconds"]) == 2
    assert all(s > 0 for s in report["histograms"]["save_seconds"])
    assert worker.take_stats() is None  # reported once

    load(worker, keys)
    report = worker.take_stats()
    assert counters(report) == {"loaded_chunks": {"nvme": 2}, "loaded_bytes": {"nvme": 2 * CHUNK}}
    assert report is not None and len(report["histograms"]["load_seconds"]) == 1  # one per request

    save_prompt(worker)  # the same chunks again: the store holds them already
    assert counters(worker.take_stats()) == {"already_stored_chunks": {"": 2}}


def test_a_save_the_store_does_not_admit_is_counted_apart_and_is_no_dropped_save(tmp_path: Path) -> None:
    """``admit = "second-hit"``: the first save of a prefix is a normal result for the engine,
    counted as not admitted; the second is written."""
    from store import MiB, Store, StoreConfig, TierConfig

    Store(tmp_path / "store", StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, admit="second-hit")).close()
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "store"), **EXTRA})
    w = LMCtlConnectorWorker(ConnectorContext(settings, "m", FMT, LAYERS, 16, None, None, {"engine": "test"}))
    try:
        w.register_kv_caches(kv_caches())
        keys = save_prompt(w)
        assert counters(w.take_stats()) == {"not_admitted_chunks": {"": 2}}
        assert w.store.locate(keys) == [None, None] and w.stats()["writer"]["not_admitted"] == 2
        save_prompt(w)
        assert counters(w.take_stats()) == {"saved_chunks": {"": 2}, "saved_bytes": {"": 2 * CHUNK}}
        assert w.store.locate(keys) == ["nvme", "nvme"]
    finally:
        w.close()


@pytest.mark.parametrize("fault", ["missing", "error"])
def test_a_failed_load_is_counted_with_the_chunks_vllm_recomputes(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    keys = save_prompt(worker)
    worker.take_stats()
    if fault == "missing":  # gone from the store between the lookup and the load
        worker.store.evict([keys[0]])
    else:
        def broken(*args: Any, **kw: Any) -> Any:
            raise OSError("injected fault")
        monkeypatch.setattr(worker.store, "get_many_into", broken)
    load(worker, keys)
    report = worker.take_stats()
    assert counters(report) == {"failed_loads": {fault: 1}, "failed_load_chunks": {fault: 2}}
    assert report is not None and len(report["histograms"]["load_seconds"]) == 1
    assert worker.take_load_errors() == {4, 5, 6, 7}


def test_dropped_saves_are_counted_by_reason(worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    keys = Namespace("m", FMT).chunk_keys(PROMPT)
    assert worker._pool is not None and worker._paged is not None and worker._writer is not None
    # queue_full: every staging buffer is taken
    held = []
    while (buf := worker._pool.acquire()) is not None:
        held.append(buf)
    worker.save([SaveOp("r1", keys[0], [0, 1])])
    for buf in held:
        worker._pool.release(buf)
    assert counters(worker.take_stats()) == {"dropped_saves": {"queue_full": 1}}

    # error: the copy out of the engine's blocks raises
    real_gather = worker._paged.gather

    def gather(blocks: list[int], out: torch.Tensor) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(worker._paged, "gather", gather)
    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        worker.save([SaveOp("r1", keys[0], [0, 1])])
    monkeypatch.setattr(worker._paged, "gather", real_gather)
    assert counters(worker.take_stats()) == {"dropped_saves": {"error": 1}}

    # error: the write raises (two chunks in one batch)
    def disk_error(*args: Any, **kw: Any) -> Any:
        raise OSError("injected disk error")

    monkeypatch.setattr(worker.store, "save_many", disk_error)
    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        save_prompt(worker)
    assert counters(worker.take_stats()) == {"dropped_saves": {"error": 2}}

    # store_full: the store stored nothing and does not hold the chunk (it did not fit)
    monkeypatch.setattr(worker.store, "save_many", lambda items, *a, **kw: ["no-room"] * len(items))
    save_prompt(worker)
    assert counters(worker.take_stats()) == {"dropped_saves": {"store_full": 2}}
    w = worker.stats()["writer"]
    assert (w["dropped"], w["failed"], w["rejected_full"], w["saved"]) == (1, 3, 2, 0)


# -- through the facade, as vLLM calls it ------------------------------------------------
def test_both_sides_report_through_the_connector_and_add_up(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_hook.vllm import LMCtlConnector

    vllm_config, kv_cache_config = fake_vllm(tmp_path / "store")
    sched = LMCtlConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)  # type: ignore[arg-type]
    work = LMCtlConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)  # type: ignore[arg-type]
    try:
        assert sched.get_kv_connector_stats() is None and work.get_kv_connector_stats() is None
        work.register_kv_caches(kv_caches())
        assert sched.get_num_new_matched_tokens(request("r1"), 0) == (0, False)
        meta = sched.build_connector_meta(step("r1", [0, 1, 2, 3, 4], 0, 80))  # type: ignore[arg-type]
        work.bind_connector_metadata(meta)
        work.wait_for_save()
        work.clear_connector_metadata()
        assert work.flush(10)
        assert sched.get_num_new_matched_tokens(request("r2"), 0) == (64, True)
        blocks: Any = SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8, 9],))
        sched.update_state_after_alloc(request("r2"), blocks, 64)
        work.bind_connector_metadata(sched.build_connector_meta(empty_step()))  # type: ignore[arg-type]
        work.start_load_kv(None)  # type: ignore[arg-type]
        assert work.flush(30)
        work.get_finished(set())
        work.clear_connector_metadata()

        # as vLLM's scheduler does: the workers' stats, plus the scheduler side's
        worker_stats, sched_stats = work.get_kv_connector_stats(), sched.get_kv_connector_stats()
        assert isinstance(worker_stats, LMCtlStats) and isinstance(sched_stats, LMCtlStats)
        total = worker_stats.aggregate(sched_stats)
        c = total.data["counters"]
        # saved: the prompt's two full chunks and its 16-token tail (a record of one block)
        assert c["lookups"] == {"": 2} and c["saved_chunks"] == {"": 3} and c["loaded_chunks"] == {"nvme": 2}
        assert total.reduce()["loaded_bytes"] == 2 * CHUNK
        # the API server rebuilds it from the plain dict it was sent
        rebuilt = LMCtlConnector.build_kv_connector_stats(total.to_dict())
        assert isinstance(rebuilt, LMCtlStats) and rebuilt.reduce() == total.reduce()
        assert sched.get_kv_connector_stats() is None and work.get_kv_connector_stats() is None
    finally:
        sched.shutdown()
        work.shutdown()


def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "engine-hook.md").read_text()
    for m in METRICS:
        assert f"`{m.exposed_name}`" in doc, m.exposed_name
        if m.label:
            assert all(f"`{v}`" in doc for v in m.values), m.key
    assert set(BY_KEY) == {m.key for m in METRICS}
