"""Operator commands on stores of 1k, 100k and 1M chunks, against a real daemon.

    .venv/bin/python benchmarks/index_scale.py [--cache DIR] [--sizes 1k,100k,1m] [--repeats 3] [--json]

Each store is built once through the store library (tiny payloads, batches of 4096, no
fsync: a record still takes 8 KiB on disk, a 4 KiB-aligned payload and its 4 KiB trailer,
so 1M chunks take about 8.5 GB) and kept in the cache folder for later runs (``--rebuild``
builds it again). The store holds four namespaces (two models, each with and without an
adapter), documents of 64 chunks of 16 tokens, and one label pinning 1% of the chunks.

Then, per store, ``lmctl serve`` runs on it and each command is sent through one client
connection (the time is the request's round trip: the daemon's work plus the socket, not
the CLI's start-up), ``--repeats`` times:

  status, inspect, ls --limit 10, ls --limit 10 --sort size, evict --model M --dry-run,
  verify (shallow), and lookup of a random 64-chunk document (1000 lookups after 50 to
  warm up: p50 and p99)

The daemon's peak RSS is read from /proc/PID/status (VmHWM) after each command, the peak
being reset before it (``/proc/PID/clear_refs``), and the largest over all commands is
reported with the command that reached it. The table gives medians over the repeats; the
goals (inspect, status, ls <= 0.3 s; evict --dry-run <= 1 s; verify <= 3 s; peak RSS
<= 300 MB; lookup p99 <= 2x its value at 1k) are judged on the largest store.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmctl.client import Client  # noqa: E402
from store import AdapterIdentity, GiB, KVFormat, Namespace, PutItem, Store, StoreConfig, TierConfig  # noqa: E402
from testsupport.lmctl import Daemon as HarnessDaemon  # noqa: E402

FMT = KVFormat("bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, chunk_size=16)
LAYOUT = {"dtype": "bfloat16", "shape": list(FMT.chunk_shape)}
PAYLOAD = 64              # bytes per chunk: the index is what is measured, not the disk
DOC_CHUNKS = 64           # chunks per document
BATCH = 4096              # chunks per put_many
RECORD_DISK = 8192        # a tiny payload's record on disk (payload block + trailer block)
SIZES = {"1k": 1_000, "10k": 10_000, "100k": 100_000, "1m": 1_000_000}
MODELS = ("bench-a", "bench-b")
LOOKUPS = 1000            # lookups timed per store (p50, p99)
GOALS_S = {"status": 0.3, "inspect": 0.3, "ls": 0.3, "evict_dry": 1.0, "verify": 3.0}
RSS_GOAL_MB = 300


def namespaces() -> list[Namespace]:
    out = []
    for m in MODELS:
        out.append(Namespace(m, FMT))
        out.append(Namespace(m, FMT, AdapterIdentity("civil", "3f9a" + "0" * 28)))
    return out


def doc_tokens(i: int) -> list[int]:
    """Document ``i``: DOC_CHUNKS full chunks of tokens, different for every i."""
    return [i * 7919 + j for j in range(DOC_CHUNKS * FMT.chunk_size)]


def build(path: Path, n: int) -> None:
    """A store of ``n`` chunks at ``path`` (documents spread over the namespaces in turn)."""
    need = n * RECORD_DISK * 1.2 + (1 << 30)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise SystemExit(f"{path.parent}: {free / 1e9:.1f} GB free, a store of {n} chunks needs about "
                         f"{need / 1e9:.1f} GB; choose another --cache or fewer --sizes")
    if path.exists():
        shutil.rmtree(path)
    t0 = time.monotonic()
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=max(4 * GiB, int(n * RECORD_DISK * 1.5)))},
                      codec="raw", fsync=False)
    nss = namespaces()
    payload = bytes(PAYLOAD)
    pinned: list[bytes] = []
    with Store(path, cfg) as s:
        for ns in nss:
            s.register_namespace(ns, {"model_id": ns.model, "tokenizer": None})
        items: list[PutItem] = []
        done = 0
        d = 0
        while done < n:
            ns = nss[d % len(nss)]
            keys = ns.chunk_keys(doc_tokens(d))[: n - done]
            if d % 100 == 0:
                pinned.extend(keys)
            items.extend(PutItem(k, payload, LAYOUT, FMT.chunk_size) for k in keys)
            done += len(keys)
            d += 1
            if len(items) >= BATCH or done >= n:
                assert all(s.put_many(items)), "a chunk was not stored"
                items = []
                print(f"\r  building {n} chunks: {done}", end="", file=sys.stderr, flush=True)
        s.pin("bench-pinned", pinned)
    fd = os.open(path / "bench.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the store folder is private
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"chunks": n, "docs": d, "built_s": time.monotonic() - t0}))
    print(f"\r  built {n} chunks in {time.monotonic() - t0:.0f} s", file=sys.stderr)


def ensure(cache: Path, name: str, rebuild: bool) -> Path:
    path = cache / f"store-{name}"
    meta = path / "bench.json"
    if rebuild or not meta.exists() or json.loads(meta.read_text())["chunks"] != SIZES[name]:
        cache.mkdir(parents=True, exist_ok=True)
        build(path, SIZES[name])
    return path


class Daemon(HarnessDaemon):
    """``lmctl serve`` on the benchmark's store (testsupport's daemon), with a client."""

    def __init__(self, path: Path) -> None:
        sock = path / "bench.sock"
        super().__init__(path, sock, command=["serve", "--store", str(path), "--socket", str(sock),
                                              "--maintenance-interval", "3600", "--log-level", "warning"],
                         stderr=None)  # its warnings on the benchmark's stderr
        t0 = time.monotonic()
        self.start(timeout=3600)  # opening a large store is part of what is measured
        self.start_s = time.monotonic() - t0
        self.client = Client(str(self.sock), timeout=600)

    def reset_peak(self) -> None:
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from the current RSS

    def peak_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self, timeout: float = 120) -> int:
        self.client.close()
        return super().stop(timeout)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_store(path: Path, repeats: int) -> dict[str, Any]:
    info = json.loads((path / "bench.json").read_text())
    d = Daemon(path)
    out: dict[str, Any] = {"chunks": info["chunks"], "daemon_start_s": round(d.start_s, 3)}
    call = d.client.call
    commands: dict[str, Callable[[], Any]] = {
        "status": lambda: call("status"),
        "inspect": lambda: call("inspect"),
        "ls": lambda: call("ls", {"limit": 10}),
        "ls_sorted": lambda: call("ls", {"limit": 10, "sort": "size"}),
        "evict_dry": lambda: call("evict", {"model": MODELS[0], "dry_run": True}),
        "verify": lambda: call("verify"),
    }
    peaks: dict[str, float] = {}
    try:
        for name, fn in commands.items():
            times = []
            peak = 0.0
            for _ in range(repeats):
                d.reset_peak()
                times.append(timed(fn))
                peak = max(peak, d.peak_mb())
            out[name] = round(statistics.median(times), 4)
            peaks[name] = round(peak, 1)
        rng = random.Random(1)
        nss = namespaces()
        lookups = []
        d.reset_peak()
        for n in range(LOOKUPS + 50):
            i = rng.randrange(info["docs"])
            ns = nss[i % len(nss)]
            args = {"model": ns.model, "doc": {"tokens": doc_tokens(i)}}
            if ns.adapter is not None:
                args["adapter"] = str(ns.adapter)
            took = timed(lambda a=args: call("lookup", a))  # type: ignore[misc]
            if n >= 50:  # the first 50 warm the connection and the daemon's code paths
                lookups.append(took)
        peaks["lookup"] = round(d.peak_mb(), 1)
        lookups.sort()
        out["lookup_p50"] = round(lookups[len(lookups) // 2], 5)
        out["lookup_p99"] = round(lookups[int(len(lookups) * 0.99) - 1], 5)
        out["peak_rss_mb"] = max(peaks.values())
        out["peak_rss_by"] = max(peaks, key=lambda k: peaks[k])
        out["peaks"] = peaks
    finally:
        d.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/lmctl-bench/index-scale"),
                   help="folder that keeps the built stores between runs")
    p.add_argument("--sizes", default="1k,100k,1m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rebuild", action="store_true", help="build the stores again")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    names = [s.strip().lower() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in names if s not in SIZES]
    if bad:
        raise SystemExit(f"unknown size(s) {', '.join(bad)}; known: {', '.join(SIZES)}")
    cache = Path(a.cache)
    paths = {name: ensure(cache, name, a.rebuild) for name in names}
    if a.build_only:
        return
    rows = {name: run_store(paths[name], a.repeats) for name in names}
    if a.json:
        print(json.dumps(rows, indent=2))
    cols = ["status", "inspect", "ls", "ls_sorted", "evict_dry", "verify", "lookup_p50", "lookup_p99"]
    print("| chunks | " + " | ".join(f"{c} s" for c in cols) + " | peak RSS MB (by) | daemon start s |")
    print("|" + "---|" * (len(cols) + 3))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.4g}" for c in cols)
              + f" | {r['peak_rss_mb']:.0f} ({r['peak_rss_by']}) | {r['daemon_start_s']:.2f} |")
    big = rows[names[-1]]
    small = rows[names[0]]
    print(f"\ngoals on {names[-1]}:")
    for c, goal in GOALS_S.items():
        print(f"  {c:10s} {big[c]:.3f} s <= {goal} s: {'met' if big[c] <= goal else 'NOT met'}")
    print(f"  {'ls_sorted':10s} {big['ls_sorted']:.3f} s (a sort over every chunk; no goal)")
    print(f"  peak RSS   {big['peak_rss_mb']:.0f} MB <= {RSS_GOAL_MB} MB: "
          f"{'met' if big['peak_rss_mb'] <= RSS_GOAL_MB else 'NOT met'} (highest during {big['peak_rss_by']})")
    ratio = big["lookup_p99"] / small["lookup_p99"] if small["lookup_p99"] else float("inf")
    print(f"  lookup p99 {big['lookup_p99'] * 1e3:.2f} ms = {ratio:.2f}x its {names[0]} value "
          f"({small['lookup_p99'] * 1e3:.2f} ms) <= 2x: {'met' if ratio <= 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
