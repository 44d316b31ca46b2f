"""What the event log and prefix ids cost: medians and ratios, each against the same work
without them, measured in the same run.

    python benchmarks/events.py [--rounds 15] [--dir DIR]

1. prefix ids of a 32k-token prompt (256-token chunks) next to its chunk keys (the
   scheduler computes both for a request that saves);
2. a put_many batch of 64 small chunks (so that the index, not the disk, is what is
   measured; fsync off) with and without prefix ids;
3. evicting 2048 chunks by key with and without the event log (``Index.event_log`` None);
4. ``Store.explain`` of a missing document on a store of 20000 chunks (another adapter
   holds it), next to a plain ``Store.lookup``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from store import AdapterIdentity, KVFormat, MiB, Namespace, PutItem, Store, StoreConfig, TierConfig
from store.format.keys import chunk_keys, prefix_ids

FMT = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=256, chunk_size=16)  # 8 KiB chunks


def median_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def show(what: str, base: float, other: float, base_name: str, other_name: str) -> None:
    print(f"{what}: {base_name} {base * 1e3:.3f} ms, {other_name} {other * 1e3:.3f} ms, ratio {other / base:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dir", default=None, help="where the stores go [default: a temporary folder]")
    a = ap.parse_args()
    root = tempfile.mkdtemp(dir=a.dir)

    # 1. prefix ids next to chunk keys
    big = KVFormat("bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, chunk_size=256)
    ns = Namespace("m", big)
    prompt = list(range(32768))
    secret = os.urandom(32)
    keys_s = median_s(lambda: chunk_keys(ns, prompt), a.rounds)
    ids_s = median_s(lambda: prefix_ids(prompt, 256, secret), a.rounds)
    show("32768-token prompt, 128 chunks", keys_s, ids_s, "chunk keys", "prefix ids")

    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=4096 * MiB)}, segment_bytes=64 * MiB, fsync=False)
    with Store(os.path.join(root, "s"), cfg) as s:
        base = Namespace("m", FMT)
        n = [0]

        def batch(with_prefix: bool) -> Callable[[], object]:
            def run() -> object:
                toks = [n[0] * 10_000 + i for i in range(16 * 64)]
                n[0] += 1
                ks = base.chunk_keys(toks)
                ps = s.prefix_ids(toks, 16) if with_prefix else [None] * len(ks)
                return s.put_many([PutItem(k, bytes(FMT.chunk_bytes), {"dtype": "uint8"}, 16, prefix=p)
                                   for k, p in zip(ks, ps, strict=True)])
            return run

        # alternating rounds, so that a store that grows (or a busy machine) weighs on both alike
        plain, with_ids = [], []
        for _ in range(a.rounds):
            plain.append(median_s(batch(False), 1))
            with_ids.append(median_s(batch(True), 1))
        show("put_many of 64 chunks", statistics.median(plain), statistics.median(with_ids),
             "without prefix ids", "with")

        # 3. evictions with and without the event log
        def evict(log_on: bool) -> float:
            toks = [n[0] * 10_000 + i for i in range(16 * 2048)]
            n[0] += 1
            ks = base.chunk_keys(toks)
            s.put_many([PutItem(k, bytes(FMT.chunk_bytes), {"dtype": "uint8"}, 16) for k in ks])
            saved = s._index.event_log
            s._index.event_log = saved if log_on else None
            try:
                t0 = time.perf_counter()
                s.evict(ks)
                return time.perf_counter() - t0
            finally:
                s._index.event_log = saved

        off, on = [], []
        for _ in range(a.rounds):
            off.append(evict(False))
            on.append(evict(True))
        show("evict 2048 chunks", statistics.median(off), statistics.median(on), "no event log", "with")

    # 4. explain on a store of 20000 chunks
    with Store(os.path.join(root, "e"), cfg) as s:
        held = Namespace("m", FMT, AdapterIdentity("civil", "1" * 32))
        asked = Namespace("m", FMT, AdapterIdentity("civil", "2" * 32))
        for ns_ in (held, asked):
            s.register_namespace(ns_)
        for b in range(20000 // 1000):
            toks = [b * 100_000 + i for i in range(16 * 1000)]
            s.put_many([PutItem(k, bytes(FMT.chunk_bytes), {"dtype": "uint8"}, 16, prefix=p)
                        for k, p in zip(held.chunk_keys(toks), s.prefix_ids(toks, 16), strict=True)])
        doc = list(range(16 * 64))
        s.put_many([PutItem(k, bytes(FMT.chunk_bytes), {"dtype": "uint8"}, 16, prefix=p)
                    for k, p in zip(held.chunk_keys(doc), s.prefix_ids(doc, 16), strict=True)])
        ex = s.explain(asked, doc)
        assert ex is not None and ex.reason == "other-adapter-version"
        look = median_s(lambda: s.lookup(asked, doc), a.rounds)
        expl = median_s(lambda: s.explain(asked, doc), a.rounds)
        show("1024-token document, 20000 chunks stored", look, expl, "lookup", "explain")


if __name__ == "__main__":
    main()
