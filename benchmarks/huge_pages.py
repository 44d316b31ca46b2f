"""Cold O_DIRECT reads into huge pages against small pages written in order, one process.

    .venv/bin/python benchmarks/huge_pages.py [--rounds 3] [--dir DIR] [--json]   # as root

Writes one file of ``--chunks`` 32 MiB chunks (sequentially, O_DIRECT), then per round and
per read pattern (one whole chunk in flight, four, 4 MiB requests four in flight, 1 MiB
requests eight in flight) drops the page cache and reads the file into a region of each
kind of memory (``store.format.memory.Region`` with and without ``MADV_HUGEPAGE``), the two kinds
alternating and their order flipping from round to round. Reports GB/s and the per-round
ratio huge / small for each pattern (docs/performance.md, "The destination's pages").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store.format.memory import Region  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_io import drop_caches  # noqa: E402

CHUNK = 32 << 20
PATTERNS = {"whole_qd1": (1, CHUNK), "whole_qd4": (4, CHUNK), "4m_qd4": (4, 4 << 20), "1m_qd8": (8, 1 << 20)}


def read_all(path: str, dst: memoryview, chunks: int, inflight: int, req: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        drop_caches()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(inflight) as ex:
            futs = []
            for i in range(chunks):
                d = dst[(i % 8) * CHUNK : (i % 8 + 1) * CHUNK]
                futs += [ex.submit(os.preadv, fd, [d[o : o + req]], i * CHUNK + o) for o in range(0, CHUNK, req)]
            for f in futs:
                if f.result() <= 0:
                    raise OSError("short read")
        return CHUNK * chunks / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmctl-huge-", dir=args.dir) as d:
        path = os.path.join(d, "chunks.bin")
        regions = {"small": Region(8 * CHUNK, huge=False), "huge": Region(8 * CHUNK, huge=True)}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            for i in range(args.chunks):
                os.pwrite(fd, regions["small"].view[:CHUNK], i * CHUNK)
            os.fsync(fd)
        finally:
            os.close(fd)
        runs: dict[str, dict[str, list[float]]] = {p: {"small": [], "huge": []} for p in PATTERNS}
        for r in range(args.rounds):
            for kind in ("small", "huge") if r % 2 == 0 else ("huge", "small"):
                for name, (inflight, req) in PATTERNS.items():
                    runs[name][kind].append(read_all(path, regions[kind].view, args.chunks, inflight, req))
        out = {"huge_pages_given": regions["huge"].huge, "page_cache_dropped": drop_caches(), "patterns": {}}
        for name, v in runs.items():
            ratios = [h / s for h, s in zip(v["huge"], v["small"], strict=True)]
            out["patterns"][name] = {
                "huge_gbps": statistics.median(v["huge"]), "small_gbps": statistics.median(v["small"]),
                "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.rounds} rounds; huge pages given: {out['huge_pages_given']}; "
          f"page cache dropped: {out['page_cache_dropped']}")
    for name, p in out["patterns"].items():
        print(f"{name:10s} huge {p['huge_gbps']:.2f} GB/s  small {p['small_gbps']:.2f} GB/s  "
              f"huge/small {p['ratio']:.2f} [{p['ratio_min']:.2f}-{p['ratio_max']:.2f}]")


if __name__ == "__main__":
    main()
