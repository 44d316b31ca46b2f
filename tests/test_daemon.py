"""The daemon and the CLI as operators use them: real processes, a real Unix socket, a real
store; results checked through the store library."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, SMALL_FMT, SMALL_LAYOUT, content, env_with_path

from lmctl import protocol
from store import MiB, Namespace, Store, StoreConfig, TierConfig
from testsupport.lmctl import Daemon, run, run_process

FMT = SMALL_FMT
LAYOUT = SMALL_LAYOUT
NS = Namespace("m", FMT)
TOKENS = list(range(100, 164))      # four chunks
OTHER = list(range(500, 532))       # two chunks, never pinned


def fill(path: Path, dram: bool = False) -> list[bytes]:
    tiers = {"nvme": TierConfig(capacity=256 * MiB)}
    if dram:
        tiers["dram"] = TierConfig(capacity=64 * MiB, path=str(path / "dram-tier"))
    with Store(path, StoreConfig(tiers=tiers, segment_bytes=4 * MiB)) as s:
        s.register_namespace(NS, {"model_id": "m", "tokenizer": None})
        keys = NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)
        zeros = bytes(FMT.chunk_bytes)
        for i, k in enumerate(keys):
            data = zeros if i < 4 else content(k, FMT.chunk_bytes)  # the document compresses well
            assert s.put(k, data, LAYOUT, tokens=16)
    return keys



def cli(d: Daemon | None, *args: str, stdin: str | None = None,
        sock: str | None = None) -> subprocess.CompletedProcess[str]:
    """``lmctl [--socket SOCK] ARGS`` run in this process (testsupport's ``run``: the program's
    entry point, its streams captured); ``cli_process`` where the process itself is tested."""
    target = sock or (str(d.sock) if d is not None else None)
    pre = ["--socket", target] if target else []
    return run(*pre, *args, stdin=stdin)


def cli_process(d: Daemon | None, *args: str, stdin: str | None = None,
                sock: str | None = None) -> subprocess.CompletedProcess[str]:
    """``lmctl [--socket SOCK] ARGS`` as a process of its own: exit statuses through a real
    process, start-up, signals, peer checks."""
    target = sock or (str(d.sock) if d is not None else None)
    pre = ["--socket", target] if target else []
    return run_process(*pre, *args, stdin=stdin)


def cj(d: Daemon, *args: str) -> Any:
    r = cli(d, "--json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def tokens_file(tmp_path: Path, toks: list[int], name: str = "doc.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(toks))
    return str(p)


def library(d: Daemon) -> Store:
    return Store(d.store, readonly=True)


# -- commands --------------------------------------------------------------------------------
def test_status_lookup_inspect_ls(daemon: Daemon, tmp_path: Path) -> None:
    st = cj(daemon, "status")
    assert daemon.proc is not None
    assert st["daemon"]["pid"] == daemon.proc.pid and st["store"]["tiers"]["nvme"]["chunks"] == 6
    doc = tokens_file(tmp_path, TOKENS + [1, 2, 3])
    r = cj(daemon, "lookup", "--tokens", doc)
    # every full chunk hits: the last 3 tokens are less than a chunk, which is never stored
    assert r["total_tokens"] == 67 and r["hit_tokens"] == 64 and r["first_miss"] is None
    assert [c["tier"] for c in r["chunks"]] == ["nvme"] * 4
    assert [c["key"] for c in r["chunks"]] == [k.hex() for k in NS.chunk_keys(TOKENS)]
    half = tokens_file(tmp_path, TOKENS[:40] + [9] * 30, "half.json")
    r = cj(daemon, "lookup", "--tokens", half)
    assert r["hit_tokens"] == 32 and [c["tier"] for c in r["chunks"]] == ["nvme", "nvme", None, None]
    ins = cj(daemon, "inspect")
    assert ins["chunks"] == 6 and ins["tiers"]["nvme"]["chunks"] == 6
    assert ins["tiers"]["nvme"]["capacity"] == 256 * MiB
    assert ins["adapters"][0]["adapter"] is None and ins["adapters"][0]["chunks"] == 6
    one = cj(daemon, "inspect", "--key", NS.chunk_keys(TOKENS)[0].hex())["chunk"]
    assert one["tokens"] == 16 and one["model"] == "m" and one["pins"] == 0
    ls = cj(daemon, "ls", "--model", "m", "--limit", "2")
    assert ls["total"] == 6 and len(ls["chunks"]) == 2 and ls["truncated"] is True
    # human output: a table with human sizes
    r = cli(daemon, "inspect")
    assert r.returncode == 0 and "nvme" in r.stdout and "MiB" in r.stdout
    r = cli(daemon, "inspect", "--key", NS.chunk_keys(TOKENS)[0].hex())  # times as dates and ages, not epochs
    assert r.returncode == 0 and re.search(r"created +│ 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} \(\d+[smhd] ago\)",
                                                r.stdout)
    r = cli(None, "status", sock=str(tmp_path))  # a folder given as the socket: said so, exit 3
    assert r.returncode == 3 and "not a socket" in r.stderr and r.stderr.count("\n") == 1


def test_pin_unpin_evict_compress_and_dry_runs(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    keys = NS.chunk_keys(TOKENS)
    other = NS.chunk_keys(OTHER)

    before = cj(daemon, "ls", "--limit", "0")
    for args in (["pin", "--label", "d", "--tokens", doc], ["evict", "--model", "m"],
                 ["compress", "--model", "m", "--level", "3"], ["move", "--to", "nvme", "--model", "m"]):
        r = cj(daemon, *args, "--dry-run")
        assert r["dry_run"] is True
    assert cj(daemon, "ls", "--limit", "0") == before  # nothing changed
    with library(daemon) as s:
        assert s.labels() == {} and all(t == "nvme" for t in s.locate(keys + other))

    r = cj(daemon, "pin", "--label", "d", "--tokens", doc)
    assert r == {"label": "d", "chunks": 4, "stored": 4, "added": 4, "dry_run": False}
    with library(daemon) as s:
        assert [s.pin_refs(k) for k in keys] == [1] * 4 and s.pin_refs(other[0]) == 0

    r = cj(daemon, "evict", "--model", "m")
    assert r["chunks"] == 2 and r["skipped_pinned"] == 4 and r["bytes"] > 0
    with library(daemon) as s:
        assert s.locate(keys) == ["nvme"] * 4 and s.locate(other) == [None, None]
    assert cj(daemon, "evict", "--label", "d", "--dry-run")["chunks"] == 0

    r = cj(daemon, "compress", "--label", "d", "--level", "3")
    assert r["chunks"] == 4 and r["bytes_saved"] > 0.9 * r["bytes_before"]
    with library(daemon) as s:
        assert all(i is not None and i.codec == "zstd-shuffle" for i in (s.info(k) for k in keys))
        got = s.get(keys[0])
        assert got is not None and bytes(got.data) == bytes(FMT.chunk_bytes)

    assert cj(daemon, "unpin", "--label", "d", "--dry-run")["removed"] == 4
    with library(daemon) as s:
        assert s.pin_refs(keys[0]) == 1
    assert cj(daemon, "unpin", "--label", "d")["removed"] == 4
    with library(daemon) as s:
        assert s.pin_refs(keys[0]) == 0 and s.labels() == {}
    assert cj(daemon, "evict", "--key", keys[0].hex())["chunks"] == 1
    v = cj(daemon, "verify", "--deep")
    assert v["ok"] is True and v["problems"] == []


def test_pin_a_document_never_served_then_it_is_protected(daemon: Daemon, tmp_path: Path) -> None:
    new = list(range(900, 948))
    r = cj(daemon, "pin", "--label", "future", "--tokens", tokens_file(tmp_path, new))
    assert r["chunks"] == 3 and r["stored"] == 0 and r["added"] == 3
    with Store(daemon.store) as s:  # an engine stores it later
        for k in NS.chunk_keys(new):
            s.put(k, bytes(FMT.chunk_bytes), LAYOUT, tokens=16)
    assert cj(daemon, "evict", "--model", "m")["skipped_pinned"] == 3
    with library(daemon) as s:
        assert s.locate(NS.chunk_keys(new)) == ["nvme"] * 3


def test_pins_survive_a_daemon_restart(daemon: Daemon, tmp_path: Path) -> None:
    cj(daemon, "pin", "--label", "keep", "--tokens", tokens_file(tmp_path, TOKENS))
    assert daemon.stop() == 0
    daemon.start()
    ls = cj(daemon, "ls", "--pinned")
    assert ls["total"] == 4 and all(c["pins"] == 1 for c in ls["chunks"])
    assert cj(daemon, "inspect")["labels"] == {"keep": 4}
    assert cj(daemon, "evict", "--model", "m")["chunks"] == 2


def test_move_and_warm_need_a_configured_tier(daemon: Daemon, tmp_path: Path) -> None:
    # an unconfigured tier is a usage error (2) in every command, with one line
    r = cli(daemon, "move", "--to", "dram", "--model", "m")
    assert r.returncode == 2 and "tier dram is not configured" in r.stderr and r.stderr.count("\n") == 1
    r = cli(daemon, "--json", "warm", "--model", "m")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"
    r = cli(daemon, "--json", "ls", "--tier", "dram")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"
    r = cli(daemon, "move", "--to", "floppy", "--model", "m")
    assert r.returncode == 2


def test_move_and_warm_into_dram(tmp_path: Path) -> None:
    keys = fill(tmp_path / "s", dram=True)
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        cj(d, "pin", "--label", "hot", "--tokens", tokens_file(tmp_path, TOKENS))
        r = cj(d, "warm", "--label", "hot")
        assert r["chunks"] == 4 and r["to"] == "dram"
        r = cj(d, "move", "--to", "dram", "--key", keys[4].hex())
        assert r["chunks"] == 1
        with library(d) as s:
            assert s.locate(keys) == ["dram"] * 5 + ["nvme"]
            assert [s.pin_refs(k) for k in keys[:4]] == [1] * 4
        assert cj(d, "move", "--to", "nvme", "--tier", "dram")["chunks"] == 5
        with library(d) as s:
            assert s.locate(keys) == ["nvme"] * 6
    finally:
        assert d.stop() == 0


# -- errors and the protocol ------------------------------------------------------------------
def test_errors_are_one_line_with_exit_codes(daemon: Daemon, tmp_path: Path) -> None:
    """Through a real process: exit statuses and one line on stderr, as a shell sees them."""
    r = cli_process(daemon, "pin", "--tokens", tokens_file(tmp_path, TOKENS))
    assert r.returncode == 2 and r.stderr.startswith("lmctl: ") and r.stderr.count("\n") == 1
    r = cli_process(daemon, "--json", "lookup")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "usage"
    r = cli_process(daemon, "--json", "inspect", "--key", "00" * 48)
    assert r.returncode == 1 and "no chunk" in json.loads(r.stdout)["error"]["message"]
    r = cli_process(daemon, "lookup", "--tokens", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = cli_process(daemon, "ls", "--older-than", "soon")
    assert r.returncode == 2
    r = cli_process(daemon, "frobnicate")
    assert r.returncode == 2
    # global options after the command work too
    r = cli_process(None, "lookup", "--tokens", tokens_file(tmp_path, TOKENS), "--json", "--socket", str(daemon.sock))
    assert r.returncode == 0 and json.loads(r.stdout)["hit_tokens"] == 64


def test_no_daemon_exits_3_naming_the_socket(tmp_path: Path) -> None:
    sock = str(tmp_path / "nobody.sock")
    r = cli_process(None, "status", sock=sock)
    assert r.returncode == 3 and sock in r.stderr and r.stderr.count("\n") == 1
    r = cli_process(None, "--json", "lookup", "--key", "00" * 48, sock=sock)
    assert r.returncode == 3 and json.loads(r.stdout)["error"]["code"] == "unreachable"


def _raw(d: Daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(d.sock))
    return s


def _reply(s: socket.socket) -> dict[str, Any]:
    """The daemon's next message on ``s``; it must not have hung up."""
    r = protocol.read_frame(s)
    assert r is not None, "the daemon closed the connection"
    return r


def test_bad_requests_get_error_replies_and_the_daemon_serves_on(daemon: Daemon) -> None:
    steady = _raw(daemon)  # a well-behaved client connected the whole time
    protocol.send(steady, {"id": 1, "cmd": "status", "args": {}})
    assert _reply(steady)["ok"] is True

    s = _raw(daemon)  # unknown command, then wrong argument types: errors, connection kept
    protocol.send(s, {"id": 1, "cmd": "explode", "args": {}})
    r = _reply(s)
    assert r["ok"] is False and r["error"]["code"] == "usage" and "unknown command" in r["error"]["message"]
    protocol.send(s, {"id": 2, "cmd": "pin", "args": {"label": 5, "keys": "nope"}})
    r = _reply(s)
    assert r["id"] == 2 and r["error"]["code"] == "usage"
    protocol.send(s, {"id": 3, "cmd": "ls", "args": {"limit": "ten"}})
    assert _reply(s)["error"]["code"] == "usage"
    protocol.send(s, {"id": 4, "cmd": "lookup", "args": []})
    assert _reply(s)["error"]["code"] == "usage"
    protocol.send(s, {"id": 5, "cmd": "status", "args": {}})
    assert _reply(s)["ok"] is True
    s.close()

    for junk in (b"GET / HTTP/1.1\r\n\r\n", struct.pack(">2sBxI", b"LM", 1, 1 << 30),
                 struct.pack(">2sBxI", b"LM", 9, 2) + b"{}", struct.pack(">2sBxI", b"LM", 1, 5) + b"[1,2}",
                 struct.pack(">2sBxI", b"LM", 1, 5) + b"[1,2]"):
        s = _raw(daemon)
        s.sendall(junk)
        r = _reply(s)
        assert r["ok"] is False and r["error"]["code"] == "protocol"
        try:  # then it hangs up (a reset when unread junk was left behind)
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        s.close()

    protocol.send(steady, {"id": 2, "cmd": "status", "args": {}})
    r = _reply(steady)
    assert r["ok"] is True and r["result"]["daemon"]["errors"] >= 8
    steady.close()
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_a_client_that_stalls_mid_frame_is_dropped_at_the_deadline(tmp_path: Path) -> None:
    """A frame header and part of its body, then nothing: once the frame deadline has passed
    the daemon answers a protocol error and hangs up; everyone else is served meanwhile."""
    fill(tmp_path / "store")
    env = env_with_path()
    env["LMCTL_FRAME_TIMEOUT_S"] = "1.5"
    d = Daemon(tmp_path / "store", env=env)
    d.start()
    try:
        steady = _raw(d)
        staller = _raw(d)
        staller.sendall(struct.pack(">2sBxI", b"LM", protocol.VERSION, 100) + b'{"id": 1, ')
        stalled_at = time.monotonic()
        served = 0
        while time.monotonic() - stalled_at < 1.0:  # the stall holds up no one
            for s in (steady, _raw(d)):
                asked = time.monotonic()
                protocol.send(s, {"id": 1, "cmd": "status", "args": {}})
                r = protocol.read_frame(s, 5)
                assert r is not None and r["ok"] is True and time.monotonic() - asked < 0.5
                served += 1
                if s is not steady:
                    s.close()
            time.sleep(0.1)
        assert served >= 4
        r = protocol.read_frame(staller, 10)
        waited = time.monotonic() - stalled_at
        assert r is not None and r["ok"] is False and r["error"]["code"] == "protocol", r
        assert "not received within" in r["error"]["message"]
        assert 1.3 <= waited < 5, waited
        try:  # then it hangs up
            assert staller.recv(1) == b""
        except ConnectionResetError:
            pass
        staller.close()
        protocol.send(steady, {"id": 2, "cmd": "status", "args": {}})
        r = protocol.read_frame(steady, 5)
        assert r is not None and r["ok"] is True and r["result"]["daemon"]["errors"] == 1
        assert r["result"]["daemon"]["clients"] == 1  # the staller's connection is gone
        steady.close()
        assert d.proc is not None and d.proc.poll() is None
    finally:
        assert d.stop() == 0


def test_socket_is_private_and_other_uids_are_refused(tmp_path: Path) -> None:
    import tempfile

    fill(tmp_path / "store")
    run_dir = Path(tempfile.mkdtemp(prefix="lmctl-peer-"))  # reachable by another uid
    try:
        os.chmod(run_dir, 0o755)
        d = Daemon(tmp_path / "store", run_dir / "lmctl.sock")
        d.start()
        try:
            assert (d.sock.stat().st_mode & 0o777) == 0o600
            if os.getuid() != 0:
                pytest.skip("needs root to connect as another uid")  # CI runs as root
            os.chmod(d.sock, 0o666)  # let the other uid get past the file mode, to the peer check
            code = ("import os,socket,sys; sys.path.insert(0, %r)\n"
                    "from lmctl import protocol\n"  # import first: the other uid may not read these files
                    "os.setgid(65534); os.setuid(65534)\n"
                    "s=socket.socket(socket.AF_UNIX); s.connect(%r)\n"
                    # refused at once, the peer may find the socket shut as it sends: the reply is there
                    "try: protocol.send(s, {'id': 1, 'cmd': 'status', 'args': {}})\n"
                    "except BrokenPipeError: pass\n"
                    "print(protocol.read_frame(s))")
            r = subprocess.run([sys.executable, "-c", code % (str(ROOT), str(d.sock))], capture_output=True,
                               text=True, timeout=30)
            assert "'denied'" in r.stdout and "uid 65534" in r.stdout, r.stdout + r.stderr
            assert "pid" not in r.stdout  # no status leaked
            assert d.proc is not None
            assert cj(d, "status")["daemon"]["pid"] == d.proc.pid
        finally:
            assert d.stop() == 0
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def test_stale_socket_is_replaced_and_a_live_one_never_stolen(daemon: Daemon) -> None:
    second = Daemon(daemon.store, daemon.sock)
    p = second.start(wait=False)
    assert p.wait(timeout=30) == 1
    assert "already serving" in (p.stderr.read() if p.stderr else "")
    first = daemon.proc
    assert first is not None
    assert cj(daemon, "status")["daemon"]["pid"] == first.pid
    first.kill()  # crash: the socket file stays behind
    first.wait()
    daemon.proc = None
    assert daemon.sock.exists()
    restarted = daemon.start()
    assert cj(daemon, "status")["daemon"]["pid"] == restarted.pid


def test_background_maintenance_trims_an_overfull_tier(tmp_path: Path) -> None:
    fill(tmp_path / "s")
    with Store(tmp_path / "s") as s:  # shrink the tier below what it holds
        cfg = StoreConfig.from_json(s.config.to_json())
        cfg.tiers["nvme"].capacity = 4 * (FMT.chunk_bytes + 4096) + 4096 * 3
        s.configure(cfg)
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        end = time.time() + 20
        while time.time() < end:
            st = cj(d, "status")["store"]["tiers"]["nvme"]
            if st["disk_bytes"] <= 0.95 * st["capacity"]:
                break
            time.sleep(0.2)
        assert st["disk_bytes"] <= 0.95 * st["capacity"]
    finally:
        assert d.stop() == 0


# -- the CLI process itself ------------------------------------------------------------------
def test_cli_never_imports_torch_or_vllm() -> None:
    code = ("import sys, lmctl, lmctl.cli, lmctl.client, lmctl.protocol; "
            "print([m for m in ('torch', 'vllm', 'numpy', 'transformers', 'store', 'prometheus_client') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_path())
    assert out.stdout.strip() == "[]", out.stderr
    r = cli(None, "--help")
    assert r.returncode == 0 and "lookup" in r.stdout and "shell" in r.stdout


def test_completions_are_generated_from_the_cli_and_do_not_drift(tmp_path: Path) -> None:
    from lmctl.completion import script

    for shell, name in (("bash", "lmctl.bash"), ("zsh", "_lmctl"), ("fish", "lmctl.fish")):
        committed = (ROOT / "completions" / name).read_text()
        assert committed == script(shell), (
            f"completions/{name} is stale: run lmctl completion show {shell} > completions/{name}")
    r = run("completion", "install", "--shell", "bash", env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0
    installed = tmp_path / ".local/share/bash-completion/completions/lmctl"
    assert installed.read_text() == script("bash")


def test_completion_callback_offers_labels_from_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    cj(daemon, "pin", "--label", "docs-2026", "--tokens", tokens_file(tmp_path, TOKENS))
    r = run(env={**os.environ, "_LMCTL_COMPLETE": "complete_bash", "COMP_WORDS": "lmctl unpin --label do",
                 "COMP_CWORD": "3", "LMCTL_SOCKET": str(daemon.sock)})
    assert r.stdout.split() == ["docs-2026"]


def test_shell_runs_commands_completes_labels_and_survives_errors(daemon: Daemon, tmp_path: Path) -> None:
    import pexpect
    cj(daemon, "pin", "--label", "contracts", "--tokens", tokens_file(tmp_path, TOKENS))
    env = env_with_path()
    env["HOME"] = str(tmp_path)
    env["COLUMNS"] = "120"
    sh = pexpect.spawn(sys.executable, ["-m", "lmctl.cli", "--socket", str(daemon.sock), "shell"],
                       env=env, encoding="utf-8", timeout=30)
    try:
        sh.expect("lmctl> ")
        sh.sendline("inspect")
        sh.expect("contracts")
        sh.expect("lmctl> ")
        sh.sendline("frobnicate --now")
        sh.expect("unknown command")
        sh.expect("lmctl> ")
        sh.sendline("lookup")  # a usage error from the daemon
        sh.expect("select chunks with")
        sh.expect("lmctl> ")
        sh.send("unpin --label con\t")
        sh.expect("contracts ")
        sh.sendline("--dry-run")
        sh.expect("would remove 4 pin reference")
        sh.expect("lmctl> ")
        sh.send("sta\t")
        sh.expect("status ")
        sh.sendline("")
        sh.expect("hits")
        sh.expect("lmctl> ")
        sh.sendline("inspect --json")
        sh.expect('"labels": {"contracts": 4}')
        sh.expect("lmctl> ")
        sh.sendline("help")
        sh.expect("commands:")
        sh.sendline("exit")
        sh.expect(pexpect.EOF)
    finally:
        sh.close()
    assert (tmp_path / ".lmctl_history").read_text().count("inspect") == 2
    assert (tmp_path / ".lmctl_history").stat().st_mode & 0o777 == 0o600  # it may hold cache salts
    st = cj(daemon, "status")
    assert st["daemon"]["requests"] >= 5


def test_cli_reference_in_the_docs_matches_the_app() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli_reference", ROOT / "scripts" / "gen_cli_reference.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert gen.documented(doc) == gen.reference_markdown(), (
        "docs/cli.md reference is stale: run scripts/gen_cli_reference.py")
