"""Store I/O benchmark: put and cold get next to the disk's best raw pattern, in one run.

    .venv/bin/python benchmarks/store_io.py [--dir DIR] [--rounds 3] [--depths 1,4] [--json]

Per chunk shape (5.6 MiB: SmolLM2-135M, 32 MiB: an 8B model; 256 tokens of bf16 KV, values
drawn like real activations so that they compress as real KV does), every round runs, in
this order (so A and B alternate over the rounds):

  raw write  O_DIRECT writes of the same bytes in chunk-sized requests, one fdatasync per
             batch, four patterns: queue depth 1 and 4, into fresh space and into space
             preallocated with fallocate; the best median is "the disk"
  raw read   O_DIRECT reads of those bytes at queue depth 1 and 4 (cold: no page cache)
  put/get    Store.put_many in batches (one request's chunks) and Store.get_into of every
             chunk into a reused page-aligned buffer (verified), for each I/O depth given
             with --depths, raw and compressed (zstd-shuffle, level 1)

Ratios are taken within each round (put / that round's best raw write, get / its best raw
read, compressed get / raw get), so the disk's drift between rounds cancels; the report
gives their median and range over rounds. The load average is recorded at the start and
the end.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import store.segment as segment  # noqa: E402
from store import GiB, MiB, PutItem, Store, StoreConfig, TierConfig  # noqa: E402
from store.segment import supports_direct_io  # noqa: E402

SHAPES = {
    # 8B-class model (32 layers, 8 KV heads, head dim 128), 256 tokens, bf16: 32 MiB
    "8b_bf16": (32, 8, 128),
    # SmolLM2-135M (30 layers, 3 KV heads, head dim 64), 256 tokens, bf16: 5.6 MiB
    "smollm2_bf16": (30, 3, 64),
}
_LIBC = ctypes.CDLL(None, use_errno=True)


def chunk_bytes(layers: int, heads: int, dim: int) -> int:
    return layers * 2 * 256 * heads * dim * 2


def fill_bf16(buf: mmap.mmap, n: int, seed: int) -> None:
    """bf16 values of a smooth activation-like distribution (high bytes carry little entropy)."""
    rng = np.random.default_rng(seed)
    f32 = (rng.standard_normal(n // 2, dtype=np.float32) * 0.5).view(np.uint32)
    np.frombuffer(buf, dtype=np.uint16, count=n // 2)[:] = (f32 >> 16).astype(np.uint16)


def _fallocate(fd: int, nbytes: int) -> None:
    if _LIBC.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(nbytes)) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


def raw_write(path: str, buf: mmap.mmap, size: int, count: int, batch: int, depth: int, prealloc: bool) -> float:
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


def raw_read(path: str, bufs: list[mmap.mmap], size: int, count: int, depth: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        def one(i: int) -> None:
            view = memoryview(bufs[i % depth])[:size]
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], i * size + done)
                if n <= 0:
                    raise OSError("short read")
                done += n

        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as ex:
            list(ex.map(one, range(count)))
        return size * count / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def store_round(sdir: Path, src: mmap.mmap, out: mmap.mmap, size: int, count: int, batch: int, codec: str,
                depth: int, tag: int) -> tuple[float, float, float]:
    """(put GB/s, get GB/s, stored/raw) for one store: ``count`` chunks put in batches, then read."""
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
            t0 = time.perf_counter()
            for k in keys:
                assert st.get_into(k, out) is not None
            get = size * count / (time.perf_counter() - t0) / 1e9
            assert bytes(out[:size]) == bytes(src[:size])
        return put, get, stored / (size * count)
    finally:
        shutil.rmtree(sdir, ignore_errors=True)


def bench_shape(base: Path, name: str, size: int, total: int, rounds: int, batch: int,
                depths: list[int]) -> dict[str, object]:
    count = max(batch, total // size)
    src = mmap.mmap(-1, size)
    fill_bf16(src, size, 7)
    out = mmap.mmap(-1, size)  # a reused, page-aligned buffer, as an engine's staging buffer
    rbufs = [mmap.mmap(-1, size) for _ in range(4)]
    res: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        res.setdefault(k, []).append(v)

    for r in range(rounds):
        raw_path = str(base / f"raw-{name}-{r}.bin")
        for depth in (1, 4):
            for prealloc in (False, True):
                add(f"raw_write_qd{depth}_{'prealloc' if prealloc else 'fresh'}",
                    raw_write(raw_path, src, size, count, batch, depth, prealloc))
        for depth in (1, 4):
            add(f"raw_read_qd{depth}", raw_read(raw_path, rbufs, size, count, depth))
        os.unlink(raw_path)
        for depth in depths:
            for codec in ("raw", "zstd-shuffle"):
                put, get, ratio = store_round(base / f"store-{name}-{r}", src, out, size, count, batch, codec,
                                              depth, r)
                add(f"put_{codec}_d{depth}", put)
                add(f"get_{codec}_d{depth}", get)
                add(f"stored_ratio_{codec}", ratio)
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
            "compressed_get_vs_raw_get": per_round(f"get_zstd-shuffle_d{depth}", f"get_raw_d{depth}"),
            "compressed_put_vs_raw_put": per_round(f"put_zstd-shuffle_d{depth}", f"put_raw_d{depth}"),
        }
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
    ap.add_argument("--batch", type=int, default=4, help="chunks per put batch (one request)")
    ap.add_argument("--depths", default=str(segment.IO_DEPTH), help="store I/O depths to compare, e.g. 1,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steady-capacity-mib", type=int, default=1024, help="0: skip the steady-ingest phase")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]

    load_start = os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="lmctl-bench-", dir=args.dir or os.getcwd()))
    try:
        if not supports_direct_io(str(base)):
            sys.exit(f"{base} does not support O_DIRECT; run on a disk-backed folder (--dir)")
        shapes = {name: bench_shape(base, name, chunk_bytes(*SHAPES[name]), args.total_mib * MiB, args.rounds,
                                    args.batch, depths)
                  for name in args.shapes.split(",")}
        steady = (steady_ingest(base, chunk_bytes(*SHAPES["smollm2_bf16"]), args.steady_capacity_mib * MiB)
                  if args.steady_capacity_mib else None)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {"shapes": shapes, "steady_ingest": steady, "rounds": args.rounds, "batch": args.batch, "depths": depths,
              "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    report(result)


def report(result: dict[str, object], say: Callable[[str], None] = print) -> None:
    say(f"load average {result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}")  # type: ignore[index]
    say(f"{'shape':<14}{'depth':>6}{'put':>7}{'disk wr':>8}{'ratio':>7}{'get':>7}{'disk rd':>8}{'ratio':>7}"
        f"{'zget':>7}{'zget/get':>9}{'zput':>7}   (GB/s medians; ratios: median of per-round ratios [range])")
    for name, s in result["shapes"].items():  # type: ignore[attr-defined]
        med = s["medians_gbps"]
        for d in result["depths"]:  # type: ignore[attr-defined]
            r = s[f"d{d}"]
            say(f"{name:<14}{d:>6}{med[f'put_raw_d{d}']:>7.2f}{s['best_raw_write_gbps']:>8.2f}{r['put_ratio']:>7.2f}"
                f"{med[f'get_raw_d{d}']:>7.2f}{s['best_raw_read_gbps']:>8.2f}{r['get_ratio']:>7.2f}"
                f"{med[f'get_zstd-shuffle_d{d}']:>7.2f}{r['compressed_get_vs_raw_get']:>9.2f}"
                f"{med[f'put_zstd-shuffle_d{d}']:>7.2f}   put [{s[f'd{d}_range']['put_ratio'][0]:.2f}-"
                f"{s[f'd{d}_range']['put_ratio'][1]:.2f}] get [{s[f'd{d}_range']['get_ratio'][0]:.2f}-"
                f"{s[f'd{d}_range']['get_ratio'][1]:.2f}] zget/get "
                f"[{s[f'd{d}_range']['compressed_get_vs_raw_get'][0]:.2f}-"
                f"{s[f'd{d}_range']['compressed_get_vs_raw_get'][1]:.2f}]")
        raws = ", ".join(f"{k[4:]} {v:.2f}" for k, v in med.items() if k.startswith("raw_"))
        say(f"  raw patterns (GB/s): {raws}; stored/raw with zstd-shuffle {med['stored_ratio_zstd-shuffle']:.3f}")
    steady = result.get("steady_ingest")
    if isinstance(steady, dict):
        say(f"steady ingest (capacity {steady['capacity'] / MiB:.0f} MiB, 3x over): write amplification "
            f"{steady['write_amplification']:.4f}, evicted {steady['evicted']}, "
            f"compacted {steady['compacted_bytes'] / MiB:.1f} MiB")


if __name__ == "__main__":
    main()
