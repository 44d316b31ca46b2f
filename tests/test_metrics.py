"""Metrics: counts that every process using a store adds to (store/index/metrics.py), and the
daemon's Prometheus exporter (``lmctl serve --metrics``) scraped over HTTP after real traffic:
other processes' puts and reads, and a real vLLM engine's lookups, saves and loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, content, env_with_path, key
from prometheus_client.parser import text_string_to_metric_families
from redis_server import free_port
from test_cli import error, lmctl
from test_daemon import Daemon
from test_vllm_connector import Engine, P, models  # noqa: F401  (the module's model fixture)

from store import MiB, Store, StoreConfig, TierConfig
from store.index.metrics import SECONDS_BUCKETS, Meter

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


LAYOUT = {"dtype": "uint8", "shape": [4096]}
WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from store import Store
    from store.index.metrics import Meter
    s = Store({path!r})
    for i in range({n}):
        k = bytes([i]) * 48
        s.put(k, bytes([i]) * 4096, {layout!r}, tokens=16)
        assert s.get_into(k, bytearray(4096)) is not None
    {finish}
""")


def other_process(path: Path, n: int, finish: str = "s.close()") -> subprocess.Popen[str]:
    code = WRITER.format(root=str(ROOT), path=str(path), n=n, layout=LAYOUT, finish=finish)
    return subprocess.Popen([sys.executable, "-c", code], env=env_with_path(), text=True)


def test_counts_of_every_process_add_up_in_the_index(tmp_path: Path) -> None:
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})):
        pass
    procs = [other_process(tmp_path / "s", 5), other_process(tmp_path / "s", 7)]
    assert [p.wait(120) for p in procs] == [0, 0]
    with Store(tmp_path / "s") as s:
        cells = {(c.name, tuple(sorted(c.labels.items()))): c for c in s.metric_cells()}
        # the two processes wrote the same keys 0-4: five of the twelve puts found them stored
        assert cells[("saves_total", (("tier", "nvme"),))].value == 7
        assert cells[("save_bytes_total", (("tier", "nvme"),))].value == 7 * 4096
        assert cells[("loads_total", (("tier", "nvme"),))].value == 12
        assert cells[("load_bytes_total", (("tier", "nvme"),))].value == 12 * 4096
        h = cells[("load_seconds", (("tier", "nvme"),))]
        assert h.histogram and h.count == 12 and 0 < h.sum < 60 and sum(h.buckets) <= 12
        assert cells[("save_seconds", (("tier", "nvme"),))].count == 7  # the batches that stored something
        # and this process's own counts, written before they are read
        s.put(key(9), content(key(9), 4096), LAYOUT)
        after = {c.name: c for c in s.metric_cells() if c.labels == {"tier": "nvme"}}
        assert after["saves_total"].value == 8


def test_a_quiet_process_flushes_its_counts_by_itself(tmp_path: Path) -> None:
    """A process that counts and then does nothing else (an idle engine) still has its counts
    in the index within ``access_flush_s``."""
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, access_flush_s=0.2)):
        pass
    proc = other_process(tmp_path / "s", 3, finish="import time; time.sleep(60)")
    try:
        deadline = time.monotonic() + 30
        while True:
            with Store(tmp_path / "s", readonly=True) as s:
                loads = sum(c.value for c in s.metric_cells() if c.name == "loads_total")
            if loads == 3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, f"the counts never arrived ({loads})"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def test_gauges_are_the_latest_value_of_each_process_and_age_out(tmp_path: Path) -> None:
    from store.index import metrics as metrics_mod

    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
        s.set_gauge("engine_save_queue", 3, pid="1")
        s.set_gauge("engine_save_queue", 5, pid="1")  # the latest wins
        s.set_gauge("engine_save_queue", 0, pid="2")
        got = {(g.name, g.labels["pid"]): g.value for g in s.metric_gauges()}
        assert got == {("engine_save_queue", "1"): 5, ("engine_save_queue", "2"): 0}
        assert s.metric_gauges(max_age_s=-1) == []  # too old for a reader that wants fresh ones
        m = metrics_mod.Meter()
        assert m.gauge("q", 1, pid="1") and not m.gauge("q", 1, pid="1")  # the same value is not written again
        assert m.gauge("q", 2, pid="1") and len(m.take_gauges()) == 1
    with Store(tmp_path / "s", readonly=True) as again:  # another process reads them
        assert {g.labels["pid"] for g in again.metric_gauges()} == {"1", "2"}


def test_meter_histogram_buckets_and_give_back() -> None:
    m = Meter()
    for x in (0.0001, 0.003, 0.003, 7.0, 99.0):
        m.observe("h", x, tier="nvme")
    m.inc("c", 2, a="1")
    m.inc("c", 0, a="2")  # nothing: no cell
    counts, hists = m.take()
    h = hists[("h", (("tier", "nvme"),))]
    assert h[0] == 5 and h[1] == pytest.approx(106.0061)
    by_bound = dict(zip(SECONDS_BUCKETS, h[2:], strict=True))
    assert (by_bound[0.0005], by_bound[0.005], by_bound[10.0], sum(h[2:])) == (1, 2, 1, 4)  # 99 s: +Inf only
    assert counts == {("c", (("a", "1"),)): 2}
    assert m.take() == ({}, {})
    m.give_back(counts, hists)
    assert m.take() == (counts, hists)


def test_metrics_address_is_checked(tmp_path: Path) -> None:
    for bad, what in (("99999", "the port must be"), ("host.example:9464", "is not an IP address"),
                      ("x", "give PORT or ADDR:PORT")):
        r = lmctl(None, "--json", "serve", "--store", str(tmp_path / "s"), "--metrics", bad)
        assert what in error(r)["message"] and r.exit_code == 2
    assert not (tmp_path / "s").exists()  # refused before anything was created
    import socket

    with socket.socket() as taken:  # a port in use: the daemon cannot start (a failure, not a usage error)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = lmctl(None, "--json", "serve", "--store", str(tmp_path / "s"), "--init", "--metrics", str(port))
        assert r.exit_code == 1 and "cannot listen on 127.0.0.1" in error(r)["message"]
    assert not (tmp_path / "s").exists()  # no store was created: the refused --init left nothing behind


def test_exporter_over_http_after_engine_traffic(models: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """A real daemon's /metrics, scraped before and after a real vLLM engine on the same store
    stored a prompt and then loaded it back: the engine's lookups, hit tokens, saves and loads
    show up in the daemon's scrape (counted in the engine's process, flushed to the index)."""
    store = tmp_path / "store"
    port = free_port()
    with Store(store, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)})):
        pass
    d = Daemon(store, extra=["--metrics", str(port)])
    d.start()
    try:
        before = scrape(port)
        assert value(before, "lmctl_tier_capacity_bytes", tier="nvme") == 256 * MiB
        assert value(before, "lmctl_tier_chunks", tier="nvme") == 0
        assert value(before, "lmctl_daemon_requests_total") >= 0
        eng = Engine(models, store)
        try:
            assert eng.run(P)[1] == 0
            assert eng.run(P)[1] == 512
            model = str(models["base"])  # the served name: vLLM names the model by its folder
        finally:
            eng.close()  # flushes the engine's counts
        after = scrape(port)
    finally:
        assert d.stop() == 0
    who = {"model": model, "adapter": ""}
    assert value(after, "lmctl_lookups_total", **who) == 2
    assert value(after, "lmctl_lookup_hit_tokens_total", **who) == 512
    assert value(after, "lmctl_lookup_miss_tokens_total", **who) == 2 * len(P) - 512
    assert value(after, "lmctl_saves_total", tier="nvme") == 2
    assert value(after, "lmctl_loads_total", tier="nvme") == 2
    assert value(after, "lmctl_load_seconds_count", tier="nvme") == 2
    assert value(after, "lmctl_load_seconds_bucket", tier="nvme", le="+Inf") == 2
    assert value(after, "lmctl_save_bytes_total", tier="nvme") == value(after, "lmctl_load_bytes_total", tier="nvme")
    assert value(after, "lmctl_tier_chunks", tier="nvme") == 2
    assert value(after, "lmctl_tier_bytes", tier="nvme") > 0
    assert value(after, "lmctl_chunk_hits_total") == 2
    # the engine's queues, as it last reported them (drained: it closed after its saves)
    assert ("lmctl_engine_save_queue", (("pid", str(os.getpid())),)) in after
    assert value(after, "lmctl_engine_save_queue", pid=str(os.getpid())) == 0
    assert value(after, "lmctl_engine_loads_in_flight", pid=str(os.getpid())) == 0


def test_exporter_shows_operator_work_and_the_event_totals(tmp_path: Path) -> None:
    """Evictions, pins and a corrupt drop made through a real daemon show in its scrape, by
    reason; a wrong scrape path is a 404, and the daemon carries on."""
    from test_cli import ok
    from test_daemon import TOKENS, fill, tokens_file

    keys = fill(tmp_path / "store")
    port = free_port()
    d = Daemon(tmp_path / "store", extra=["--metrics", f"127.0.0.1:{port}"])
    d.start()
    try:
        ok(d, "pin", "--label", "doc", "--tokens", tokens_file(tmp_path, TOKENS))
        ok(d, "evict", "--key", keys[5].hex())
        got = scrape(port)
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nothing-here", timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code in (404, 200)
        assert ok(d, "status")["daemon"]["pid"] == d.proc.pid if d.proc else False
    finally:
        assert d.stop() == 0
    assert value(got, "lmctl_evictions_total", reason="operator") == 1
    assert value(got, "lmctl_pins_total", reason="pin") + value(got, "lmctl_pins_total", reason="operator") >= 4 or \
        sum(v for (n, _), v in got.items() if n == "lmctl_pins_total") == 4
    assert value(got, "lmctl_tier_chunks", tier="nvme") == 5
    assert value(got, "lmctl_evicted_chunks_total") == 1
    assert value(got, "lmctl_daemon_requests_total") >= 2
    assert ("lmctl_daemon_maintenance_failures_total", ()) in got  # exported, 0 while maintenance works
    assert value(got, "lmctl_daemon_maintenance_failures_total") == 0


# -- lmctl top ----------------------------------------------------------------------------------
def engine_traffic(store: Path, lookups: int) -> None:
    """What an engine's scheduler counts, from another process on the store."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
        from store import Store
        from test_daemon import NS
        with Store({str(store)!r}) as s:
            for _ in range({lookups}):
                s.count_lookup(NS, 48, 64)
            s.set_gauge("engine_save_queue", 2, pid="4711")
            s.set_gauge("engine_loads_in_flight", 1, pid="4711")
    """)
    subprocess.run([sys.executable, "-c", code], env=env_with_path(), check=True, timeout=120)


def test_top_shows_hit_rates_tiers_and_rates(daemon: Daemon) -> None:
    engine_traffic(daemon.store, 3)
    r = lmctl(daemon, "top", "--iterations", "2", "--interval", "0.2")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.count("lmctl top") == 2  # two frames, one after the other (not a terminal)
    assert "engine lookups" in r.stdout and "75%" in r.stdout  # 48 of 64 tokens
    assert "nvme" in r.stdout and "daemon jobs: none running" in r.stdout
    assert lmctl(daemon, "top").stdout.count("lmctl top") == 1  # piped: one frame by default
    view = json.loads(lmctl(daemon, "--json", "top", "--interval", "0.2").stdout)
    assert view["interval_s"] > 0.1
    [eng] = view["engines"]
    assert (eng["model"], eng["adapter"], eng["lookups"], eng["hit_rate"]) == ("m", None, 3, 0.75)
    assert eng["hit_rate_now"] is None  # nothing happened during the interval
    frames = lmctl(daemon, "--json", "top", "--interval", "0.1", "--iterations", "3").stdout.splitlines()
    assert len(frames) == 3 and all(json.loads(f)["interval_s"] > 0.05 for f in frames)  # a JSON line per frame
    assert view["queues"] == {"4711": {"save_queue": 2, "loads_in_flight": 1}}
    assert "engine queues" in r.stdout and "4711" in r.stdout
    nvme = view["tiers"]["nvme"]
    assert nvme["chunks"] == 6 and nvme["loads_per_s"] == 0.0


@pytest.mark.parametrize(("args", "what"), [(("--interval", "0"), "--interval must be between"),
                                            (("--iterations", "-1"), "--iterations must be")])
def test_top_checks_its_options(daemon: Daemon, args: tuple[str, ...], what: str) -> None:
    r = lmctl(daemon, "--json", "top", *args)
    assert r.exit_code == 2 and what in error(r)["message"]


def test_top_refreshes_in_place_until_q(daemon: Daemon, tmp_path: Path) -> None:
    import pexpect

    env = env_with_path()
    env["COLUMNS"] = "120"
    top = pexpect.spawn(sys.executable, ["-m", "lmctl.cli", "--socket", str(daemon.sock), "top", "--interval", "0.2"],
                        env=env, encoding="utf-8", timeout=30)
    try:
        top.expect("lmctl top")
        engine_traffic(daemon.store, 2)
        top.expect("100%|50%|75%")  # a later frame shows the lookups made meanwhile
        top.send("q")
        top.expect(pexpect.EOF)
    finally:
        top.close()
    assert top.exitstatus == 0


def test_the_grafana_dashboard_asks_only_for_metrics_the_exporter_has() -> None:
    """docs/grafana-dashboard.json must not drift from lmctl/metrics.py."""
    import re

    from lmctl.metrics import CELLS, ENDURANCE, EVENT_COUNTERS, GAUGES, STORE_COUNTERS

    known = {"lmctl_" + c for c in CELLS} | {m for m, _ in STORE_COUNTERS.values()} | {
        m for m, _ in EVENT_COUNTERS.values()} | {"lmctl_" + g for g in GAUGES} | {
        "lmctl_tier_chunks", "lmctl_tier_bytes", "lmctl_tier_capacity_bytes", "lmctl_tier_pinned_bytes",
        "lmctl_tier_disk_bytes", "lmctl_write_amplification", "lmctl_daemon_jobs", "lmctl_daemon_requests_total",
        "lmctl_daemon_request_errors_total", "lmctl_daemon_maintenance_failures_total", "lmctl_remote_breaker_state",
        *ENDURANCE}
    exporter = (ROOT / "lmctl" / "metrics.py").read_text()
    assert all(f'"{m}"' in exporter or m[len("lmctl_"):] in CELLS or m[len("lmctl_"):] in GAUGES for m in known)
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    used = {re.sub(r"_(bucket|count|sum)$", "", m) if m.startswith("lmctl_load_seconds") or
            m.startswith("lmctl_save_seconds") else m
            for p in dash["panels"] for t in p["targets"] for m in re.findall(r"lmctl_\w+", t["expr"])}
    assert used and used <= known, used - known
    guide = (ROOT / "docs" / "operator-guide.md").read_text()
    assert all(f"`{m}`" in guide for m in known), [m for m in known if f"`{m}`" not in guide]
