"""The daemon against its own peers: a refused peer costs it nothing that others need, and an
allowed peer of another uid cannot make it read a file or connect somewhere for her. Real
second uids (made for the test, root only), real sockets, a real listener."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import env_with_path
from test_daemon import TOKENS, Daemon, cj, fill

from store import adapter_digest
from stress.users import AsUser, User, as_user, call, flood, open_folder, threads_of, throwaway_user
from stress.users import cli as run_cli


@pytest.fixture
def user() -> Iterator[User]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user and switch to it")
    with throwaway_user() as u:
        yield u


@pytest.fixture
def shared() -> Iterator[Path]:
    with open_folder() as path:
        yield Path(path)


def stop(d: Daemon) -> None:
    """Stop the daemon: it must exit cleanly, and soon (it is killed if not)."""
    assert d.proc is not None
    proc = d.proc
    try:
        assert d.stop() == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def status_within(d: Daemon, seconds: float) -> str:
    """``lmctl status`` by the owner: "ok", or why not."""
    try:
        r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(d.sock), "status"],
                           capture_output=True, text=True, env=env_with_path(), timeout=seconds)
    except subprocess.TimeoutExpired:
        return f"no answer within {seconds} s"
    return "ok" if r.returncode == 0 else r.stderr.strip()


# -- a refused peer never holds a slot ------------------------------------------------------------
def test_a_flood_of_refused_peers_never_keeps_the_owner_out(tmp_path: Path, user: User, shared: Path) -> None:
    fill(tmp_path / "store")
    sock = shared / "lmctl.sock"
    d = Daemon(tmp_path / "store", sock, ["--socket-mode", "0666"])  # anyone may connect: credentials decide
    d.start()
    try:
        assert d.proc is not None
        assert cj(d, "status")["daemon"]["pid"] == d.proc.pid
        assert cj(d, "verify", "--deep")["ok"]  # every record read once: the tier's I/O threads are up
        idle = threads_of(d.proc.pid)
        peak = [idle]
        sampling = threading.Event()

        pid = d.proc.pid

        def sample() -> None:
            while not sampling.wait(0.02):
                peak[0] = max(peak[0], threads_of(pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        flooders = [AsUser(user, flood, str(sock), 200) for _ in range(2)]
        try:
            time.sleep(0.5)  # the flood is on
            results = [status_within(d, 20) for _ in range(6)]
        finally:
            made = [f.finish() for f in flooders]
            sampling.set()
            sampler.join()
        assert all(r == "ok" for r in results), f"status succeeded {results.count('ok')} of 6 times: {results}"
        assert sum(m["connections"] for m in made) > 500, made  # it was a flood
        # a refused peer costs no thread: the daemon's stay as they were, whatever the flood
        assert peak[0] <= idle + 4, f"{peak[0]} threads during the flood, {idle} before it"
        # and a refused peer still learns why
        got = as_user(user, call, str(sock), "status")
        assert got["error"] == "denied" and f"uid {user.uid}" in got["message"], got
        assert cj(d, "status")["daemon"]["pid"] == d.proc.pid
    finally:
        stop(d)


# -- settings only the owner may change -----------------------------------------------------------
class Listener:
    """A TCP server on loopback that records whatever anyone sends it (a peer's own listener)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1.0)
                try:
                    while data := conn.recv(4096):
                        self.received += data
                        conn.sendall(b"-ERR no\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def allowed(tmp_path: Path, user: User, shared: Path) -> Iterator[Daemon]:
    """A daemon that ``user`` may use (``--allow-uid``), on a socket she can reach."""
    fill(tmp_path / "store")
    d = Daemon(tmp_path / "store", shared / "lmctl.sock",
               ["--allow-uid", str(user.uid), "--socket-mode", "0666"])
    d.start()
    try:
        # the command line once as the owner (human and JSON output, an error): a child running
        # as the other user cannot import from the interpreter's folder, so it finds them loaded
        assert run_cli("--socket", str(d.sock), "config", "set", "no.such.setting=1")["rc"] == 2
        assert run_cli("--socket", str(d.sock), "--json", "lookup", "--tokens", "/nonexistent")["rc"] == 2
        yield d
    finally:
        stop(d)


def test_an_allowed_peer_cannot_make_the_daemon_send_a_root_only_file_to_her_listener(
        tmp_path: Path, user: User, allowed: Daemon) -> None:
    secret = tmp_path / "redis-password"  # the owner's: root-only, in a folder she cannot enter
    secret.write_text("the-root-only-first-line\nsecond\n")
    os.chmod(secret, 0o600)
    listener = Listener()
    try:
        sock = str(allowed.sock)
        attack = {"remote.password_file": str(secret), "remote.url": f"redis://127.0.0.1:{listener.port}/0"}
        got = as_user(user, call, sock, "config", {"set": attack})
        # the daemon is put to work as it would be with a remote tier: nothing reaches the listener
        cj(allowed, "lookup", "--key", "ff" * 48)
        assert as_user(user, call, sock, "status").get("ok"), "the allowed peer may still use the daemon"
        time.sleep(0.5)
        assert b"the-root-only-first-line" not in listener.received, bytes(listener.received)
        assert listener.connections == 0
        assert got.get("error") == "denied", got
        assert "remote.password_file, remote.url" in got["message"] and "owner" in got["message"], got
        assert cj(allowed, "config", "show")["settings"]["remote"] is None  # nothing applied
        # each such setting on its own, and through the command line (exit 1, one line)
        for name, value in [("remote.url", f"redis://127.0.0.1:{listener.port}/0"),
                            ("remote.password_file", str(secret)), ("remote.secret_file", str(secret)),
                            ("remote.previous_secret_file", str(secret)), ("tiers.nvme.path", "/tmp"),
                            ("tiers.dram.path", str(tmp_path / "elsewhere"))]:
            got = as_user(user, call, sock, "config", {"set": {name: value}})
            assert got.get("error") == "denied" and name in got["message"], (name, got)
        out = as_user(user, run_cli, "--socket", sock, "config", "set", f"remote.password_file={secret}")
        assert out["rc"] == 1 and len(out["stderr"].strip().splitlines()) == 1, out
        assert "may not change remote.password_file" in out["stderr"] and "Traceback" not in out["stderr"]
        # settings that read nothing and connect nowhere stay open to allowed peers
        got = as_user(user, call, sock, "config", {"set": {"codec_level": 3}})
        assert got.get("ok") and got["ok"]["settings"]["codec_level"] == 3, got
        # and the owner changes any of them
        r = cj(allowed, "config", "set", f"remote.url=redis://127.0.0.1:{listener.port}/0", "remote.trust=all-writers")
        assert r["settings"]["remote"]["url"].startswith("redis://127.0.0.1")
    finally:
        listener.close()
    assert not (tmp_path / "elsewhere").exists()


# -- folders the daemon would read for a peer -----------------------------------------------------
def test_an_adapter_folder_is_hashed_with_the_callers_rights_not_the_daemons(
        tmp_path: Path, user: User, shared: Path, allowed: Daemon) -> None:
    private = tmp_path / "private"  # a folder she cannot enter, holding a file anyone may read
    private.mkdir(mode=0o700)
    target = private / "adapter_model.safetensors"
    target.write_bytes(b"the owner's weights")
    os.chmod(target, 0o644)
    evil = shared / "evil"  # her folder: a symlink to that file, walked around the folder's mode
    evil.mkdir()
    (evil / "adapter_model.safetensors").symlink_to(target)
    os.lchown(evil / "adapter_model.safetensors", user.uid, user.gid)
    os.chown(evil, user.uid, user.gid)
    leaked = adapter_digest(evil)  # what the daemon's rights make of it: a digest of the owner's file
    doc = shared / "doc.json"
    doc.write_text(json.dumps(TOKENS))
    sock = str(allowed.sock)
    got = as_user(user, call, sock, "lookup", {"doc": {"tokens": TOKENS}, "adapter": str(evil)})
    assert leaked not in json.dumps(got), got
    assert got.get("error") == "denied" and "NAME@DIGEST" in got["message"], got
    # the command line hashes the folder itself, as her: the file is out of her reach
    out = as_user(user, run_cli, "--socket", sock, "--json", "lookup", "--tokens", str(doc), "--adapter", str(evil))
    assert out["rc"] == 2 and "Permission denied" in out["stdout"] and leaked not in out["stdout"], out
    # a folder of her own works as it always did: its digest is hers to compute
    mine = shared / "mine"
    mine.mkdir()
    (mine / "adapter_config.json").write_text('{"r": 8}')
    os.chown(mine, user.uid, user.gid)
    os.chown(mine / "adapter_config.json", user.uid, user.gid)
    out = as_user(user, run_cli, "--socket", sock, "--json", "lookup", "--tokens", str(doc), "--adapter", str(mine))
    assert out["rc"] == 0, out
    assert json.loads(out["stdout"])["namespace"]["adapter"] == f"mine@{adapter_digest(mine)}"
    # the owner's own requests may still name a folder for the daemon to hash
    r = cj(allowed, "lookup", "--tokens", str(doc), "--adapter", str(evil))
    assert r["namespace"]["adapter"] == f"evil@{leaked}"


def test_another_uid_cannot_make_the_daemon_load_a_tokenizer_of_her_choosing(
        user: User, allowed: Daemon) -> None:
    got = as_user(user, call, str(allowed.sock), "lookup", {"doc": {"text": "hello"}, "tokenizer": "/root"})
    assert got.get("error") == "denied" and "--tokens FILE" in got["message"], got


def test_a_client_with_a_timeout_waits_while_the_daemons_accept_queue_is_full(tmp_path: Path) -> None:
    from lmctl.client import Client

    path = str(tmp_path / "busy.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(0)
    queued = []
    try:
        for _ in range(4):  # fill the queue of connections not yet accepted (a flood's effect)
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        assert queued, "the queue never filled"
        freed = threading.Event()

        def accept_one() -> None:
            freed.wait(10)
            srv.accept()[0].close()

        t = threading.Thread(target=accept_one)
        t.start()
        c = Client(path, timeout=10)
        threading.Timer(0.2, freed.set).start()  # room comes while the client waits
        try:
            c.connect()  # told EAGAIN at first: it waits for room instead of giving up
        finally:
            c.close()
            t.join()
    finally:
        for s in queued:
            s.close()
        srv.close()
