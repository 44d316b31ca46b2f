"""daemon-abuse: a real daemon under two other users at once. One is refused (not
``--allow-uid``) and floods the socket with connections she keeps open; the other is allowed
and tries every setting that would make the daemon read a file or connect somewhere for her
(``remote.password_file`` of a root-only file, ``remote.url`` of her own listener, tier
paths), and an adapter folder for the daemon to hash. Meanwhile the owner's calls must all
succeed, every one of hers be refused, nothing reach her listener, the daemon's thread count
stay where it was, and the daemon stop cleanly. Root only (it makes two users)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from store import KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig
from stress.common import Tally, content, key
from stress.users import AsUser, as_user, call, flood, is_root, open_folder, threads_of, throwaway_user
from testsupport.lmctl import Daemon

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
#: the owner's calls per round, made while the flood is on
OWNER_CALLS = 10


def _operator_attempts(sock: str, secret: str, port: int, shared: str) -> list[str]:
    """What the allowed peer tries (as herself): the error code of each attempt."""
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("config", {"set": {"remote.password_file": secret, "remote.url": f"redis://127.0.0.1:{port}/0"}}),
        ("config", {"set": {"remote.url": f"redis://127.0.0.1:{port}/0"}}),
        ("config", {"set": {"remote.secret_file": secret}}),
        ("config", {"set": {"tiers.nvme.path": shared}}),
        ("config", {"set": {"tiers.dram.path": shared, "tiers.dram.capacity": "64MiB"}}),
        ("lookup", {"doc": {"tokens": list(range(64))}, "adapter": shared}),
        ("lookup", {"doc": {"text": "hello"}, "tokenizer": shared}),
    ]
    return [str(call(sock, cmd, args).get("error")) for cmd, args in attempts]


def _listen() -> tuple[socket.socket, bytearray, threading.Event]:
    """Her listener: records whatever anyone sends to it until the event is set."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.1)
    got = bytearray()
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(0.5)
                try:
                    while data := conn.recv(4096):
                        got.extend(data)
                except OSError:
                    pass

    threading.Thread(target=run, daemon=True).start()
    return srv, got, done


def scenario_daemon_abuse(work: Path, n: int) -> Tally:
    t = Tally("daemon-abuse")
    if not is_root():
        t.facts["skipped"] = "needs root to make two users and switch to them"
        return t
    store = work / "store"
    with Store(store, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, segment_bytes=4 * MiB)) as s:
        ns = Namespace("m", KVFormat("uint8", 1, 1, 64, chunk_size=16))
        s.register_namespace(ns, {"model_id": "m", "tokenizer": None})  # documents resolve in it
        for i in range(8):
            s.put(key(i), content(key(i), 64 << 10), {"dtype": "uint8"}, tokens=16)
    secret = work / "password"
    secret.write_text("root-only-first-line\n")
    os.chmod(secret, 0o600)
    srv, heard, done = _listen()
    with throwaway_user("lmx_abz") as refused, throwaway_user("lmx_opz") as operator, open_folder() as shared:
        sock = os.path.join(shared, "lmctl.sock")
        proc = Daemon(store, Path(sock), ["--socket-mode", "0666", "--allow-uid", str(operator.uid)], env=ENV).start()
        try:
            call(sock, "verify", {"deep": True})  # every record read once: the tier's I/O threads are up
            idle = threads_of(proc.pid)
            peak = idle
            owner_ok = owner_calls = denied = attempts = connections = 0
            for _ in range(n):
                flooders = [AsUser(refused, flood, sock, 100) for _ in range(2)]
                try:
                    time.sleep(0.2)
                    codes = as_user(operator, _operator_attempts, sock, str(secret), srv.getsockname()[1], shared)
                    attempts += len(codes)
                    denied += codes.count("denied")
                    call(sock, "lookup", {"keys": ["ff" * 48]})  # a miss: a remote tier, if any, is asked
                    for _ in range(OWNER_CALLS):
                        owner_calls += 1
                        owner_ok += "ok" in call(sock, "status")
                        peak = max(peak, threads_of(proc.pid))
                finally:
                    connections += sum(f.finish()["connections"] for f in flooders)
            t.trials = owner_calls + attempts
            t.check(owner_ok == owner_calls, f"the owner's status succeeded {owner_ok} of {owner_calls} times")
            t.check(denied == attempts, f"{attempts - denied} of the allowed peer's {attempts} attempts were not "
                                        "refused")
            t.check(not heard, f"her listener received {bytes(heard[:80])!r}")
            # the owner's and her connections' threads (a few, ending as their clients hang up),
            # never one per refused connection
            t.check(peak <= idle + 8, f"{peak} daemon threads during the flood, {idle} before it")
            t.check(proc.poll() is None, "the daemon died")
            shown = call(sock, "config")
            t.check(shown.get("ok", {}).get("settings", {}).get("remote") is None, "a remote tier was configured")
            verify = call(sock, "verify", {"deep": True})
            t.check(verify.get("ok", {}).get("ok") is True, f"verify --deep after the run: {verify}")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            err = proc.stderr.read() if proc.stderr else ""
            done.set()
            srv.close()
    t.check(rc == 0 and "Traceback" not in err, f"the daemon exited {rc} or logged a traceback")
    t.facts.update(rounds=n, refused_connections=connections, owner_calls=owner_calls, peer_attempts=attempts,
                   idle_threads=idle, peak_threads=peak)
    return t
