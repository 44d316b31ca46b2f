"""Chunk save and load between GPU paged KV and page-locked host buffers, against the
host-device copy bandwidth of the same machine, measured in the same run.

A save gathers one chunk's blocks out of the engine's paged cache (every layer, in the
layout vLLM chose) into a pinned staging buffer the store writes from; a load scatters a
pinned buffer the store read into back into blocks. Both are what the connector does
(``engine_hook.transfer.PagedKV``); the bound is a plain copy of a chunk-sized contiguous
pinned buffer to or from the device (``cudaMemcpy``). Patterns are interleaved round by
round (A B A B); the figures are medians over rounds, with the range.

    python benchmarks/gpu_transfer.py --rounds 20

Needs torch with CUDA; no vLLM (the caches are laid out as vLLM 0.32 lays them out,
tests/kv_layout_support.py). Goal: save and load each >= 0.8x the copy bandwidth in the
same direction, for chunk-sized transfers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_hook.transfer import PagedKV, StagingPool, chunk_tensor  # noqa: E402
from store import KVFormat  # noqa: E402
from testsupport.kv_layouts import paged_caches  # noqa: E402

SHAPES = {
    # name: (layers, kv heads, head dim, planes): one tensor-parallel rank's chunk of 256 tokens
    "8b_bf16": (32, 8, 128, 2),         # Llama-3-8B: 32 MiB
    "smollm2_bf16": (30, 3, 64, 2),      # SmolLM2-135M: 5.6 MiB
    "mla_bf16": (27, 1, 576, 1),         # DeepSeek-V2-Lite's latent: 7.6 MiB
}


def timed(fn: Callable[[], None], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=8, help="chunks moved per measurement")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layouts", default="LBHNC,BLHNC", help="vLLM KV cache layouts to try")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="which of: " + ", ".join(SHAPES))
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks that the benchmark runs")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("gpu_transfer: torch sees no CUDA device")
    bs, n = args.block_size, args.chunks
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{device}, torch {torch.__version__}, {args.rounds} rounds of {n} chunks, block size {bs}")
    print(f"{'shape':<14}{'layout':<8}{'chunk':>9}  {'copy D2H':>9}{'save':>7} {'x copy [range]':<19}"
          f"{'copy H2D':>9}{'load':>7} {'x copy [range]':<19}")
    failed = []
    for name in args.shapes.split(","):
        layers, heads, dim, planes = SHAPES[name]
        fmt = KVFormat("bfloat16", num_layers=layers, num_kv_heads=heads, head_dim=dim, kv_planes=planes)
        per_chunk = fmt.chunk_size // bs
        num_blocks = 4 * n * per_chunk
        pool = StagingPool(fmt.chunk_bytes, n, pinned=cuda)
        bufs = [pool.acquire() for _ in range(n)]
        assert all(b is not None for b in bufs)
        host = [chunk_tensor(b, fmt) for b in bufs if b is not None]
        flat = torch.empty(fmt.chunk_bytes, dtype=torch.uint8, device=args.device)
        g = torch.Generator().manual_seed(0)
        for layout in args.layouts.split(","):
            caches = paged_caches(layout, layers, num_blocks, heads, bs, planes * dim, torch.bfloat16, args.device)
            for c in caches:
                c.normal_()
            pk = PagedKV(caches, fmt, bs)
            res: dict[str, list[float]] = {k: [] for k in ("d2h", "save", "h2d", "load")}
            for r in range(args.rounds):
                order = torch.randperm(num_blocks, generator=g).tolist()
                chunks = [order[i * per_chunk : (i + 1) * per_chunk] for i in range(n)]
                def d2h() -> None:
                    for h in host:
                        h.view(-1).view(torch.uint8).copy_(flat)

                def save() -> None:
                    for c, h in zip(chunks, host, strict=True):
                        pk.gather(c, h)

                def h2d() -> None:
                    for h in host:
                        flat.copy_(h.view(-1).view(torch.uint8), non_blocking=True)

                def load() -> None:
                    for c, h in zip(chunks, host, strict=True):
                        pk.scatter(h, c)

                pats: list[tuple[str, Callable[[], None]]] = [("d2h", d2h), ("save", save), ("h2d", h2d),
                                                              ("load", load)]
                if r % 2:
                    pats.reverse()
                for key, fn in pats:
                    res[key].append(n * fmt.chunk_bytes / timed(fn, cuda) / 1e9)
            med = {k: statistics.median(v) for k, v in res.items()}
            ratios = {k: [a / b for a, b in zip(res[k], res[base], strict=True)]
                      for k, base in (("save", "d2h"), ("load", "h2d"))}
            cells = []
            for k, base in (("save", "d2h"), ("load", "h2d")):
                rr = ratios[k]
                cells.append(f"{med[base]:9.2f}{med[k]:7.2f} {statistics.median(rr):5.2f} "
                             f"[{min(rr):.2f}-{max(rr):.2f}]   ")
                if statistics.median(rr) < 0.8:
                    failed.append(f"{name} {layout} {k}")
            print(f"{name:<14}{layout:<8}{fmt.chunk_bytes / 2**20:7.1f}M  " + "".join(cells))
    print("(GB/s, medians over rounds; x copy: the median of each round's ratio to the plain copy of "
          "the same bytes in the same direction, [range] over rounds)")
    print("goal save and load >= 0.8x the copy: " + ("met" if not failed else "NOT met: " + ", ".join(failed)))


if __name__ == "__main__":
    main()
