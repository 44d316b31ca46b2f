"""What durable acknowledgements cost: put batches and pins with and without the sync of
LMDB's meta page after their commit (``Index.sync``), interleaved in one run.

    .venv/bin/python benchmarks/durable_put.py [--dir DIR] [--rounds 9] [--json]

Put batches (4 chunks, ``fsync`` on), three variants, each its own store on the same disk:

  shipped    as lmctl does it: the batch's commit is synced in the background within
             ``SYNC_SOON_S`` (one sync for all the batches of that second)
  per-batch  the commit synced before put_many returns (one fdatasync more per batch)
  none       no sync after the commit (before this was added: a power cut could undo the last
             acknowledged commit, however old)

Pins: ``shipped`` (synced before pin returns) against ``none``. Every round runs the variants
in a rotating order; a ratio is a variant's median time per call over ``none``'s in the same
round, and the report gives the median and range of the rounds' ratios (the disk's drift
between rounds cancels).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import GiB, MiB, PutItem, Store, StoreConfig, TierConfig  # noqa: E402

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "5.6MiB": 30 * 2 * 256 * 3 * 64 * 2}  # the last: SmolLM2-135M
BATCH = 4


def open_store(path: Path, variant: str) -> tuple[Store, Callable[[], None]]:
    """The store, and what runs after each call (the per-batch variant's sync)."""
    s = Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * GiB, pin_budget=0.5)},
                                segment_bytes=256 * MiB))
    sync = s._index.sync
    if variant == "none":
        s._index.sync = lambda: None  # type: ignore[method-assign]
    return s, (sync if variant == "per-batch" else lambda: None)


def timed(calls: int, fn: Callable[[int], None], after: Callable[[], None]) -> float:
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        after()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="a folder on the disk to measure (default: a temporary one under the cwd)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--mib-per-round", type=int, default=96, help="bytes put per round, size and variant")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="durable-put-", dir=args.dir or os.getcwd()))
    result: dict[str, object] = {"load_start": os.getloadavg()[0]}
    try:
        for name, size in {**SIZES, "pin": 0}.items():
            variants = ("shipped", "none") if not size else ("shipped", "per-batch", "none")
            stores = {v: open_store(base / f"{name}-{v}", v) for v in variants}
            calls = 64 if not size else max(8, args.mib_per_round * MiB // (size * BATCH))
            data = os.urandom(size)
            ratios: dict[str, list[float]] = {v: [] for v in variants if v != "none"}
            ms: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                per: dict[str, float] = {}
                for j in range(len(variants)):
                    v = variants[(r + j) % len(variants)]
                    s, after = stores[v]
                    first = r * calls * BATCH

                    def put(i: int, s: Store = s, first: int = first) -> None:
                        s.put_many([PutItem((first + i * BATCH + j).to_bytes(48, "big"), data, {"dtype": "uint8"}, 16)
                                    for j in range(BATCH)])

                    def pin(i: int, s: Store = s, first: int = first) -> None:
                        s.pin(f"bench{first + i}", [(first + i).to_bytes(48, "big")])

                    per[v] = timed(calls, put if size else pin, after)
                    ms[v].append(per[v])
                for v in ratios:
                    ratios[v].append(per[v] / per["none"])
            for s, _after in stores.values():
                s.close()
                shutil.rmtree(s.path, ignore_errors=True)
            result[name] = {
                "what": "pin of one key" if not size else f"put_many of {BATCH} chunks",
                "ms": {v: round(1e3 * statistics.median(x), 3) for v, x in ms.items()},
                "ratio": {v: {"median": round(statistics.median(x), 3), "min": round(min(x), 3),
                              "max": round(max(x), 3)} for v, x in ratios.items()}}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["load_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"load average {result['load_start']:.2f} -> {result['load_end']:.2f}; ratio = time per call over "
          f"'none' (median of {args.rounds} interleaved rounds [min, max])")
    for name in [*SIZES, "pin"]:
        r = result[name]
        assert isinstance(r, dict)
        cells = "  ".join(f"{v} {x['median']:.3f}x [{x['min']:.3f}, {x['max']:.3f}]" for v, x in r["ratio"].items())
        print(f"  {name:7} {r['what']:24} {cells}  (ms: {r['ms']})")


if __name__ == "__main__":
    main()
