"""How fast the ``lmctl`` process starts: whole-process runs of the commands an operator
types most, against a real daemon.

    .venv/bin/python benchmarks/cli_startup.py [--runs 11] [--against DIR] [--pyc] [--json]

A daemon is started on a small temporary store (six chunks); then each command line runs as
a fresh ``python -m lmctl.cli`` process, ``--runs`` times, and the median wall time is
reported next to the machine's own floor measured in the same run: ``python -c pass`` (the
interpreter and site) and ``python -c "import typer"`` (the framework every command needs).
The median CPU time (user + system) of the process is reported too: on a machine that other
work keeps busy the wall time grows with the load, while the CPU time stays close to what
the wall time is on an idle one (the process is single-threaded and waits on no disk):

  lmctl --help, lmctl status, lmctl lookup --tokens DOC, and status/lookup with no daemon
  on the socket (the start-up alone: exit 3)

``--against DIR`` also runs every line from another checkout (say a worktree of the last
release, ``git worktree add ../lmctl-old v0.1.0``), interleaved run by run with this one so that
the machine's load falls on both alike, and prints the ratio. ``--pyc`` lets Python write and
use bytecode caches (in a temporary folder); by default the environment decides
(``PYTHONDONTWRITEBYTECODE``), and without caches each process compiles lmctl's modules anew.
The goal: each of the first three at most 0.15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig  # noqa: E402

GOAL_S = 0.15
FMT = KVFormat("bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, chunk_size=16)
TOKENS = list(range(100, 164))


def make_store(path: Path) -> None:
    ns = Namespace("m", FMT)
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, segment_bytes=4 * MiB)) as s:
        s.register_namespace(ns, {"model_id": "m", "tokenizer": None})
        for k in ns.chunk_keys(TOKENS):
            assert s.put(k, bytes(FMT.chunk_bytes), {"dtype": "bfloat16", "shape": list(FMT.chunk_shape)}, tokens=16)


def wait_for(sock: Path, proc: subprocess.Popen[bytes]) -> None:
    end = time.time() + 30
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit("the daemon exited at start")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the daemon did not start")


def timed(argv: list[str], tree: Path, env: dict[str, str]) -> tuple[float, float]:
    """One run of ``argv`` in ``tree``: (wall seconds, CPU seconds)."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, cwd=tree, env={**env, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    _pid, _status, usage = os.wait4(p.pid, 0)
    p.returncode = 0  # reaped by wait4
    return time.perf_counter() - t, usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--against", type=Path, help="another checkout to compare with, run by run")
    ap.add_argument("--pyc", action="store_true", help="write and use bytecode caches")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmctl-startup-"))
    env = dict(os.environ)
    if a.pyc:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pyc")
    store, sock, doc = work / "store", work / "store" / "lmctl.sock", work / "doc.json"
    make_store(store)
    doc.write_text(json.dumps(TOKENS))
    daemon = subprocess.Popen([sys.executable, "-m", "lmctl.cli", "serve", "--store", str(store)], cwd=ROOT,
                              env={**env, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)
    rows: list[dict[str, Any]] = []
    try:
        wait_for(sock, daemon)
        py = sys.executable
        lines = {
            "python -c pass": ([py, "-c", "pass"], False),
            "python -c 'import typer'": ([py, "-c", "import typer"], False),
            "lmctl --help": ([py, "-m", "lmctl.cli", "--help"], True),
            "lmctl status": ([py, "-m", "lmctl.cli", "--socket", str(sock), "status"], True),
            "lmctl lookup --tokens DOC": ([py, "-m", "lmctl.cli", "--socket", str(sock), "lookup", "--tokens",
                                           str(doc)], True),
            "lmctl status (no daemon)": ([py, "-m", "lmctl.cli", "--socket", str(work / "none.sock"), "status"], True),
            "lmctl lookup (no daemon)": ([py, "-m", "lmctl.cli", "--socket", str(work / "none.sock"), "lookup",
                                          "--tokens", str(doc)], True),
        }
        trees = [("here", ROOT)] + ([("against", a.against.resolve())] if a.against else [])
        for name, (argv, compare) in lines.items():
            got: dict[str, list[tuple[float, float]]] = {t: [] for t, _ in trees}
            for _t, tree in trees:  # once each before timing: page cache (and bytecode caches)
                timed(argv, tree, env)
            for _ in range(a.runs):
                for t, tree in trees if compare else trees[:1]:
                    got[t].append(timed(argv, tree, env))
            row: dict[str, Any] = {"command": name, "median_s": statistics.median(w for w, _c in got["here"]),
                                   "cpu_s": statistics.median(c for _w, c in got["here"])}
            if a.against and compare:
                row["against_median_s"] = statistics.median(w for w, _c in got["against"])
                row["against_cpu_s"] = statistics.median(c for _w, c in got["against"])
                row["ratio"] = row["median_s"] / row["against_median_s"]
                row["cpu_ratio"] = row["cpu_s"] / row["against_cpu_s"]
            rows.append(row)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    floor = rows[0]["median_s"]
    if a.json:
        print(json.dumps({"runs": a.runs, "pyc": a.pyc, "rows": rows}))
        return 0
    print(f"load average {os.getloadavg()[0]:.2f} at the end; medians of {a.runs} runs")
    print(f"{'command':28s} {'wall':>7s} {'cpu':>7s} {'x python':>9s}"
          + ("  against wall    cpu  ratio wall  cpu" if a.against else ""))
    for r in rows:
        line = f"{r['command']:28s} {r['median_s']:6.3f}s {r['cpu_s']:6.3f}s {r['median_s'] / floor:8.1f}x"
        if "ratio" in r:
            line += (f"  {r['against_median_s']:11.3f}s {r['against_cpu_s']:6.3f}s  {r['ratio']:9.2f} "
                     f"{r['cpu_ratio']:4.2f}")
        print(line)
    slow = [r["command"] for r in rows[2:5] if r["median_s"] > GOAL_S]
    print(f"goal (--help, status, lookup <= {GOAL_S} s of wall time): "
          + ("met" if not slow else f"missed by {', '.join(slow)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
