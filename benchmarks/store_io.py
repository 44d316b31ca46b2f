"""Store I/O benchmark: put/get bandwidth next to the raw disk's, measured in the same run.

    .venv/bin/python benchmarks/store_io.py [--dir DIR] [--rounds 3] [--json]

For each chunk shape it measures, as medians over rounds:
  raw_write  O_DIRECT sequential writes of the same bytes in chunk-sized writes from an
             aligned buffer, one fdatasync per batch (what the disk can do)
  put        Store.put_many of the same chunks in batches (one request's chunks per batch;
             payload and index durable at the end of each batch)
  raw_read   O_DIRECT reads of those bytes into an aligned buffer (cold: no page cache)
  get        Store.get_into of every chunk into a reused buffer (O_DIRECT, checksum verified)
and then a steady-ingest phase (a capacity-limited tier filled three times over, with
eviction and compaction) for the write amplification.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import GiB, MiB, PutItem, Store, StoreConfig, TierConfig  # noqa: E402
from store.segment import supports_direct_io  # noqa: E402

SHAPES = {
    # 8B-class model (32 layers, 8 KV heads, head dim 128), 256 tokens, bf16: 32 MiB
    "8b_bf16": (32, 8, 128),
    # SmolLM2-135M (30 layers, 3 KV heads, head dim 64), 256 tokens, bf16: 5.6 MiB
    "smollm2_bf16": (30, 3, 64),
}


def chunk_bytes(layers: int, heads: int, dim: int) -> int:
    return layers * 2 * 256 * heads * dim * 2


def fill_random(buf: mmap.mmap, n: int) -> None:
    block = os.urandom(1 << 20)
    for off in range(0, n, len(block)):
        m = min(len(block), n - off)
        buf[off : off + m] = block[:m]


def raw_write(path: str, buf: mmap.mmap, size: int, count: int, batch: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        t0 = time.perf_counter()
        off = 0
        for i in range(count):
            view = memoryview(buf)[:size]
            done = 0
            while done < size:
                done += os.pwrite(fd, view[done:], off + done)
            off += size
            if (i + 1) % batch == 0 or i + 1 == count:
                os.fdatasync(fd)
        return size * count / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def raw_read(path: str, buf: mmap.mmap, size: int, count: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for i in range(count):
            view = memoryview(buf)[:size]
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], i * size + done)
                if n <= 0:
                    raise OSError("short read")
                done += n
        return size * count / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def bench_shape(base: Path, name: str, size: int, total: int, rounds: int, batch: int) -> dict[str, float]:
    count = max(batch, total // size)
    src = mmap.mmap(-1, size)
    fill_random(src, size)
    out = mmap.mmap(-1, size)  # a reused, page-aligned buffer, as an engine's staging buffer
    res: dict[str, list[float]] = {"raw_write": [], "put": [], "raw_read": [], "get": []}
    for r in range(rounds):
        raw_path = str(base / f"raw-{name}-{r}.bin")
        res["raw_write"].append(raw_write(raw_path, src, size, count, batch))
        res["raw_read"].append(raw_read(raw_path, src, size, count))
        os.unlink(raw_path)

        sdir = base / f"store-{name}-{r}"
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=64 * GiB)}, segment_bytes=1 * GiB)
        with Store(sdir, cfg) as store:
            keys = [bytes([r]) * 16 + i.to_bytes(32, "big") for i in range(count)]
            layout = {"dtype": "bfloat16", "shape": [size // 2]}
            t0 = time.perf_counter()
            for b in range(0, count, batch):
                items = [PutItem(k, memoryview(src)[:size], layout, 256) for k in keys[b : b + batch]]
                assert all(store.put_many(items))
            res["put"].append(size * count / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for k in keys:
                assert store.get_into(k, out) is not None
            res["get"].append(size * count / (time.perf_counter() - t0) / 1e9)
            assert bytes(out[:4096]) == bytes(src[:4096])
        shutil.rmtree(sdir)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "chunk_bytes": size,
        "chunks_per_round": count,
        "put_gbps": med["put"],
        "get_gbps": med["get"],
        "raw_write_gbps": med["raw_write"],
        "raw_read_gbps": med["raw_read"],
        "put_ratio": med["put"] / med["raw_write"],
        "get_ratio": med["get"] / med["raw_read"],
    }


def steady_ingest(base: Path, size: int, capacity: int) -> dict[str, float]:
    """Fill a capacity-limited tier three times over; report write amplification."""
    sdir = base / "steady"
    src = mmap.mmap(-1, size)
    fill_random(src, size)
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=capacity)}, segment_bytes=256 * MiB)
    with Store(sdir, cfg) as store:
        n = 3 * capacity // size
        for i in range(n):
            k = b"\x07" * 16 + i.to_bytes(32, "big")
            store.put(k, memoryview(src)[:size], {"dtype": "bfloat16"}, 256)
            if i % 16 == 15:  # re-read a few old chunks so LRU has something to keep
                store.get_into(b"\x07" * 16 + (i - 8).to_bytes(32, "big"), src)
        st = store.stats()
    shutil.rmtree(sdir)
    return {
        "write_amplification": st.write_amplification,
        "evicted": st.counters["evicted"],
        "compacted_bytes": st.counters["compacted_bytes"],
        "disk_bytes_at_end": st.tiers["nvme"].disk_bytes,
        "capacity": capacity,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir under the cwd)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes per round and shape")
    ap.add_argument("--batch", type=int, default=4, help="chunks per put batch (one request)")
    ap.add_argument("--steady-capacity-mib", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="lmctl-bench-", dir=args.dir or os.getcwd()))
    try:
        if not supports_direct_io(str(base)):
            print(f"note: {base} does not support O_DIRECT; figures include the page cache", file=sys.stderr)
        shapes = {}
        for name, (layers, heads, dim) in SHAPES.items():
            shapes[name] = bench_shape(base, name, chunk_bytes(layers, heads, dim), args.total_mib * MiB,
                                       args.rounds, args.batch)
        steady = steady_ingest(base, chunk_bytes(*SHAPES["smollm2_bf16"]), args.steady_capacity_mib * MiB)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    main_shape = shapes["8b_bf16"]
    result = {
        "put_gbps": main_shape["put_gbps"],
        "get_gbps": main_shape["get_gbps"],
        "raw_write_gbps": main_shape["raw_write_gbps"],
        "raw_read_gbps": main_shape["raw_read_gbps"],
        "put_ratio": main_shape["put_ratio"],
        "get_ratio": main_shape["get_ratio"],
        "write_amplification": steady["write_amplification"],
        "shapes": shapes,
        "steady_ingest": steady,
        "rounds": args.rounds,
        "batch": args.batch,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'shape':<14}{'chunk':>10}{'put GB/s':>10}{'raw wr':>9}{'ratio':>7}"
          f"{'get GB/s':>10}{'raw rd':>9}{'ratio':>7}")
    for name, s in shapes.items():
        print(f"{name:<14}{s['chunk_bytes'] / MiB:>8.1f}Mi{s['put_gbps']:>10.2f}{s['raw_write_gbps']:>9.2f}"
              f"{s['put_ratio']:>7.2f}{s['get_gbps']:>10.2f}{s['raw_read_gbps']:>9.2f}{s['get_ratio']:>7.2f}")
    print(f"steady ingest (capacity {steady['capacity'] / MiB:.0f} MiB, 3x over): write amplification "
          f"{steady['write_amplification']:.4f}, evicted {steady['evicted']}, "
          f"compacted {steady['compacted_bytes'] / MiB:.1f} MiB")


if __name__ == "__main__":
    main()
