"""Model fingerprint cost on a generated ~2 GB safetensors checkpoint, next to the time to
read the same files whole, measured in the same run.

    .venv/bin/python benchmarks/fingerprint.py [--dir DIR] [--gb 2] [--rounds 5] [--json]

The checkpoint is a made-up Llama-like model (bf16, random bytes: the fingerprint does not
care what the numbers are): an embedding, N layers of q/k/v/o projections with biases,
gate/up/down projections and two norms, a final norm and an LM head, a few hundred tensors
over two shard files, plus config.json and the weight index. It is written to a temporary
folder under --dir and removed at the end.

Each round measures, in this order:
  fp_cold    the fingerprint with the checkpoint's pages out of the page cache
  read_cold  reading every weight file whole (16 MiB reads into one reused buffer), cold
  fp_warm    the fingerprint again with every page cached (the common case: vLLM has just
             read the weights)
  read_warm  reading the files whole from the page cache
The per-process cache of fingerprints is cleared before each fingerprint run.

Pages are evicted with ``sync; echo 3 > /proc/sys/vm/drop_caches`` when running as root
(and that file is writable), else with posix_fadvise(DONTNEED) on the checkpoint's files
alone; the fraction of the files still resident afterwards (mincore) is reported, and if
neither works the "cold" figures are warm and the output says so.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_hook.fingerprint import clear_cache, folder_fingerprint  # noqa: E402

HIDDEN, INTER, VOCAB, KV = 2048, 5632, 32000, 512


def layout(gb: float) -> list[tuple[str, list[int]]]:
    """(name, shape) of every bf16 tensor of a model of about ``gb`` GB."""
    per_layer = [
        ("input_layernorm.weight", [HIDDEN]), ("post_attention_layernorm.weight", [HIDDEN]),
        ("self_attn.q_proj.weight", [HIDDEN, HIDDEN]), ("self_attn.q_proj.bias", [HIDDEN]),
        ("self_attn.k_proj.weight", [KV, HIDDEN]), ("self_attn.k_proj.bias", [KV]),
        ("self_attn.v_proj.weight", [KV, HIDDEN]), ("self_attn.v_proj.bias", [KV]),
        ("self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
        ("mlp.gate_proj.weight", [INTER, HIDDEN]), ("mlp.up_proj.weight", [INTER, HIDDEN]),
        ("mlp.down_proj.weight", [HIDDEN, INTER]),
    ]
    layer_bytes = sum(2 * _numel(s) for _, s in per_layer)
    fixed = 2 * (2 * VOCAB * HIDDEN + HIDDEN)
    n_layers = max(1, round((gb * 1e9 - fixed) / layer_bytes))
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(n_layers):
        out += [(f"model.layers.{i}.{n}", s) for n, s in per_layer]
    out += [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(folder: Path, gb: float, shards: int = 2) -> tuple[int, int]:
    """Write the checkpoint; returns (tensors, bytes of weight files)."""
    tensors = layout(gb)
    total = sum(2 * _numel(s) for _, s in tensors)
    pool = os.urandom(32 << 20)
    per_shard = total / shards
    groups: list[list[tuple[str, list[int]]]] = [[] for _ in range(shards)]
    acc = 0
    for name, shape in tensors:
        groups[min(shards - 1, int(acc // per_shard))].append((name, shape))
        acc += 2 * _numel(shape)
    weight_map = {}
    written = 0
    for si, group in enumerate(groups):
        fname = f"model-{si + 1:05d}-of-{shards:05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape in group:
            n = 2 * _numel(shape)
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)
        with open(folder / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            rot = si * 7919
            left = off
            while left:
                rot = (rot * 1103515245 + 12345) % (len(pool) - (1 << 20))
                n = min(left, 16 << 20, len(pool) - rot)
                f.write(pool[rot : rot + n])
                left -= n
            written += f.tell()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": (len(tensors) - 3) // 12, "num_attention_heads": 16, "num_key_value_heads": 4,
        "vocab_size": VOCAB, "torch_dtype": "bfloat16"}, indent=2))
    os.sync()
    return len(tensors), written


# -- page cache ---------------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def resident_fraction(files: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mmap + mincore, touching nothing)."""
    libc = _libc
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    have = total = 0
    for p in files:
        size = p.stat().st_size
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                have += sum(v & 1 for v in bytes(vec))
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return have / total if total else 0.0


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def evict(files: list[Path], method: str) -> None:
    os.sync()
    if method == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_whole(files: list[Path], buf: bytearray) -> int:
    view = memoryview(buf)
    n = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while got := f.readinto(view):
                n += got
    return n


def stats(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: the temp folder)")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--evict", choices=["auto", "drop_caches", "fadvise", "none"], default="auto")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    method = args.evict
    if method == "auto":
        method = "drop_caches" if can_drop_caches() else "fadvise"
    tmp = Path(tempfile.mkdtemp(prefix="lmctl-fp-bench-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        n_tensors, weight_bytes = write_checkpoint(tmp, args.gb)
        gen_s = time.perf_counter() - t0
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        weights = [p for p in files if p.suffix == ".safetensors"]
        buf = bytearray(16 << 20)
        fp_cold: list[float] = []
        fp_warm: list[float] = []
        rd_cold: list[float] = []
        rd_warm: list[float] = []
        resident: list[float] = []
        digests = set()
        read_bytes = 0
        for _ in range(args.rounds):
            if method != "none":
                evict(files, method)
            resident.append(resident_fraction(files))
            clear_cache()
            fp = folder_fingerprint(tmp)
            fp_cold.append(fp.seconds)
            digests.add(fp.digest)
            read_bytes = fp.bytes_read
            if method != "none":
                evict(files, method)
            t = time.perf_counter()
            read_whole(weights, buf)
            rd_cold.append(time.perf_counter() - t)
            clear_cache()
            fp = folder_fingerprint(tmp)
            fp_warm.append(fp.seconds)
            digests.add(fp.digest)
            t = time.perf_counter()
            read_whole(weights, buf)
            rd_warm.append(time.perf_counter() - t)
        cold_ok = method != "none" and max(resident) < 0.05
        out: dict[str, Any] = {
            "checkpoint": {"bytes": weight_bytes, "tensors": n_tensors, "shards": len(weights),
                           "generate_s": round(gen_s, 2)},
            "rounds": args.rounds,
            "evict": method,
            "resident_before_cold_max": round(max(resident), 4),
            "cold_is_cold": cold_ok,
            "fingerprint_bytes_read": read_bytes,
            "fingerprint_read_fraction": read_bytes / weight_bytes,
            "fp_cold": stats(fp_cold), "read_cold": stats(rd_cold),
            "fp_warm": stats(fp_warm), "read_warm": stats(rd_warm),
            "read_cold_gbps": weight_bytes / statistics.median(rd_cold) / 1e9,
            "ratio_cold": statistics.median(rd_cold) / statistics.median(fp_cold),
            "ratio_warm": statistics.median(rd_warm) / statistics.median(fp_warm),
            "deterministic": len(digests) == 1,
        }
        if args.json:
            print(json.dumps(out, indent=2))
            return
        c = out["checkpoint"]
        print(f"checkpoint: {c['bytes'] / 1e9:.2f} GB, {c['tensors']} tensors in {c['shards']} safetensors shards "
              f"(generated in {c['generate_s']} s)")
        note = "" if cold_ok else "  (NOT cold: pages could not be evicted; these are warm figures)"
        print(f"eviction: {method}; resident before each cold run: max {out['resident_before_cold_max']:.1%}{note}")
        print(f"fingerprint reads {read_bytes / 2**10:.0f} KiB ({out['fingerprint_read_fraction']:.2e} of the weights)"
              f"; digest stable over runs: {out['deterministic']}")
        print(f"{'':12}{'median':>10}{'min':>10}{'max':>10}   ({args.rounds} runs)")
        for key in ("fp_cold", "read_cold", "fp_warm", "read_warm"):
            s = out[key]
            print(f"{key:12}{s['median_s']:>9.3f}s{s['min_s']:>9.3f}s{s['max_s']:>9.3f}s")
        print(f"reading the files whole cold ({out['read_cold_gbps']:.2f} GB/s) takes {out['ratio_cold']:.0f}x the "
              f"cold fingerprint; warm: {out['ratio_warm']:.0f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
