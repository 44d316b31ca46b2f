"""The speed of the checks a remote read runs over every byte, on this machine's CPU.

    .venv/bin/python benchmarks/mac_speed.py [--mib 4] [--repeats 7]

For xxh3-64 (a tier without a secret), keyed BLAKE3 (the head's MAC, and the payload's
before format 4) and the payload's GMAC (``store.format.remote_auth.PayloadMac``), the best of
``--repeats`` passes over a buffer of ``--mib`` MiB, fed in spans of 16 KiB, 64 KiB, 256 KiB
(what a read gives them: ``store.tiers.resp.STEP``) and the whole buffer at once: nanoseconds per
byte and GB/s. One core; nothing else is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import blake3  # noqa: E402
import xxhash  # noqa: E402

from store.format.remote_auth import PayloadMac  # noqa: E402

KiB = 1 << 10


def best_ns_per_byte(make: Callable[[], Any], view: memoryview, span: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = make()
        for i in range(0, len(view), span):
            h.update(view[i:i + span])
        h.digest()
        best = min(best, time.perf_counter() - t0)
    return best / len(view) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    view = memoryview(bytearray(os.urandom(args.mib << 20)))
    key = os.urandom(32)
    checks: dict[str, Callable[[], Any]] = {
        "xxh3-64": xxhash.xxh3_64,
        "keyed BLAKE3": lambda: blake3.blake3(key=key),
        "GMAC": lambda: PayloadMac(key),
    }
    spans = [16 * KiB, 64 * KiB, 256 * KiB, len(view)]
    print(f"{'check':<14}" + "".join(f"{f'{s // KiB} KiB' if s < len(view) else 'whole':>16}" for s in spans))
    for name, make in checks.items():
        row = ""
        for s in spans:
            ns = best_ns_per_byte(make, view, s, args.repeats)
            row += f"{f'{ns:.3f} ns/B':>16}"
        print(f"{name:<14}{row}")
    print(f"({args.mib} MiB buffer, best of {args.repeats} passes; GB/s = 1 / (ns/B), one core)")


if __name__ == "__main__":
    main()
