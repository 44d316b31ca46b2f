"""``serve --socket`` and who may connect: a socket folder that does not exist, a path longer
than a Unix socket's, the lock file beside the socket, and what another user is told when the
kernel or the daemon keeps them out. Real daemons, real sockets, a real second uid (root
only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import env_with_path
from test_daemon import Daemon, cj, fill
from test_daemon_trust import shared, user  # noqa: F401  (fixtures)

from stress.users import User, as_user
from stress.users import cli as run_cli


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """``lmctl serve ARGS`` that must exit by itself (a refused start)."""
    return subprocess.run([sys.executable, "-m", "lmctl.cli", "serve", *args], capture_output=True, text=True,
                          env=env_with_path(), timeout=60)


def test_serve_refuses_a_socket_folder_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "dir"
    r = serve("--store", str(tmp_path / "s"), "--init", "--socket", str(missing / "x.sock"))
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"lmctl: the socket's folder {missing} does not exist; create it first (owned by the daemon's "
                        "user, writable by no one else; with systemd, RuntimeDirectory=lmctl makes /run/lmctl) or "
                        "choose another --socket\n")
    assert not (tmp_path / "nonexistent").exists() and not (tmp_path / "s").exists()  # nothing was created
    # the store folder itself is made with the store, as ever: the default socket lives there
    d = Daemon(tmp_path / "s", extra=["--init"])
    d.start()
    assert d.stop() == 0


def test_a_socket_path_too_long_is_one_usage_line(tmp_path: Path) -> None:
    folder = tmp_path / ("a" * 120)
    folder.mkdir()
    sock = folder / "lmctl.sock"
    n = len(os.fsencode(str(sock)))
    fill(tmp_path / "s")
    r = serve("--store", str(tmp_path / "s"), "--socket", str(sock))
    assert r.returncode == 2 and "internal error" not in r.stderr
    assert r.stderr == (f"lmctl: --socket {sock} is {n} bytes long; a Unix socket's path can be at most 107 bytes: "
                        "give a shorter --socket (e.g. /run/lmctl/lmctl.sock)\n")
    assert os.listdir(folder) == []  # no lock file, no socket
    deep = folder / "store"  # the default socket, in a store folder with a long path
    r = serve("--store", str(deep), "--init")
    assert r.returncode == 2 and "the socket in the store folder" in r.stderr and not deep.exists()


def test_the_lock_file_goes_when_the_daemon_stops_or_a_start_is_refused(daemon: Daemon, tmp_path: Path) -> None:
    lock = Path(f"{daemon.sock}.lock")
    assert lock.exists()  # while it serves
    other = tmp_path / "other.sock"  # another daemon for the same store: refused, after taking its socket's lock
    r = serve("--store", str(daemon.store), "--socket", str(other))
    assert r.returncode == 1 and "one daemon per store" in r.stderr
    assert not Path(f"{other}.lock").exists() and not other.exists()
    second = serve("--store", str(daemon.store), "--socket", str(daemon.sock))  # the same socket: refused
    assert second.returncode == 1 and lock.exists()  # the running daemon's lock is left alone
    assert daemon.stop() == 0
    assert not lock.exists() and not daemon.sock.exists()
    proc = daemon.start()  # and it starts again, taking a new lock file
    assert lock.exists() and cj(daemon, "status")["daemon"]["pid"] == proc.pid


def test_another_users_socket_says_permission_denied_and_how_to_get_access(  # noqa: F811
        tmp_path: Path, user: User, shared: Path) -> None:  # noqa: F811
    fill(tmp_path / "store")
    sock = str(shared / "lmctl.sock")
    d = Daemon(tmp_path / "store", shared / "lmctl.sock")  # mode 0600, no --allow-uid
    d.start()
    try:
        assert run_cli("--socket", sock, "status")["rc"] == 0  # as the owner first: the CLI's modules are loaded
        out = as_user(user, run_cli, "--socket", sock, "status")
        assert out["rc"] == 3 and out["stdout"] == ""
        err = out["stderr"]
        assert err.count("\n") == 1 and "start one with" not in err, err
        assert err.startswith(f"lmctl: permission denied connecting to the socket {sock}: it belongs to uid "
                              f"{os.geteuid()} (root) (mode 0600) and uid {user.uid} ({user.name}) may not write to "
                              "it; a daemon may be running there: its owner can admit you: lmctl serve "
                              f"--allow-uid {user.uid}"), err
        # past the file mode, the daemon itself refuses her: its reply names --allow-uid too
        os.chmod(sock, 0o666)
        out = as_user(user, run_cli, "--socket", sock, "status")
        assert out["rc"] == 1, out
        assert out["stderr"] == (f"lmctl: uid {user.uid} may not use this daemon (peer credentials); the daemon's "
                                 f"owner (uid {os.geteuid()}) can admit it: lmctl serve --allow-uid {user.uid}\n")
    finally:
        assert d.stop() == 0
