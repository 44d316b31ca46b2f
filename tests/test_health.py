"""Failures that show: a failing maintenance, failed jobs and the health check
(``lmctl status --check``) on a real daemon over a real Unix socket. Maintenance is made to
fail by fault injection in the daemon's process (a ``sitecustomize`` that breaks
``Store.maintain`` while a flag file exists), everything else for real."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import env_with_path
from redis_server import free_port
from test_cli import lmctl, ok
from test_daemon import TOKENS, Daemon, cli, fill, tokens_file

from lmctl.health import error_line, reasons
from lmctl.terminal import ExitStatus

FAULT = """
import os
import time
_flag = os.environ.get("LMCTL_TEST_MAINTENANCE_FAULT")
if _flag:
    import store.store as _store
    _maintain = _store.Store.maintain

    def maintain(self, *args, **kwargs):
        while os.path.exists(_flag + ".hang"):  # a pass that hangs, as on a frozen disk
            time.sleep(0.05)
        if os.path.exists(_flag):
            [][0]  # IndexError: list index out of range, as the compaction bug of 8 MiB records raised
        return _maintain(self, *args, **kwargs)

    _store.Store.maintain = maintain
"""


def faulty_daemon(tmp_path: Path, extra: tuple[str, ...] = ()) -> tuple[Daemon, Path]:
    """A daemon whose maintenance fails while the returned flag file exists (it does at first)."""
    site = tmp_path / "fault"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULT)
    flag = tmp_path / "maintenance-fails"
    flag.touch()
    env = env_with_path()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    env["LMCTL_TEST_MAINTENANCE_FAULT"] = str(flag)
    fill(tmp_path / "store")
    return Daemon(tmp_path / "store", extra=list(extra), env=env), flag


def wait_for(what: Callable[[], Any], seconds: float = 20) -> Any:
    end = time.time() + seconds
    while time.time() < end:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s")


def check(d: Daemon, *args: str) -> tuple[int, str, str]:
    r = cli(d, "status", "--check", *args)
    return r.returncode, r.stdout, r.stderr


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} is not exported"
    return float(m.group(1))


def test_failing_maintenance_shows_in_status_the_metric_and_the_check(tmp_path: Path) -> None:
    port = free_port()
    d, flag = faulty_daemon(tmp_path, ("--metrics", f"127.0.0.1:{port}"))
    d.start()
    try:
        m = wait_for(lambda: (s := ok(d, "status")["daemon"]["maintenance"])["consecutive_failures"] >= 3 and s)
        assert m["state"] == "failing" and m["failures_total"] >= 3 and m["last_ok_at"] is None
        assert m["last_error"] == "IndexError: list index out of range"
        assert m["failing_since"] <= m["last_error_at"] <= time.time()
        text = lmctl(d, "status").stdout
        line = next(x for x in text.splitlines() if x.startswith("maintenance:"))
        assert re.fullmatch(r"maintenance: FAILING since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, \d+ pass\(es\) in a "
                            r"row \(\d+ in all\); it has not worked yet: IndexError: list index out of range",
                            line), line
        assert "Traceback" not in text and "IndexError(" not in text
        rc, out, err = check(d)
        assert rc == ExitStatus.UNHEALTHY == 1 and err == ""
        assert re.fullmatch(r"maintenance-failing: maintenance failing since .* UTC \(\d+ pass\(es\) in a row, \d+ in "
                            r"all\): IndexError: list index out of range\n", out), out
        r = cli(d, "--json", "status", "--check")
        body = json.loads(r.stdout)
        assert r.returncode == 1 and body["healthy"] is False
        assert [x["code"] for x in body["reasons"]] == ["maintenance-failing"]
        assert scrape(port, "lmctl_daemon_maintenance_failures_total") >= 3

        flag.unlink()  # the fault is mended: the next pass works, and the check passes again
        m = wait_for(lambda: (s := ok(d, "status")["daemon"]["maintenance"])["state"] == "ok" and s)
        assert m["consecutive_failures"] == 0 and m["failing_since"] is None and m["last_ok_at"] is not None
        assert m["failures_total"] >= 3 and m["last_error"] == "IndexError: list index out of range"  # kept
        assert check(d) == (0, "healthy\n", "")
        assert json.loads(cli(d, "--json", "status", "--check").stdout) == {"healthy": True, "reasons": []}
        line = next(x for x in lmctl(d, "status").stdout.splitlines() if x.startswith("maintenance:"))
        assert "failed pass(es) since the daemon started" in line and "IndexError: list index out of range" in line
        assert scrape(port, "lmctl_daemon_maintenance_failures_total") == m["failures_total"]
    finally:
        proc = d.proc
        assert d.stop() == 0
    log = proc.stderr.read() if proc and proc.stderr else ""
    # the first failure of the run logs its traceback once; later ones are a line each
    assert log.count("Traceback") == 1 and "maintenance failed again (2 passes in a row since" in log
    assert "maintenance works again after" in log


def test_a_pass_that_runs_says_since_when(tmp_path: Path) -> None:
    d, flag = faulty_daemon(tmp_path)
    hang = Path(f"{flag}.hang")
    hang.touch()
    flag.unlink()
    d.start()
    try:
        m = wait_for(lambda: (s := ok(d, "status")["daemon"]["maintenance"])["running_since"] and s)
        assert m["state"] == "pending" and m["running_since"] <= time.time()
        assert check(d) == (0, "healthy\n", "")  # stalled only after 10 minutes
        hang.unlink()
        m = wait_for(lambda: (s := ok(d, "status")["daemon"]["maintenance"])["state"] == "ok" and s)
        assert m["consecutive_failures"] == 0
    finally:
        assert d.stop() == 0


def test_maintenance_logs_what_it_did_in_words_not_a_repr(daemon: Daemon, tmp_path: Path) -> None:
    from test_daemon import OTHER

    ok(daemon, "evict", "--tokens", tokens_file(tmp_path, OTHER))  # a third of the segment dies: compacted
    m = wait_for(lambda: (s := ok(daemon, "status")["daemon"]["maintenance"])["last_ok"]
                 and s["last_ok"]["segments_compacted"] and s)
    assert m["state"] == "ok" and set(m["last_ok"]) == {"evicted", "segments_compacted", "bytes_reclaimed",
                                                       "segments_forgotten", "chunks_compressed"}
    line = next(x for x in lmctl(daemon, "status").stdout.splitlines() if x.startswith("maintenance:"))
    assert re.fullmatch(r"maintenance: every 0\.5 s, last pass .* UTC \((nothing to do|compacted .*)\)", line), line
    proc = daemon.proc
    assert daemon.stop() == 0
    log = proc.stderr.read() if proc and proc.stderr else ""
    assert "MaintenanceResult(" not in log
    assert re.search(r"INFO maintenance: compacted 1 segment\(s\) \(\d+\.\d KiB reclaimed\)\n", log), log


def test_failed_jobs_are_kept_and_shown(daemon: Daemon) -> None:
    assert ok(daemon, "status")["failed_jobs"] == []
    for _ in range(2):
        r = lmctl(daemon, "inspect", "--key", "00" * 48)
        assert r.exit_code == 1
    lmctl(daemon, "lookup")  # a usage error is the caller's mistake, not a failed job
    failed = ok(daemon, "status")["failed_jobs"]
    assert [j["cmd"] for j in failed] == ["inspect", "inspect"] and failed[0]["id"] > failed[1]["id"]
    assert failed[0]["at"] <= time.time() and "no chunk" in failed[0]["error"] and "\n" not in failed[0]["error"]
    text = lmctl(daemon, "status").stdout
    assert "failed jobs (the last 2, newest first):" in text
    assert re.search(r"^  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC  job \d+ inspect: .*no chunk", text, re.M), text
    assert check(daemon) == (0, "healthy\n", "")  # failed jobs are shown, not a health problem


def test_the_check_fails_while_a_tier_folder_is_gone_and_recovers(daemon: Daemon) -> None:
    tier = daemon.store / "nvme"
    assert check(daemon) == (0, "healthy\n", "")
    tier.rename(daemon.store / "nvme.away")  # an unmounted disk, a moved folder
    try:
        rc, out, err = check(daemon)
        assert rc == 1 and err == ""
        assert out.startswith("tier-unavailable: tier nvme: none of its segment files is in ") and "is its disk " \
            "mounted" in out
        body = json.loads(cli(daemon, "--json", "status", "--check").stdout)
        assert body["healthy"] is False and "tier-unavailable" in [x["code"] for x in body["reasons"]]
        st = ok(daemon, "status")
        assert st["health"]["healthy"] is False  # the plain status says so too
        assert "health: " in lmctl(daemon, "status").stdout
    finally:
        (daemon.store / "nvme.away").rename(tier)
    assert wait_for(lambda: check(daemon)[0] == 0)
    assert check(daemon) == (0, "healthy\n", "")


def test_the_check_reports_a_tier_over_its_watermark_and_a_nearly_full_pin_budget(tmp_path: Path) -> None:
    from test_daemon import FMT, NS

    from store import Store, StoreConfig

    fill(tmp_path / "store")
    with Store(tmp_path / "store") as s:  # four chunks pinned in a tier they fill beyond 95%: none can go
        s.pin("doc", NS.chunk_keys(TOKENS))
        cfg = StoreConfig.from_json(s.config.to_json())
        cfg.tiers["nvme"].capacity = 4 * (FMT.chunk_bytes + 4096) + 1024
        cfg.tiers["nvme"].pin_budget = 1.0
        s.configure(cfg)
        assert s.stats().tiers["nvme"].disk_bytes > 0.95 * cfg.tiers["nvme"].capacity
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        want = {"tier-above-watermark", "pin-budget-nearly-full"}
        wait_for(lambda: {x["code"] for x in ok(d, "status")["health"]["reasons"]} >= want)
        rc, out, _ = check(d)
        assert rc == 1 and len(out.splitlines()) == 2, out
        assert re.search(r"^tier-above-watermark: tier nvme is \d+\.\d% full .*above its high watermark of 95% "
                         r"after maintenance", out, re.M), out
        assert re.search(r"^pin-budget-nearly-full: tier nvme's pin budget is \d+% used", out, re.M), out
        ok(d, "unpin", "--label", "doc")
        ok(d, "config", "set", "tiers.nvme.capacity=256MiB", "tiers.nvme.pin_budget=0.5")
        assert wait_for(lambda: check(d)[0] == 0)
    finally:
        assert d.stop() == 0


def test_the_check_exits_3_when_no_daemon_answers(tmp_path: Path) -> None:
    sock = tmp_path / "nobody.sock"
    r = cli(None, "status", "--check", sock=str(sock))
    assert r.returncode == ExitStatus.UNREACHABLE == 3 and r.stdout == ""
    assert r.stderr.startswith(f"lmctl: no lmctl daemon on {sock}") and r.stderr.count("\n") == 1
    r = cli(None, "--json", "status", "--check", sock=str(sock))
    body = json.loads(r.stdout)
    assert r.returncode == 3 and body["healthy"] is False and [x["code"] for x in body["reasons"]] == ["unreachable"]
    # a daemon that hangs: the socket takes the connection, nobody ever answers
    hung = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(hung))
        listener.listen(8)
        t0 = time.monotonic()
        r = cli(None, "--json", "status", "--check", "--timeout", "0.5", sock=str(hung))
        assert time.monotonic() - t0 < 20
    body = json.loads(r.stdout)
    assert r.returncode == 3 and body["reasons"][0]["code"] == "unreachable"
    assert "no answer within 0.5 s" in body["reasons"][0]["message"]


def test_health_rules_one_reason_each() -> None:
    """The rules alone, on a status reply: the breaker, reserved pins and the watermark's grace."""
    tier = {"chunks": 1, "bytes": 10, "disk_bytes": 99, "dead_bytes": 0, "capacity": 100, "pinned_bytes": 40,
            "pin_budget": 50}
    status: dict[str, Any] = {
        "daemon": {"maintenance": {"consecutive_failures": 0}},
        "store": {"tiers": {"nvme": tier}, "counters": {"pin_reserved": 5}, "remote_refused": None,
                  "remote": {"url": "redis://cache:6379/0", "breaker": "open", "errors": 7, "timeouts": 3}}}
    got = reasons(status, {}, {}, "nvme")
    assert [x["code"] for x in got] == ["pin-budget-nearly-full", "remote-breaker-open"]  # 45 of 50 pinned
    assert "90% used" in got[0]["message"] and "redis://cache:6379/0" in got[1]["message"]
    assert [x["code"] for x in reasons(status, {}, {}, "dram")] == ["remote-breaker-open"]  # reserved: default tier
    # above the watermark only when the last pass left it there too
    assert "tier-above-watermark" in [x["code"] for x in reasons(status, {}, {"nvme": 0.99}, "nvme")]
    status["store"]["remote"]["breaker"] = "half-open"
    status["store"]["remote_refused"] = "the secret file is missing"
    assert [x["code"] for x in reasons(status, {}, {}, "dram")] == ["tier-unavailable"]
    # a pass that has run for over 10 minutes (or 10 intervals) is stalled: a frozen or hung disk
    status["store"]["remote_refused"] = None
    status["daemon"]["maintenance"] = {"consecutive_failures": 0, "interval_s": 30.0, "running_since": 1000.0}
    assert reasons(status, {}, {}, "dram", now=1000.0 + 599) == []
    [stalled] = reasons(status, {}, {}, "dram", now=1000.0 + 601)
    assert stalled["code"] == "maintenance-stalled" and "(10 min)" in stalled["message"]
    status["daemon"]["maintenance"]["interval_s"] = 3600.0
    assert reasons(status, {}, {}, "dram", now=1000.0 + 601) == []


def test_an_error_line_is_its_type_and_message_on_one_line() -> None:
    assert error_line(IndexError("list index out of range")) == "IndexError: list index out of range"
    assert error_line(KeyError()) == "KeyError"
    assert error_line(OSError("two\nlines\x1b[31m")) == "OSError: two lines [31m"
    assert len(error_line(ValueError("x" * 5000))) == 300
