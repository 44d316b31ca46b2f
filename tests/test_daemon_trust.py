"""The daemon against its own peers: a refused peer costs it nothing that others need, and an
allowed peer of another uid cannot make it read a file or connect somewhere for her. Real
second uids (made for the test, root only), real sockets, a real listener."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import env_with_path
from test_daemon import Daemon, cj, fill

from stress.users import AsUser, User, as_user, call, flood, open_folder, threads_of, throwaway_user


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
        assert peak[0] <= idle + 2, f"{peak[0]} threads during the flood, {idle} before it"
        # and a refused peer still learns why
        got = as_user(user, call, str(sock), "status")
        assert got["error"] == "denied" and f"uid {user.uid}" in got["message"], got
        assert cj(d, "status")["daemon"]["pid"] == d.proc.pid
    finally:
        stop(d)
