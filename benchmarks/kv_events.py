"""What KV events for routers cost the scheduler's step: medians, each next to a plain index
read of the same chunks measured in the same run.

    python benchmarks/kv_events.py [--chunks 20000] [--rounds 15] [--dir DIR]

1. ``Announcer.take()`` in a step with nothing to announce (the event log looked at: its
   poll is due every step here, every 0.5 s in an engine), next to one ``Store.locate`` of
   64 keys;
2. one re-announce step (a page of 64 records read, their chunks located, 64 ``Stored``
   events made) on a store of ``--chunks`` announced chunks, and the whole re-announce;
3. the announcement records' write (``Store.announced``) of 64 chunks, as an engine makes
   it every 5 s.

The event volume on the wire (bytes per saved chunk) is measured by ``demo/router_demo.py``
on a real engine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_hook.announce import Announcer, Record  # noqa: E402
from store import KVFormat, MiB, Namespace, PutItem, Store, StoreConfig, TierConfig  # noqa: E402

FMT = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=16, chunk_size=256)  # 8 KiB chunks
BS = 128


def median_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    folder = tempfile.mkdtemp(dir=a.dir, prefix="lmctl-kv-events-")
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=4096 * MiB)}, segment_bytes=64 * MiB, fsync=False)
    rng = random.Random(1)
    ns = Namespace("m", FMT)
    with Store(os.path.join(folder, "store"), cfg) as s:
        keys: list[bytes] = []
        for _ in range(a.chunks // 4):  # chains of four chunks
            toks = [rng.randrange(0, 50000) for _ in range(1024)]
            keys.extend(ns.chunk_keys(toks))
            recs = []
            for c, k in enumerate(ns.chunk_keys(toks)):
                h = [rng.getrandbits(64), rng.getrandbits(64)]
                recs.append((k, c, Record(h, None if c == 0 else rng.getrandbits(64), toks[256 * c:256 * (c + 1)],
                                          BS, "civil").encode()))
            s.announced(note=recs)
        for i in range(0, len(keys), 512):
            s.put_many([PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "uint8"}, 256) for k in keys[i:i + 512]])
        print(f"store: {len(keys)} chunks announced, record {len(recs[-1][2])} bytes each")
        sample = keys[:64]
        locate = median_s(lambda: s.locate(sample, remote=False), a.rounds)
        idle = Announcer(s, lambda nid: True, BS, 256, reannounce=False, poll_s=0.0)
        idle_take = median_s(idle.take, a.rounds)
        print(f"1. a step with nothing to announce (event log looked at): {idle_take * 1e3:.3f} ms; "
              f"locate of 64 keys {locate * 1e3:.3f} ms; ratio {idle_take / locate:.2f}")
        steps: list[float] = []
        ann = Announcer(s, lambda nid: True, BS, 256, poll_s=3600.0, write_s=3600.0)
        t_all = time.perf_counter()
        n = 0
        while ann.reannouncing:
            t0 = time.perf_counter()
            n += len(ann.take())
            steps.append(time.perf_counter() - t0)
        t_all = time.perf_counter() - t_all
        med = statistics.median(steps)
        print(f"2. re-announce step (64 chunks): median {med * 1e3:.3f} ms, max {max(steps) * 1e3:.3f} ms, "
              f"ratio to locate of 64 keys {med / locate:.2f}; all {n} chunks in {len(steps)} steps, "
              f"{t_all:.2f} s ({n / t_all:.0f} chunks/s)")
        batch = [(k, 0, recs[0][2]) for k in sample]
        write = median_s(lambda: s.announced(note=batch, log={"stored": sample}), a.rounds)
        print(f"3. writing 64 chunks' records and their event: {write * 1e3:.3f} ms (one transaction, every 5 s)")


if __name__ == "__main__":
    main()
