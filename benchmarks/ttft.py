"""Time-to-first-token with lmctl in a real vLLM engine (CPU), and throughput on misses.

    .venv/bin/python benchmarks/ttft.py [--sizes 1024,4096,8000] [--repeats 3] [--json]

Model: SmolLM2-135M-Instruct in float32 (see demo/models.py). vLLM's own prefix cache is
off, so a warm request's prefix can only come from the store. For each prefix size:

* recompute: TTFT of a prompt whose prefix the store has never seen (median over
  ``--repeats`` different prefixes; the connector is on, so this includes looking up,
  gathering and queueing the saves);
* warm: TTFT of a prompt sharing that prefix with a new question, the prefix loaded from
  the store (median over ``--repeats`` questions, read with O_DIRECT, so from disk, not
  from the page cache).

Goal: warm <= 1/5 of recompute at 4k tokens.

The floor (``--floor``, on by default): what a warm request cannot beat. vLLM's own prefix
cache hit on the same prompt (an engine without the connector, its prefix cache on: the
prefix computed once, then the same new questions; median), plus the time the store takes
to read the prefix's bytes (``get_into`` of as many chunks, O_DIRECT, no copy into an
engine; median over ``--repeats`` reads). Goal at 4k tokens: warm <= 1.5x the floor.

Throughput on misses: batches of distinct prompts (nothing ever hits) through an engine
without the connector and one with it (which saves every chunk), the two alternating
round by round (off, on, off, on, ...; a fresh engine each round). Goal: with the connector
>= 0.95 of without it.

Mixed workload: batches where half the requests ask about one 4k-token document (in the
store, for the engine with the connector) and half are distinct misses, alternating
without and with the connector the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import demo.engine  # noqa: E402,F401  (sets vLLM's environment before it is imported)
from demo.engine import Engine  # noqa: E402
from demo.models import smollm2  # noqa: E402

WORDS = ("lease tenant landlord rent deposit notice repair premises clause agreement month written "
         "consent insurance damage arbitration court payment term renewal property").split()


def text_tokens(tok: Any, n: int, seed: int) -> list[int]:
    """About ``n`` token ids of natural-looking text, distinct per seed from the first token."""
    rng = random.Random(seed)
    words = [f"Document {seed}."]
    ids: list[int] = []
    while len(ids) < n:
        words.extend(rng.choice(WORDS) for _ in range(64))
        ids = tok(" ".join(words))["input_ids"]
    return list(ids[:n])


def ttft(eng: Engine, tokens: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = eng.llm.generate([{"prompt_token_ids": tokens}], _params(1), use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    eng.flush()  # outside the timing: saves are written in the background
    return dt, int(out.num_cached_tokens or 0)


def _params(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def throughput(eng: Engine, batch: list[list[int]], out_tokens: int) -> float:
    """Tokens (prompt + generated) per second for one batch."""
    t0 = time.perf_counter()
    eng.llm.generate([{"prompt_token_ids": t} for t in batch], _params(out_tokens), use_tqdm=False)
    dt = time.perf_counter() - t0
    return (sum(len(t) for t in batch) + out_tokens * len(batch)) / dt


def floor(model: Path, tok: Any, store_path: Path, sizes: list[int], repeats: int, result: dict[str, Any]) -> None:
    """vLLM's own prefix-cache hit and the store's raw read of the same bytes, per size."""
    from store import open_shared, release_shared
    from store.format.record import ALIGN

    store = open_shared(store_path)
    try:
        infos = [i for i in store.iter_chunks() if i.tier != "remote"]
        nbytes = max(i.raw_bytes for i in infos)
        import numpy as np

        raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)  # page-aligned, as the connector's staging buffers
        skip = (-raw.ctypes.data) % ALIGN
        buf = raw[skip : skip + nbytes].data
        for size in sizes:
            n = size // 256
            times = []
            for r in range(repeats):
                keys = [i.key for i in infos[r * n % max(1, len(infos) - n) :][:n]]
                t0 = time.perf_counter()
                for k in keys:
                    store.get_into(k, buf, touch=False)
                times.append(time.perf_counter() - t0)
            result["sizes"][str(size)]["raw_read_s"] = round(statistics.median(times), 4)
    finally:
        release_shared(store)
    eng = Engine(model, None, max_model_len=min(8192, max(sizes) + 64), lora=False, prefix_caching=True)
    try:
        warm_up = text_tokens(tok, 512, 998)  # a prefix computed, then hit: both paths warmed up
        for q in range(3):
            ttft(eng, warm_up + text_tokens(tok, 16, 90 + q))
        for size in sizes:
            prefix = text_tokens(tok, size, 1000 * size + repeats - 1)  # the prefix the warm requests used
            ttft(eng, prefix + text_tokens(tok, 16, 1))  # computed once: now in vLLM's prefix cache
            runs = [ttft(eng, prefix + text_tokens(tok, 16, 100 + q)) for q in range(repeats)]
            r = result["sizes"][str(size)]
            r["prefix_hit_s"] = round(statistics.median(dt for dt, _ in runs), 4)
            r["prefix_hit_cached_tokens"] = int(statistics.median(c for _, c in runs))
            r["floor_s"] = round(r["prefix_hit_s"] + r["raw_read_s"], 4)
            r["warm_over_floor"] = round(r["warm_s"] / r["floor_s"], 3)
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096,8000", help="prefix lengths (the model takes 8192 tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--miss-prompts", type=int, default=6, help="prompts per throughput batch")
    ap.add_argument("--miss-tokens", type=int, default=1024, help="tokens per throughput prompt")
    ap.add_argument("--rounds", type=int, default=3, help="throughput batches per engine (median)")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="skip vLLM's own prefix-cache hit and the store's raw read of the same bytes")
    ap.add_argument("--no-throughput", dest="throughput", action="store_false",
                    help="skip the throughput and mixed-workload rounds")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--work", default=str(ROOT / ".cache"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    model = smollm2(Path(args.work) / "models" / "smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tmp = Path(tempfile.mkdtemp(prefix="lmctl-ttft-", dir=args.work))
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct float32", "sizes": {},
                              "loadavg_start": os.getloadavg()}
    try:
        eng = Engine(model, tmp / "store", max_model_len=min(8192, max(sizes) + 64), lora=False)
        ttft(eng, text_tokens(tok, 300, 999))  # warm up the engine
        for size in sizes:
            cold, warm, cached = [], [], []
            for r in range(args.repeats):
                prefix = text_tokens(tok, size, 1000 * size + r)
                cold.append(ttft(eng, prefix + text_tokens(tok, 16, 1))[0])
            # the last prefix is now in the store: ask new questions about it
            for q in range(args.repeats):
                dt, c = ttft(eng, prefix + text_tokens(tok, 16, 100 + q))
                warm.append(dt)
                cached.append(c)
            rec = statistics.median(cold)
            hot = statistics.median(warm)
            result["sizes"][str(size)] = {"recompute_s": round(rec, 3), "warm_s": round(hot, 3),
                                          "ratio": round(hot / rec, 4), "speedup": round(rec / hot, 1),
                                          "cached_tokens": int(statistics.median(cached))}
        from engine_hook.vllm import live_connectors

        result["connector"] = next(c for c in live_connectors() if c.role.name == "WORKER").stats()
        eng.close()
        if args.floor:
            floor(model, tok, tmp / "store", sizes, args.repeats, result)

        rounds: dict[str, list[float]] = {"off": [], "on": []}
        mixed: dict[str, list[float]] = {"off": [], "on": []}
        seed = 10**6
        doc = text_tokens(tok, 4096, 31337)
        for _ in range(args.rounds if args.throughput else 0):
            for mode in ("off", "on"):
                eng = Engine(model, None if mode == "off" else tmp / "store-miss",
                             max_model_len=max(args.miss_tokens, len(doc)) + 64, lora=False)
                throughput(eng, [text_tokens(tok, 200, 5)], 4)  # warm up
                batch = []
                for _ in range(args.miss_prompts):
                    seed += 1
                    batch.append(text_tokens(tok, args.miss_tokens, seed))
                rounds[mode].append(throughput(eng, batch, 16))
                if mode == "on":
                    ttft(eng, doc + text_tokens(tok, 16, 7))  # the document is in the store (flushed)
                half = args.miss_prompts // 2
                batch = [doc + text_tokens(tok, 16, 50 + i) for i in range(half)]
                for _ in range(args.miss_prompts - half):
                    seed += 1
                    batch.append(text_tokens(tok, args.miss_tokens, seed))
                mixed[mode].append(throughput(eng, batch, 16))
                eng.flush()
                eng.close()
        if args.throughput:
            off, on = statistics.median(rounds["off"]), statistics.median(rounds["on"])
            result["miss_throughput"] = {"off_tok_s": round(off, 1), "on_tok_s": round(on, 1),
                                         "ratio": round(on / off, 4), "rounds": rounds}
            moff, mon = statistics.median(mixed["off"]), statistics.median(mixed["on"])
            result["mixed_throughput"] = {"off_tok_s": round(moff, 1), "on_tok_s": round(mon, 1),
                                          "ratio": round(mon / moff, 4), "rounds": mixed}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    result["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'prefix':>8} {'recompute':>10} {'warm':>8} {'warm/recompute':>15} {'cached':>7}"
          + (f" {'prefix hit':>11} {'cached':>7} {'raw read':>9} {'floor':>8} {'warm/floor':>11}"
             if args.floor else ""))
    for size, r in result["sizes"].items():
        line = f"{size:>8} {r['recompute_s']:9.3f}s {r['warm_s']:7.3f}s {r['ratio']:15.3f} {r['cached_tokens']:7}"
        if "floor_s" in r:
            line += (f" {r['prefix_hit_s']:10.3f}s {r['prefix_hit_cached_tokens']:7} {r['raw_read_s']:8.3f}s "
                     f"{r['floor_s']:7.3f}s "
                     f"{r['warm_over_floor']:11.2f}")
        print(line)
    if args.floor and "4096" in result["sizes"]:
        x = result["sizes"]["4096"]["warm_over_floor"]
        print(f"goal warm <= 1.5x the floor at 4096 tokens: {x:.2f}x: {'met' if x <= 1.5 else 'NOT met'}")
    if not args.throughput:
        return
    m = result["miss_throughput"]
    print(f"misses: {m['on_tok_s']:.0f} tok/s with the connector, {m['off_tok_s']:.0f} without "
          f"(ratio {m['ratio']:.3f})")
    m = result["mixed_throughput"]
    print(f"mixed (half hit a 4k document): {m['on_tok_s']:.0f} tok/s with the connector, {m['off_tok_s']:.0f} "
          f"without (ratio {m['ratio']:.3f})")


if __name__ == "__main__":
    main()
