"""Reuse at the engine's block: does it cost bandwidth? One request's save and load, interleaved.

    .venv/bin/python benchmarks/block_reuse.py [--dir DIR] [--rounds 5] [--tokens 4096] [--json]

Per model shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64; an 8B model: 32 layers,
8 KV heads, head dim 128; bf16 KV drawn like real activations), each round runs, on a fresh
store each, in a rotating order (A B C, B C A, C A B, ...):

  chunks   today's 256-token chunks only: the request's full chunks saved (``put_many`` in
           batches of 4, as the connector's writer), then, page cache dropped, a lookup and
           ``get_many_into`` in windows of 4 (as the connector's loader)
  blocks   the same request saved with an alias at every 16-token block boundary inside each
           chunk (the keys hashed inside the timed part); loaded by a request that shares all
           but its last 96 tokens: the lookup at 16-token blocks finds the full chunks and the
           last chunk's first blocks through an alias, and that chunk's whole record is read
  tail     a request that ends 96 tokens before a chunk boundary: its full chunks and its
           tail (whole 16-token blocks) as a record of its own with its aliases; loaded by a
           request that shares all of it (the tail record read exactly)

Then the fixed costs alone, without payload I/O (a store on tmpfs, 1 KiB records): making the
request's keys and aliases, and ``put_many`` of its 16 records with and without their aliases
(interleaved, medians): what reuse at the block adds to a save whatever the disk.

Bandwidth is the KV bytes of the tokens saved, or of the tokens a load supplies, per second
(lookup included). Ratios to ``chunks`` are taken within each round, so the disk's drift
between rounds cancels; the report gives medians and ranges. The load average is recorded at
the start and the end.
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_io import buffers, drop_caches, fill_bf16  # noqa: E402

from store import GiB, KVFormat, Namespace, PutItem, Store, StoreConfig, TierConfig, record_key  # noqa: E402

SHAPES = {"smollm2_bf16": (30, 3, 64), "8b_bf16": (32, 8, 128)}
BATCH = 4  # the connector's writer batch and loader window
BLOCK = 16  # vLLM's block on GPUs: the finest granularity, the most aliases


def _items(ns: Namespace, tokens: list[int], src: memoryview, block: int | None, tail: bool) -> list[PutItem]:
    fmt = ns.kv_format
    cs = fmt.chunk_size
    per_token = fmt.chunk_bytes // cs
    keys = ns.chunk_keys(tokens)
    out = []
    for c in range(len(keys)):
        aliases = record_key(ns, keys, tokens, c, block)[1] if block else None
        out.append(PutItem(keys[c], src[: fmt.chunk_bytes], {"dtype": "bfloat16", "shape": list(fmt.chunk_shape)},
                           cs, aliases=aliases))
    n = (len(tokens) - len(keys) * cs) // BLOCK * BLOCK
    if tail and n:
        k, aliases = record_key(ns, keys, tokens, len(keys), BLOCK, n)
        shape = [fmt.num_layers, 2, n, fmt.num_kv_heads, fmt.head_dim]
        out.append(PutItem(k, src[: n * per_token], {"dtype": "bfloat16", "shape": shape}, n, aliases=aliases))
    return out


def one(sdir: Path, ns: Namespace, variant: str, n_tokens: int, src: memoryview,
        outs: list[memoryview]) -> dict[str, float]:
    """Save then cold-load one request in a fresh store: GB/s of each, and the tokens loaded."""
    fmt = ns.kv_format
    per_token = fmt.chunk_bytes // fmt.chunk_size
    base = list(range(10, 10 + n_tokens))
    if variant == "chunks":
        saved, asked, block = base, base, None
    elif variant == "blocks":
        saved, asked, block = base, base[:-96] + list(range(900000, 900096)), BLOCK
    else:  # tail
        saved, asked, block = base[:-96], base[:-96] + [7], BLOCK
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=64 * GiB)}, segment_bytes=1 * GiB, codec="raw")
    try:
        with Store(sdir, cfg) as st:
            t0 = time.perf_counter()  # the keys and aliases are made inside the timed part, as in the engine
            items = _items(ns, saved, src, block, variant == "tail")
            for b in range(0, len(items), BATCH):
                assert all(st.put_many(items[b : b + BATCH]))
            save_s = time.perf_counter() - t0
            save_bytes = sum(len(memoryview(it.data)) for it in items)
            drop_caches()
            t0 = time.perf_counter()
            found = st.lookup(ns, asked, remote=False, block=block)
            end = min(found.hit_tokens, (len(asked) - 1) // BLOCK * BLOCK)
            keys, wants = list(found.keys[: found.hit_chunks]), [fmt.chunk_bytes] * found.hit_chunks
            keys, wants = keys[: -(-end // fmt.chunk_size)], wants[: -(-end // fmt.chunk_size)]
            if found.partial is not None and end > found.hit_chunks * fmt.chunk_size:
                keys.append(found.partial.key)
                wants.append(found.partial.record_tokens * per_token)
            for b in range(0, len(keys), BATCH):
                part = keys[b : b + BATCH]
                got = st.get_many_into(part, outs[: len(part)], expect=wants[b : b + BATCH])
                assert all(g is not None for g in got)
            load_s = time.perf_counter() - t0
            read_bytes = sum(wants)
        return {"save_gbps": save_bytes / save_s / 1e9, "load_gbps": end * per_token / load_s / 1e9,
                "tokens_loaded": end, "read_bytes_per_token_loaded": read_bytes / max(1, end * per_token)}
    finally:
        shutil.rmtree(sdir, ignore_errors=True)


def fixed_costs(n_tokens: int, rounds: int = 21) -> dict[str, float]:
    """Milliseconds of the per-request work that reuse at the block adds: the keys and
    aliases of every chunk, and the index rows (records of 1 KiB on tmpfs, so payload I/O
    is next to nothing)."""
    ns = Namespace("bench-fixed", KVFormat("bfloat16", 30, 3, 64), model_fingerprint="bench")
    cs = ns.kv_format.chunk_size
    toks = list(range(n_tokens))
    keys = ns.chunk_keys(toks)
    hashing = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c in range(len(keys)):
            record_key(ns, keys, toks, c, BLOCK)
        hashing.append(time.perf_counter() - t0)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="lmctl-fixed-", dir=shm))
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=4 * GiB, path=str(d / "dram"))}, segment_bytes=1 * GiB,
                      codec="raw", default_tier="dram")
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        with Store(d / "store", cfg) as st:
            data = bytes(1024)
            for r in range(rounds):
                for aliased in ((False, True) if r % 2 else (True, False)):
                    t = list(range(10**6 * (2 * r + aliased), 10**6 * (2 * r + aliased) + n_tokens))
                    ks = ns.chunk_keys(t)
                    items = [PutItem(k, data, {"dtype": "uint8"}, cs,
                                     aliases=record_key(ns, ks, t, c, BLOCK)[1] if aliased else None)
                             for c, k in enumerate(ks)]
                    t0 = time.perf_counter()
                    for b in range(0, len(items), BATCH):
                        assert all(st.put_many(items[b : b + BATCH]))
                    times[aliased].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"keys_and_aliases_ms": statistics.median(hashing) * 1e3,
            "put_index_ms": statistics.median(times[False]) * 1e3,
            "put_index_with_aliases_ms": statistics.median(times[True]) * 1e3}


def bench_shape(base: Path, name: str, rounds: int, n_tokens: int) -> dict[str, Any]:
    layers, heads, dim = SHAPES[name]
    ns = Namespace("bench-" + name, KVFormat("bfloat16", layers, heads, dim), model_fingerprint="bench")
    size = ns.kv_format.chunk_bytes
    src = buffers(size, 1)[0]
    fill_bf16(src, size, seed=1)
    outs = buffers(size, BATCH)
    variants = ["chunks", "blocks", "tail"]
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants[r % 3:] + variants[: r % 3]
        for i, v in enumerate(order):
            runs[v].append(one(base / f"{name}-{r}-{i}", ns, v, n_tokens, src, outs))
    out: dict[str, Any] = {"chunk_mib": size / 2**20}
    for v in variants:
        for m in ("save_gbps", "load_gbps"):
            vals = [x[m] for x in runs[v]]
            out[f"{v}_{m}"] = statistics.median(vals)
            if v != "chunks":
                ratio = [x[m] / c[m] for x, c in zip(runs[v], runs["chunks"], strict=True)]
                out[f"{v}_{m}_ratio"] = statistics.median(ratio)
                out[f"{v}_{m}_ratio_range"] = (min(ratio), max(ratio))
        out[f"{v}_tokens_loaded"] = runs[v][0]["tokens_loaded"]
        out[f"{v}_read_per_loaded"] = runs[v][0]["read_bytes_per_token_loaded"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir under the cwd)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the request")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="lmctl-blocks-", dir=args.dir or os.getcwd()))
    result: dict[str, Any] = {"load_start": os.getloadavg(), "dropped_caches": drop_caches(),
                              "tokens": args.tokens, "rounds": args.rounds}
    try:
        for name in args.shapes.split(","):
            result[name] = bench_shape(base, name, args.rounds, args.tokens)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["fixed"] = fixed_costs(args.tokens)
    result["load_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"one {args.tokens}-token request, {args.rounds} rounds (rotating order), load average "
          f"{result['load_start'][0]:.2f} -> {result['load_end'][0]:.2f}, page cache dropped: "
          f"{result['dropped_caches']}")
    for name in args.shapes.split(","):
        r = result[name]
        print(f"\n{name} (chunk {r['chunk_mib']:.1f} MiB)")
        print(f"{'variant':8} {'save GB/s':>10} {'x chunks':>16} {'load GB/s':>10} {'x chunks':>16} "
              f"{'loaded':>7} {'read/used':>9}")
        for v in ("chunks", "blocks", "tail"):
            def ratio(m: str) -> str:
                if v == "chunks":
                    return ""
                lo, hi = r[f"{v}_{m}_ratio_range"]
                return f"{r[f'{v}_{m}_ratio']:.3f} ({lo:.2f}-{hi:.2f})"
            print(f"{v:8} {r[f'{v}_save_gbps']:10.3f} {ratio('save_gbps'):>16} {r[f'{v}_load_gbps']:10.3f} "
                  f"{ratio('load_gbps'):>16} {r[f'{v}_tokens_loaded']:7d} {r[f'{v}_read_per_loaded']:9.3f}")
    f = result["fixed"]
    print(f"\nfixed costs of one {args.tokens}-token request (no payload I/O): keys and 16-token aliases "
          f"{f['keys_and_aliases_ms']:.2f} ms; index rows of its records {f['put_index_ms']:.2f} ms, with their "
          f"aliases {f['put_index_with_aliases_ms']:.2f} ms")


if __name__ == "__main__":
    main()
