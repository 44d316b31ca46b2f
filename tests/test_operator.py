"""What a new operator runs into: each test is a defect found by using the CLI as an operator
would, run against a real daemon over its Unix socket, with results checked through the store
library."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import fake_engine, flip_byte
from test_daemon import NS, OTHER, TOKENS, Daemon, cj, cli, env_with_path, fill, library, tokens_file

from lmctl.completion import bash_completion_note
from store import AdapterIdentity, GiB, KVFormat, MiB, Namespace, PutItem, Store, StoreConfig, TierConfig
from testsupport.lmctl import run


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    fill(tmp_path / "store", dram=True)
    d = Daemon(tmp_path / "store")
    d.start()
    yield d
    if d.proc is not None:
        assert d.stop() == 0


def serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmctl.cli", *args], capture_output=True, text=True,
                          env=env or env_with_path(), timeout=timeout)


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stderr.count("\n") <= 1, r.stderr


# -- selectors ------------------------------------------------------------------------------
def test_unpinned_selects_unpinned_chunks_in_ls_evict_and_compress(daemon: Daemon, tmp_path: Path) -> None:
    cj(daemon, "pin", "--label", "doc", "--tokens", tokens_file(tmp_path, TOKENS))
    assert cj(daemon, "ls", "--unpinned")["total"] == 2
    assert cj(daemon, "ls", "--pinned")["total"] == 4
    assert cj(daemon, "evict", "--unpinned", "--dry-run")["chunks"] == 2
    assert cj(daemon, "compress", "--unpinned")["chunks"] == 2
    with library(daemon) as s:
        pinned = NS.chunk_keys(TOKENS)
        assert {s.info(k).codec for k in pinned} == {"raw"}  # type: ignore[union-attr]
        assert {s.info(k).codec for k in NS.chunk_keys(OTHER)} == {"zstd-shuffle"}  # type: ignore[union-attr]
    assert cj(daemon, "evict", "--unpinned")["chunks"] == 2
    assert cj(daemon, "ls")["total"] == 4


def test_conflicting_selectors_are_usage_errors(daemon: Daemon) -> None:
    r = cli(daemon, "ls", "--base", "--adapter", "civil")
    assert r.returncode == 2 and "contradict" in r.stderr
    r = cli(daemon, "--json", "unpin", "--label", "a", "--label", "b")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"


def test_an_adapter_name_is_a_name_even_when_a_folder_has_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    civil = AdapterIdentity("civil", "ab" * 16)
    ns = Namespace("m", NS.kv_format, civil)
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)})) as s:
        s.register_namespace(ns, {"model_id": "m"})
        for k in ns.chunk_keys(TOKENS):
            s.put(k, bytes(NS.kv_format.chunk_bytes), {"dtype": "bfloat16"}, tokens=16)
    (tmp_path / "civil").mkdir()  # an unrelated folder of the same name where the operator stands
    (tmp_path / "civil" / "adapter_config.json").write_text("{}")
    d = Daemon(tmp_path / "s")
    d.start()
    monkeypatch.chdir(tmp_path)  # the operator stands next to the folder
    try:
        r = cli(d, "--json", "ls", "--adapter", "civil")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["total"] == 4
        # a path (it has a slash) is a folder: its digest differs, so nothing matches
        r = cli(d, "--json", "ls", "--adapter", "./civil")
        assert r.returncode == 0 and json.loads(r.stdout)["total"] == 0
    finally:
        d.stop()


# -- rewrites -----------------------------------------------------------------------------------
def test_compress_move_and_warm_keep_hits_and_access_times(daemon: Daemon, tmp_path: Path) -> None:
    keys = NS.chunk_keys(TOKENS)
    with library(daemon) as s:
        before = {k: (s.info(k).hits, s.info(k).last_access) for k in keys}  # type: ignore[union-attr]
        counters = s.stats().counters
    time.sleep(1.2)
    cj(daemon, "pin", "--label", "doc", "--tokens", tokens_file(tmp_path, TOKENS))
    assert cj(daemon, "compress", "--label", "doc")["chunks"] == 4
    assert cj(daemon, "move", "--to", "nvme", "--label", "doc", "--dry-run")["skipped"] == 4
    assert cj(daemon, "warm", "--label", "doc")["chunks"] == 4
    assert cj(daemon, "move", "--to", "nvme", "--label", "doc")["chunks"] == 4
    cj(daemon, "status")  # the daemon flushes its pending access times
    with library(daemon) as s:
        after = {k: (s.info(k).hits, s.info(k).last_access) for k in keys}  # type: ignore[union-attr]
        now = s.stats().counters
    assert after == before
    assert (now["hits"], now["misses"]) == (counters["hits"], counters["misses"])
    # so the chunks are still stale to evict --older-than
    assert cj(daemon, "evict", "--older-than", "1s", "--dry-run", "--unpinned")["chunks"] == 2
    assert cj(daemon, "ls", "--older-than", "1s", "--pinned")["total"] == 4


def test_compress_skips_what_is_already_in_that_form_and_reports_growth(daemon: Daemon) -> None:
    est = cj(daemon, "compress", "--model", "m", "--dry-run")
    assert est["chunks"] == 6 and est["estimated"] is True and est["bytes_after"] > 0
    first = cj(daemon, "compress", "--model", "m")
    assert first["chunks"] == 6 and first["bytes_saved"] > 0 and first["estimated"] is False
    # the estimate is made by encoding sampled chunks: close to what compress then did
    assert abs(est["bytes_after"] - first["bytes_after"]) <= 0.1 * first["bytes_after"]
    with library(daemon) as s:
        written = s.stats().counters["written_bytes"]
    again = cj(daemon, "compress", "--model", "m")
    assert again["chunks"] == 0 and again["skipped"] == 6
    assert cj(daemon, "compress", "--model", "m", "--level", "3")["chunks"] == 6  # another level: rewritten
    with library(daemon) as s:
        assert s.stats().counters["written_bytes"] > written
    raw = cj(daemon, "compress", "--model", "m", "--codec", "raw")
    assert raw["chunks"] == 6 and raw["bytes_after"] > raw["bytes_before"] and raw["bytes_saved"] < 0
    r = cli(daemon, "compress", "--model", "m", "--codec", "zstd")
    assert r.returncode == 0 and "saved" in r.stdout
    r = cli(daemon, "compress", "--model", "m", "--codec", "raw")
    assert r.returncode == 0 and "grew by" in r.stdout and "saved 0" not in r.stdout
    assert cj(daemon, "compress", "--model", "m", "--codec", "raw")["chunks"] == 0


# -- jobs: cancel, shutdown, one daemon per store ---------------------------------------------
def _slow_daemon(tmp_path: Path) -> tuple[Daemon, dict[str, str]]:
    fill(tmp_path / "store")
    env = env_with_path()
    env["LMCTL_FAULT_JOB_STEP_DELAY"] = "0.5"  # fault injection: each progress step of a job is slow
    d = Daemon(tmp_path / "store", env=env)
    d.start()
    return d, env


def _wait_job(d: Daemon) -> None:
    end = time.time() + 20
    while time.time() < end:
        if cj(d, "status")["jobs"]:
            return
        time.sleep(0.05)
    raise AssertionError("the job never showed up")


def _client(d: Daemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "lmctl.cli", "--socket", str(d.sock), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with_path())


def test_sigterm_during_a_job_cancels_it_cleanly(tmp_path: Path) -> None:
    d, _env = _slow_daemon(tmp_path)
    job = _client(d, "compress", "--model", "m")
    _wait_job(d)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=30)
    assert job.returncode == 1 and "cancelled" in err and "daemon is stopping" in err and err.count("\n") == 1
    assert d.proc.wait(timeout=30) == 0
    log = d.proc.stderr.read() if d.proc.stderr else ""
    assert "Traceback" not in log and "cannot schedule" not in log
    d.proc = None
    with Store(d.store) as s:
        assert [p for p in s.check(deep=True) if not p.fixed] == []
        codecs = [s.info(k).codec for k in NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)]  # type: ignore[union-attr]
    assert codecs.count("zstd-shuffle") < 6  # stopped part way, every chunk whole


def test_ctrl_c_on_the_client_cancels_its_job(tmp_path: Path) -> None:
    d, _env = _slow_daemon(tmp_path)
    try:
        job = _client(d, "compress", "--model", "m")
        _wait_job(d)
        job.send_signal(signal.SIGINT)
        _out, err = job.communicate(timeout=30)
        assert job.returncode == 130 and "interrupted" in err and "Traceback" not in err
        end = time.time() + 10
        while cj(d, "status")["jobs"] and time.time() < end:
            time.sleep(0.1)
        assert cj(d, "status")["jobs"] == []
        time.sleep(1.0)
        with library(d) as s:
            done = [s.info(k).codec for k in NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)]  # type: ignore[union-attr]
        assert done.count("zstd-shuffle") < 6  # it did not run on to the end
    finally:
        assert d.stop() == 0


def test_one_daemon_per_store_whatever_the_socket(daemon: Daemon, tmp_path: Path) -> None:
    r = serve("serve", "--store", str(daemon.store), "--socket", str(tmp_path / "other.sock"))
    assert r.returncode == 1 and "one daemon per store" in r.stderr and str(daemon.sock) in r.stderr
    no_traceback(r)
    assert not (tmp_path / "other.sock").exists()
    assert cj(daemon, "status")["daemon"]["pid"] == daemon.proc.pid  # type: ignore[union-attr]


def test_the_global_socket_option_applies_to_serve(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    sock = tmp_path / "elsewhere.sock"
    d = Daemon(tmp_path / "store", sock, command=["--socket", str(sock), "serve", "--store", str(tmp_path / "store")])
    d.start()  # waits for the daemon on the global option's socket
    try:
        assert not (tmp_path / "store" / "lmctl.sock").exists()
    finally:
        assert d.stop() == 0


# -- serve: settings, --init, validation ----------------------------------------------------------
def test_serve_refuses_a_typod_store_and_bad_settings(tmp_path: Path) -> None:
    typo = tmp_path / "sotre"
    r = serve("serve", "--store", str(typo))
    assert r.returncode == 2 and "--init" in r.stderr and not typo.exists()
    no_traceback(r)
    (tmp_path / "file").write_text("x")
    r = serve("serve", "--store", str(tmp_path / "file"))
    assert r.returncode == 2 and "is a file" in r.stderr
    no_traceback(r)
    r = serve("serve", "--store", "/proc/self/no/such/place", "--init")
    assert r.returncode == 1 and "cannot create" in r.stderr
    no_traceback(r)
    fill(tmp_path / "store")
    for interval in ("0", "-1"):
        r = serve("serve", "--store", str(tmp_path / "store"), "--maintenance-interval", interval, timeout=10)
        assert r.returncode == 2 and "maintenance-interval" in r.stderr
        no_traceback(r)
    r = serve("serve", "--store", str(tmp_path / "store"), "--capacity", "10", timeout=10)
    assert r.returncode == 2 and "no unit" in r.stderr
    r = serve("serve", "--store", str(tmp_path / "store"), "--set", "codec=lz77", timeout=10)
    assert r.returncode == 2 and "codec" in r.stderr
    with library(Daemon(tmp_path / "store")) as s:  # nothing was applied
        assert s.config.tiers["nvme"].capacity == 256 * MiB and s.config.codec == "raw"


def test_serve_init_config_file_and_flags_then_config_show_and_set(tmp_path: Path) -> None:
    conf = tmp_path / "lmctl.toml"
    conf.write_text(f'''
[daemon]
socket = "{tmp_path / 'd.sock'}"
maintenance_interval = "5s"

[store]
codec = "zstd-shuffle"
retire_after_s = "2h"

[tiers.nvme]
capacity = "2GiB"
pin_budget = 0.25

[tiers.dram]
capacity = "64MiB"
path = "{tmp_path / 'shm'}"
''')
    d = Daemon(tmp_path / "new", tmp_path / "d.sock", command=[  # the socket comes from the config file
        "serve", "--store", str(tmp_path / "new"), "--init", "--config", str(conf), "--capacity", "nvme=1GiB",
        "--pin-budget", "0.3"])
    d.start()
    try:
        shown = cj(d, "config", "show")["settings"]
        assert shown["codec"] == "zstd-shuffle" and shown["retire_after_s"] == 7200
        assert shown["tiers"]["nvme"]["capacity"] == GiB and shown["tiers"]["nvme"]["pin_budget"] == 0.3
        assert shown["tiers"]["dram"]["capacity"] == 64 * MiB
        r = cj(d, "config", "set", "tiers.nvme.capacity=3GiB", "codec_level=3")
        assert r["settings"]["tiers"]["nvme"]["capacity"] == 3 * GiB and r["changed"] == ["codec_level",
                                                                                          "tiers.nvme.capacity"]
        bad = cli(d, "--json", "config", "set", "tiers.nvme.capacity=lots")
        assert bad.returncode == 2 and json.loads(bad.stdout)["error"]["code"] == "usage"
        bad = cli(d, "config", "set", "tiers.tape.capacity=1GiB")
        assert bad.returncode == 2 and "tape" in bad.stderr
        assert cli(d, "config", "set", "nonsense=1").returncode == 2
        r = cj(d, "config", "set", "compress_cold_after_s=6h")
        assert r["settings"]["compress_cold_after_s"] == 6 * 3600 and r["changed"] == ["compress_cold_after_s"]
        assert cli(d, "config", "set", "compress_cold_after_s=-1h").returncode == 2
    finally:
        assert d.stop() == 0
    with Store(d.store, readonly=True) as s:  # recorded in the store
        assert s.config.tiers["nvme"].capacity == 3 * GiB and s.config.codec_level == 3
        assert s.config.tiers["dram"].path == str(tmp_path / "shm")


# -- errors: one line, one rule --------------------------------------------------------------------
def test_bad_input_gets_one_line_never_a_traceback(daemon: Daemon, tmp_path: Path) -> None:
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    r = cli(daemon, "lookup", "--file", str(binary))
    assert r.returncode == 2 and "not UTF-8" in r.stderr
    no_traceback(r)
    r = cli(daemon, "--json", "lookup", "--file", str(binary))
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"
    r = cli(daemon, "warm", "--endpoint", "notaurl", "--tokens", tokens_file(tmp_path, TOKENS))
    assert r.returncode == 2 and "not a URL" in r.stderr
    no_traceback(r)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    for opt in ("--messages", "--tokens"):
        r = cli(daemon, "lookup", opt, str(empty))
        assert r.returncode == 2 and "non-empty" in r.stderr, r.stderr
        no_traceback(r)
    strings = tmp_path / "strings.json"
    strings.write_text('["a", "b"]')
    r = cli(daemon, "pin", "--label", "x", "--tokens", str(strings))
    assert r.returncode == 2
    r = cli(daemon, "unpin", "--label", "never-made")
    assert r.returncode == 2 and "no label" in r.stderr
    r = cli(daemon, "ls", "--label", "never-made")
    assert r.returncode == 2 and "no label" in r.stderr
    r = cli(daemon, "ls", "--model", "nope")
    assert r.returncode == 2 and "models: m" in r.stderr
    # option parsing errors under --json print the JSON error object too
    for argv in (["ls", "--limit", "-1"], ["lookup", "--frobnicate"], ["frobnicate"]):
        r = cli(daemon, "--json", *argv)
        assert r.returncode == 2 and json.loads(r.stdout)["error"]["exit"] == 2, argv
    r = cli(daemon, "ls", "--limit", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_pin_dry_run_enforces_the_pin_budget(tmp_path: Path) -> None:
    fmt = NS.kv_format
    budget = 2 * fmt.chunk_bytes
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB, pin_budget=budget)})) as s:
        s.register_namespace(NS, {"model_id": "m"})
        for k in NS.chunk_keys(TOKENS):
            s.put(k, bytes(fmt.chunk_bytes), {"dtype": "bfloat16"}, tokens=16)
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        doc = tokens_file(tmp_path, TOKENS)
        dry = cli(d, "pin", "--label", "big", "--tokens", doc, "--dry-run")
        real = cli(d, "pin", "--label", "big", "--tokens", doc)
        assert dry.returncode == real.returncode == 1
        assert "pin budget" in dry.stderr and dry.stderr == real.stderr
        ok = cj(d, "pin", "--label", "one", "--key", NS.chunk_keys(TOKENS)[0].hex(), "--dry-run")
        assert ok["added"] == 1 and ok["dry_run"] is True
        with library(d) as s:
            assert s.labels() == {}
    finally:
        d.stop()


def test_evict_force_says_it_removed_pinned_chunks_and_budgets_stay_consistent(daemon: Daemon,
                                                                                tmp_path: Path) -> None:
    cj(daemon, "pin", "--label", "doc", "--tokens", tokens_file(tmp_path, TOKENS))
    r = cj(daemon, "evict", "--model", "m", "--force")
    assert r["chunks"] == 6 and r["pinned_removed"] == 4 and r["skipped_pinned"] == 0
    human = cli(daemon, "evict", "--label", "doc", "--force", "--dry-run")
    assert human.returncode == 0
    assert cj(daemon, "verify")["ok"] is True  # counters (pinned bytes, reserved pin budget) agree with the index
    with library(daemon) as s:
        assert [s.pin_refs(k) for k in NS.chunk_keys(TOKENS)] == [1] * 4
        assert s.stats().tiers["nvme"].pinned_bytes == 0


def test_key_columns_show_the_chunk_hash_not_the_namespace(daemon: Daemon, tmp_path: Path) -> None:
    keys = NS.chunk_keys(TOKENS)
    for argv in (["ls"], ["lookup", "--tokens", tokens_file(tmp_path, TOKENS)]):
        r = cli(daemon, *argv)
        assert r.returncode == 0
        assert all(k.hex()[32:44] in r.stdout for k in keys), r.stdout
        assert keys[0].hex()[:12] not in r.stdout
    flip_byte_in(daemon, keys[1])
    r = cli(daemon, "verify", "--deep")
    assert r.returncode == 1 and keys[1].hex()[32:48] in r.stdout and keys[1].hex()[:16] not in r.stdout
    # what --deep found, the command it suggests fixes
    assert "run lmctl verify --deep --fix" in r.stdout
    assert cli(daemon, "verify", "--deep", "--fix").returncode == 0
    assert cli(daemon, "verify", "--deep").returncode == 0


def flip_byte_in(d: Daemon, key: bytes) -> None:
    with library(d) as s:
        flip_byte(s, key)


def test_lookup_by_key_has_the_document_fields(daemon: Daemon) -> None:
    keys = NS.chunk_keys(TOKENS)
    r = cj(daemon, "lookup", "--key", keys[0].hex(), "--key", keys[1].hex(), "--key", "ab" * 48)
    assert r["chunk_size"] == 16 and r["tiers"] == {"nvme": 2} and r["hit_chunks"] == 2
    assert r["namespace"]["model"] == "m" and r["total_tokens"] == 48 and r["first_miss"] == 32


def test_ls_of_every_chunk_streams_past_the_frame_limit(tmp_path: Path) -> None:
    fmt = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=1, chunk_size=16)
    ns = Namespace("big", fmt)
    n = 22000  # each row is about 400 bytes of JSON: the listing is over the 8 MiB frame limit
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=4 * GiB)}, fsync=False)) as s:
        s.register_namespace(ns, {"model_id": "big"})
        keys = ns.chunk_keys(list(range(16 * n)))
        for i in range(0, n, 2000):
            s.put_many([PutItem(k, b"x" * 32, {"dtype": "uint8", "shape": [32]}, 16) for k in keys[i : i + 2000]])
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        r = cli(d, "--json", "ls", "--limit", "0")
        assert r.returncode == 0, r.stdout[-300:] + r.stderr
        out = json.loads(r.stdout)
        assert len(r.stdout) > 8 << 20
        assert out["total"] == n and len(out["chunks"]) == n and out["truncated"] is False
        assert {c["key"] for c in out["chunks"]} == {k.hex() for k in keys}
        assert cj(d, "ls", "--limit", "5")["truncated"] is True
    finally:
        d.stop()


# -- warm --endpoint ---------------------------------------------------------------------------
def test_warm_endpoint_with_v1_posts_once_to_the_api(daemon: Daemon, tmp_path: Path) -> None:
    with fake_engine() as (url, requests):
        doc = tokens_file(tmp_path, OTHER + [7] * 40)  # the last 40 tokens are missing
        # the fake engine stores nothing: the missing chunks stay missing (exit 1 without --allow-missing)
        r = cj(daemon, "warm", "--endpoint", url + "/v1", "--tokens", doc, "--allow-missing")
        assert [path for path, _body in requests] == ["/v1/completions"]
        assert r["prefill"]["endpoint"] == url and r["to"] == "dram" and r["chunks"] == 2


def test_warm_without_dram_reports_the_documented_json(tmp_path: Path) -> None:
    fill(tmp_path / "s")
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        r = cli(d, "--json", "warm", "--endpoint", "http://127.0.0.1:9/v1", "--tokens",
                tokens_file(tmp_path, TOKENS), "--dry-run")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert "note" not in out and out["to"] is None and out["prefill"]["hit_tokens_before"] == 64
    finally:
        d.stop()


# -- completion ------------------------------------------------------------------------------------
def test_bash_completion_install_says_how_to_load_it_without_bash_completion(tmp_path: Path) -> None:
    fw = tmp_path / "bash_completion"
    note = bash_completion_note("/home/u/script", (str(fw),))
    assert note is not None and "source /home/u/script" in note
    fw.write_text("")
    assert bash_completion_note("/home/u/script", (str(fw),)) is None
    r = run("completion", "install", "--shell", "bash", env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0
    have_framework = any(os.path.exists(p) for p in ("/usr/share/bash-completion/bash_completion",
                                                     "/etc/bash_completion"))
    assert ("source " in r.stdout) is not have_framework


# -- found by a fresh-eyes review -----------------------------------------------------------------
def test_sizes_and_budgets_an_operator_mistypes_are_refused(daemon: Daemon, tmp_path: Path) -> None:
    cj(daemon, "pin", "--label", "doc", "--tokens", tokens_file(tmp_path, TOKENS))
    for setting, why in (("tiers.nvme.capacity=10", "no unit"), ("tiers.nvme.capacity=1KiB", "too small"),
                         ("tiers.nvme.capacity=1e400GiB", "too large"), ("tiers.nvme.pin_budget=1.5", "fraction"),
                         ("tiers.nvme.pin_budget=4KiB", "of pinned chunks"), ("codec_level=nan", "number")):
        r = cli(daemon, "config", "set", setting)
        assert r.returncode == 2 and why in r.stderr, (setting, r.stderr)
        no_traceback(r)
    with library(daemon) as s:
        assert s.config.tiers["nvme"].capacity == 256 * MiB and s.config.tiers["nvme"].pin_budget == 0.5
    assert cj(daemon, "ls")["total"] == 6


def test_a_bare_capacity_in_the_config_file_is_refused(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    for body in ("[tiers.nvme]\ncapacity = 10\n", "[daemon]\nallow_uid = \"x\"\n", "[store]\ncodec = 3\n"):
        conf = tmp_path / "bad.toml"
        conf.write_text(body)
        r = serve("serve", "--store", str(tmp_path / "store"), "--config", str(conf), timeout=20)
        assert r.returncode == 2, (body, r.stderr)
        no_traceback(r)
    r = serve("serve", "--store", str(tmp_path / "store"), "--capacity", "1e400GiB", timeout=20)
    assert r.returncode == 2
    no_traceback(r)
    with Store(tmp_path / "store", readonly=True) as s:
        assert s.config.tiers["nvme"].capacity == 256 * MiB and len(list(s.iter_chunks())) == 6


def test_more_contradictions_and_unknown_names_are_usage_errors(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    key = NS.chunk_keys(TOKENS)[0].hex()
    for argv in (["evict", "--pinned", "--unpinned"], ["lookup", "--key", key, "--tokens", doc],
                 ["lookup", "--adapter", "civil@0000", "--tokens", doc]):
        r = cli(daemon, *argv)
        assert r.returncode == 2, (argv, r.stderr)
        no_traceback(r)
    assert cj(daemon, "ls")["total"] == 6  # nothing was evicted
    # option parsing errors are one line too, naming where to look
    for argv in (["move", "--model", "m"], ["ls", "--limit", "abc"], ["frobnicate"]):
        r = cli(daemon, *argv)
        assert r.returncode == 2 and r.stderr.startswith("lmctl: ") and r.stderr.count("\n") == 1, r.stderr
    # --older-than 0s is a filter (everything), not "no selector"
    assert cj(daemon, "ls", "--older-than", "0s")["total"] == 6
    assert cj(daemon, "compress", "--model", "m", "--codec", "raw")["level"] is None


def test_warm_checks_the_document_before_posting_and_names_the_one_model(daemon: Daemon, tmp_path: Path) -> None:
    with fake_engine() as (url, requests):
        empty = tmp_path / "empty.json"
        empty.write_text("[]")
        r = cli(daemon, "warm", "--endpoint", url, "--messages", str(empty))
        assert r.returncode == 2 and requests == []  # refused before anything reached the engine
        r = cli(daemon, "warm", "--endpoint", url, "--tokens", tokens_file(tmp_path, OTHER + [5] * 20),
                "--allow-missing")  # the fake engine stores nothing
        assert r.returncode == 0, r.stderr
        assert len(requests) == 1 and requests[0][1]["model"] == "m"  # the store's one model


def test_the_shell_takes_json_before_the_command(daemon: Daemon) -> None:
    r = run("--socket", str(daemon.sock), "shell", stdin="--json status\nls --limit abc\nexit\n",
            env={**os.environ, "HOME": str(daemon.store.parent)})
    assert r.returncode == 2  # a script's failed line (the usage error) is its exit status
    assert '"daemon": {' in r.stdout and "unknown command" not in r.stderr
    assert "lmctl: " in r.stderr and "Usage:" not in r.stderr + r.stdout
