"""A store worker that the reliability suite kills at random moments (run as a script).

usage: worker.py STORE MODE START SIZE CAPACITY

MODE "put": put chunks START, START+1, ... forever; prints "put I" after each acknowledged put.
MODE "churn": the same, and every few puts evicts the oldest live ones ("evicting I" before
the call), compacts every segment it can and rewrites (recompresses or raw-encodes) a recent
chunk, so kills land inside eviction, compaction and rewrite commits too.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from store import Store, StoreConfig, TierConfig  # noqa: E402
from stress.common import content, key  # noqa: E402


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    start, size, capacity = map(int, sys.argv[3:6])
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=capacity)}, segment_bytes=max(1 << 20, size * 6))
    store = Store(path, cfg)
    live: list[int] = []
    i = start
    while True:
        k = key(i)
        store.put(k, content(k, size), {"dtype": "uint8"}, tokens=16)
        print(f"put {i}", flush=True)
        live.append(i)
        if mode == "churn" and i % 4 == 3 and len(live) > 3:
            old, live = live[:3], live[3:]
            for j in old:
                print(f"evicting {j}", flush=True)
            store.evict([key(j) for j in old])
            store.compact(min_dead_ratio=0.0)
            store.rewrite([key(live[-1])], codec="zstd" if i % 8 == 3 else "raw", level=1)
        i += 1


if __name__ == "__main__":
    main()
