"""Store I/O benchmark: put and cold get next to the disk's best raw patterns, in one run.

    .venv/bin/python benchmarks/store_io.py [--dir DIR] [--rounds 3] [--depths 1,4] [--json]

Per chunk shape (5.6 MiB: SmolLM2-135M, 32 MiB: an 8B model; 256 tokens of bf16 KV, values
drawn like real activations so that they compress as real KV does), every round runs the raw
patterns and the store, raw first in even rounds and the store first in odd ones (A B B A),
so that the disk's drift between rounds falls on both:

  raw write  O_DIRECT writes of the same bytes, one whole chunk per request, one fdatasync
             per batch (one request's chunks): 1, 4 and 8 chunks in flight on as many
             threads into fresh space, 1 and 4 into space preallocated with fallocate
  raw read   O_DIRECT reads of those bytes, one whole chunk per request, 1, 2, 4 and 8
             chunks in flight on as many threads; and one chunk at a time in 2 MiB pieces,
             4 in flight (the store's single-chunk pattern); the page cache is dropped
             before each (as root; O_DIRECT bypasses it anyway)
  put/get    Store.put_many in batches (durable: payload synced before the index commit),
             then, page cache dropped, Store.get_into of every chunk one by one ("get"), and
             Store.get_many_into of each batch's chunks together ("get_many"), into reused
             page-aligned buffers (verified), for each I/O depth given with --depths, raw
             and compressed (zstd-shuffle, level 1)

The best of the raw patterns of each direction is "the disk". Ratios are taken within each
round (put / that round's best raw write, get / its best raw read, compressed get / raw get),
so the disk's drift between rounds cancels; the report gives their median and range over
rounds. The load average is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import store.format.segment as segment  # noqa: E402
from store import GiB, MiB, PutItem, Store, StoreConfig, TierConfig  # noqa: E402
from store.format.memory import Region, huge_region  # noqa: E402
from store.format.segment import supports_direct_io  # noqa: E402

SHAPES = {
    # 8B-class model (32 layers, 8 KV heads, head dim 128), 256 tokens, bf16: 32 MiB
    "8b_bf16": (32, 8, 128),
    # SmolLM2-135M (30 layers, 3 KV heads, head dim 64), 256 tokens, bf16: 5.6 MiB
    "smollm2_bf16": (30, 3, 64),
}
_LIBC = ctypes.CDLL(None, use_errno=True)


#: a chunk-sized buffer: a slice of ``buffers``'s region, or an mmap of its own
Buf = memoryview | mmap.mmap


def buffers(size: int, count: int) -> list[memoryview]:
    """``count`` page-aligned buffers of ``size`` bytes carved from one region on huge pages
    (where the kernel gives them; else small pages written in order), as the engine's
    staging pool holds them (``store.format.memory.Region``). Measured on this disk: O_DIRECT into
    buffers mapped one by one, or faulted in by the reading threads, runs up to 1.9x slower
    than into such a region (the destination's physical pages decide how many segments
    each request needs; a request here carries at most 254), so every contender but
    LMCache, which brings its own allocator, gets the same memory (docs/performance.md)."""
    region, views = huge_region(size, count)
    _REGIONS.append(region)  # kept alive as long as the views
    return views


_REGIONS: list[Region] = []


def chunk_bytes(layers: int, heads: int, dim: int) -> int:
    return layers * 2 * 256 * heads * dim * 2


def fill_bf16(buf: Buf, n: int, seed: int) -> None:
    """bf16 values of a smooth activation-like distribution (high bytes carry little entropy)."""
    rng = np.random.default_rng(seed)
    f32 = (rng.standard_normal(n // 2, dtype=np.float32) * 0.5).view(np.uint32)
    np.frombuffer(buf, dtype=np.uint16, count=n // 2)[:] = (f32 >> 16).astype(np.uint16)


def _fallocate(fd: int, nbytes: int) -> None:
    if _LIBC.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(nbytes)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


def drop_caches() -> bool:
    """Drop the page cache (root only): cold reads really come from the disk. False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_write(path: str, buf: Buf, size: int, count: int, batch: int, depth: int, prealloc: bool) -> float:
    """GB/s of O_DIRECT writes of ``count`` whole chunks, ``depth`` in flight, one fdatasync per batch."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        if prealloc:
            _fallocate(fd, size * count)
            os.fsync(fd)
        view = memoryview(buf)[:size]

        def one(i: int) -> None:
            done = 0
            while done < size:
                done += os.pwrite(fd, view[done:], i * size + done)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as ex:
            for b in range(0, count, batch):
                list(ex.map(one, range(b, min(count, b + batch))))
                os.fdatasync(fd)
        return size * count / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError("short read")
        done += n


def raw_read(path: str, bufs: list[Buf], size: int, count: int, depth: int, piece: int = 0) -> float:
    """GB/s of O_DIRECT reads of ``count`` chunks: whole chunks, ``depth`` in flight on as
    many threads; with ``piece``, one chunk at a time in pieces of that size, ``depth`` in flight."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as ex:
            if piece:
                view = memoryview(bufs[0])[:size]
                spans = [(a, min(a + piece, size)) for a in range(0, size, piece)]
                for i in range(count):
                    list(ex.map(lambda ab, i=i: _pread_all(fd, view[ab[0]:ab[1]], i * size + ab[0]), spans))
            else:
                list(ex.map(lambda i: _pread_all(fd, memoryview(bufs[i % depth])[:size], i * size), range(count)))
        return size * count / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


#: the raw write patterns: (name, chunks in flight, preallocated)
RAW_WRITES = [("whole_qd1", 1, False), ("whole_qd4", 4, False), ("whole_qd8", 8, False),
              ("whole_qd1_prealloc", 1, True), ("whole_qd4_prealloc", 4, True)]
#: the raw read patterns: (name, requests in flight, piece size or 0 for whole chunks)
RAW_READS = [("whole_qd1", 1, 0), ("whole_qd2", 2, 0), ("whole_qd4", 4, 0), ("whole_qd8", 8, 0),
             ("2m_pieces_qd4", 4, 2 * MiB)]


def raw_round(path: str, src: Buf, rbufs: list[Buf], size: int, count: int,
              batch: int) -> dict[str, float]:
    """GB/s of every raw pattern, each read pattern with the page cache dropped first."""
    out: dict[str, float] = {}
    for name, depth, prealloc in RAW_WRITES:
        out[f"raw_write_{name}"] = raw_write(path, src, size, count, batch, depth, prealloc)
    for name, depth, piece in RAW_READS:
        drop_caches()
        out[f"raw_read_{name}"] = raw_read(path, rbufs, size, count, depth, piece)
    os.unlink(path)
    return out


def store_round(sdir: Path, src: Buf, outs: list[Buf], size: int, count: int, batch: int, codec: str,
                depth: int, tag: int) -> dict[str, float]:
    """put, get (one by one) and get_many (a batch together) GB/s and stored/raw for one store:
    ``count`` chunks put in batches, then read cold both ways."""
    segment.IO_DEPTH = depth
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=64 * GiB)}, segment_bytes=1 * GiB, codec=codec)
    try:
        with Store(sdir, cfg) as st:
            keys = [bytes([tag % 256]) * 16 + i.to_bytes(32, "big") for i in range(count)]
            layout = {"dtype": "bfloat16", "shape": [size // 2]}
            t0 = time.perf_counter()
            for b in range(0, count, batch):
                assert all(st.put_many([PutItem(k, memoryview(src)[:size], layout, 256) for k in keys[b : b + batch]]))
            put = size * count / (time.perf_counter() - t0) / 1e9
            stored = sum(i.stored_bytes for i in st.iter_chunks())
            drop_caches()
            t0 = time.perf_counter()
            for k in keys:
                assert st.get_into(k, outs[0], expect=size) is not None
            get = size * count / (time.perf_counter() - t0) / 1e9
            assert bytes(outs[0][:size]) == bytes(src[:size])
            drop_caches()
            t0 = time.perf_counter()
            for b in range(0, count, batch):
                part = keys[b : b + batch]
                assert all(st.get_many_into(part, outs[: len(part)], expect=size))
            get_many = size * count / (time.perf_counter() - t0) / 1e9
            assert bytes(outs[0][:size]) == bytes(src[:size])
        return {f"put_{codec}_d{depth}": put, f"get_{codec}_d{depth}": get, f"get_many_{codec}_d{depth}": get_many,
                f"stored_ratio_{codec}": stored / (size * count)}
    finally:
        shutil.rmtree(sdir, ignore_errors=True)


def bench_shape(base: Path, name: str, size: int, total: int, rounds: int, batch: int,
                depths: list[int], codecs: list[str]) -> dict[str, object]:
    count = max(batch, total // size)
    src = buffers(size, 1)[0]
    fill_bf16(src, size, 7)
    outs = buffers(size, batch)  # reused, page-aligned, as an engine's staging buffers
    rbufs = buffers(size, 8)
    res: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        res.setdefault(k, []).append(v)

    for r in range(rounds):
        def raw() -> None:
            for k, v in raw_round(str(base / f"raw-{name}-{r}.bin"), src, rbufs, size, count, batch).items():
                add(k, v)

        def ours() -> None:
            for depth in depths:
                for codec in codecs:
                    for k, v in store_round(base / f"store-{name}-{r}", src, outs, size, count, batch, codec,
                                            depth, r).items():
                        add(k, v)

        for step in ((raw, ours) if r % 2 == 0 else (ours, raw)):
            step()
    med = {k: statistics.median(v) for k, v in res.items()}
    best_write = max(v for k, v in med.items() if k.startswith("raw_write"))
    best_read = max(v for k, v in med.items() if k.startswith("raw_read"))
    out_: dict[str, object] = {"chunk_bytes": size, "chunks_per_round": count, "best_raw_write_gbps": best_write,
                               "best_raw_read_gbps": best_read, "medians_gbps": med,
                               "spread": {k: [min(v), max(v)] for k, v in res.items()}}

    def per_round(num: str, den: str | None) -> list[float]:
        """The ratio within each round (so that the disk's drift between rounds cancels);
        ``den`` None: that round's best raw pattern of the same direction."""
        out = []
        for r in range(rounds):
            if den is None:
                kind = "raw_write" if num.startswith("put") else "raw_read"
                d = max(v[r] for k, v in res.items() if k.startswith(kind))
            else:
                d = res[den][r]
            out.append(res[num][r] / d)
        return out

    for depth in depths:
        ratios = {
            "put_ratio": per_round(f"put_raw_d{depth}", None),
            "get_ratio": per_round(f"get_raw_d{depth}", None),
            "get_many_ratio": per_round(f"get_many_raw_d{depth}", None),
        }
        if "zstd-shuffle" in codecs:
            ratios["compressed_get_vs_raw_get"] = per_round(f"get_zstd-shuffle_d{depth}", f"get_raw_d{depth}")
            ratios["compressed_put_vs_raw_put"] = per_round(f"put_zstd-shuffle_d{depth}", f"put_raw_d{depth}")
        out_[f"d{depth}"] = {k: statistics.median(v) for k, v in ratios.items()}
        out_[f"d{depth}_range"] = {k: [min(v), max(v)] for k, v in ratios.items()}
    return out_


def steady_ingest(base: Path, size: int, capacity: int) -> dict[str, float]:
    """Fill a capacity-limited tier three times over (eviction running); write amplification."""
    sdir = base / "steady"
    src = mmap.mmap(-1, size)
    fill_bf16(src, size, 3)
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=capacity)}, segment_bytes=256 * MiB)
    with Store(sdir, cfg) as st:
        for i in range(3 * capacity // size):
            st.put(b"\x07" * 16 + i.to_bytes(32, "big"), memoryview(src)[:size], {"dtype": "bfloat16"}, 256)
            if i % 16 == 15:  # re-read a few old chunks so LRU has something to keep
                st.get_into(b"\x07" * 16 + (i - 8).to_bytes(32, "big"), src)
        stats = st.stats()
    shutil.rmtree(sdir)
    return {"write_amplification": stats.write_amplification, "evicted": stats.counters["evicted"],
            "compacted_bytes": stats.counters["compacted_bytes"], "disk_bytes_at_end": stats.tiers["nvme"].disk_bytes,
            "capacity": capacity}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir under the cwd)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes per round and shape")
    ap.add_argument("--batch", type=int, default=4, help="chunks per put batch and per get_many (one request)")
    ap.add_argument("--depths", default=str(segment.IO_DEPTH), help="store I/O depths to compare, e.g. 1,4")
    ap.add_argument("--codecs", default="raw,zstd-shuffle", help="store codecs to measure (raw is required)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steady-capacity-mib", type=int, default=1024, help="0: skip the steady-ingest phase")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    codecs = args.codecs.split(",")
    if "raw" not in codecs:
        sys.exit("--codecs must include raw (the ratios are taken on it)")

    load_start = os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="lmctl-bench-", dir=args.dir or os.getcwd()))
    try:
        if not supports_direct_io(str(base)):
            sys.exit(f"{base} does not support O_DIRECT; run on a disk-backed folder (--dir)")
        dropped = drop_caches()
        shapes = {name: bench_shape(base, name, chunk_bytes(*SHAPES[name]), args.total_mib * MiB, args.rounds,
                                    args.batch, depths, codecs)
                  for name in args.shapes.split(",")}
        steady = (steady_ingest(base, chunk_bytes(*SHAPES["smollm2_bf16"]), args.steady_capacity_mib * MiB)
                  if args.steady_capacity_mib else None)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {"shapes": shapes, "steady_ingest": steady, "rounds": args.rounds, "batch": args.batch, "depths": depths,
              "codecs": codecs, "page_cache_dropped": dropped, "loadavg_start": load_start,
              "loadavg_end": os.getloadavg()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    report(result)


def _rng(r: list[float]) -> str:
    return f"[{r[0]:.2f}-{r[1]:.2f}]"


def report(result: dict[str, Any], say: Callable[[str], None] = print) -> None:
    say(f"load average {result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}; page cache dropped "
        f"before cold reads: {'yes' if result['page_cache_dropped'] else 'no (not root; O_DIRECT reads)'}")
    say("GB/s medians over rounds; ratios: median of per-round ratios to that round's best raw pattern [range]")
    say(f"{'shape':<14}{'depth':>6}{'put':>7}{'disk wr':>8}{'put/disk':>9}{'get':>7}{'get_many':>9}{'disk rd':>8}"
        f"{'get/disk':>9}{'many/disk':>10}")
    for name, s in result["shapes"].items():
        med = s["medians_gbps"]
        for d in result["depths"]:
            r, rr = s[f"d{d}"], s[f"d{d}_range"]
            say(f"{name:<14}{d:>6}{med[f'put_raw_d{d}']:>7.2f}{s['best_raw_write_gbps']:>8.2f}{r['put_ratio']:>9.2f}"
                f"{med[f'get_raw_d{d}']:>7.2f}{med[f'get_many_raw_d{d}']:>9.2f}{s['best_raw_read_gbps']:>8.2f}"
                f"{r['get_ratio']:>9.2f}{r['get_many_ratio']:>10.2f}   put {_rng(rr['put_ratio'])} "
                f"get {_rng(rr['get_ratio'])} get_many {_rng(rr['get_many_ratio'])}")
            if "compressed_get_vs_raw_get" in r:
                say(f"{'':<20}zstd-shuffle: put {med[f'put_zstd-shuffle_d{d}']:.2f}, get "
                    f"{med[f'get_zstd-shuffle_d{d}']:.2f}, get_many {med[f'get_many_zstd-shuffle_d{d}']:.2f} GB/s; "
                    f"zget/get {r['compressed_get_vs_raw_get']:.2f} {_rng(rr['compressed_get_vs_raw_get'])}; "
                    f"stored/raw {med['stored_ratio_zstd-shuffle']:.3f}")
        for kind in ("write", "read"):
            raws = ", ".join(f"{k[len('raw_') + len(kind) + 1:]} {v:.2f}" for k, v in med.items()
                             if k.startswith(f"raw_{kind}_"))
            say(f"  raw {kind} patterns (GB/s): {raws}")
    steady = result.get("steady_ingest")
    if isinstance(steady, dict):
        say(f"steady ingest (capacity {steady['capacity'] / MiB:.0f} MiB, 3x over): write amplification "
            f"{steady['write_amplification']:.4f}, evicted {steady['evicted']}, "
            f"compacted {steady['compacted_bytes'] / MiB:.1f} MiB")


if __name__ == "__main__":
    main()
