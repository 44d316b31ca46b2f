"""Side by side: lmctl's store, LMCache's LocalDiskBackend (O_DIRECT) and the raw disk, one run.

    python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install torch==2.13.0 lmcache==0.5.6
    .venv/bin/python benchmarks/lmcache_disk.py [--rounds 3] [--dir DIR] [--json]

LMCache is a benchmark peer only: it lives in a venv of its own (``--lmcache-python``, by
default ``.venv-lmcache/bin/python``), so its pins never meet the project's, and it is driven
through its own API (``LocalDiskBackend.batched_submit_put_task`` and
``batched_get_blocking``, ``extra_config={"use_odirect": True}``, its default four disk
threads). Each contender runs in a subprocess of its own (this script, ``--worker NAME``), on
the same chunk sizes and the same bytes; every round runs the three, in an order that
rotates from round to round, so that the disk's drift between rounds falls on all of them.

Per contender and chunk shape, in one round (``--total-mib`` of chunks):

  put   batches of ``--put-batch`` chunks (the engine's save batch), each made durable before
        the next: lmctl ``Store.put_many`` (payload synced, then the index commit);
        LMCache's put of the batch, waited for, then an fsync of each of its files (LMCache
        itself never syncs); raw: O_DIRECT writes of whole chunks, one fdatasync per batch,
        1, 4 and 8 in flight, and 4 in flight into a file allocated beforehand (the best is
        taken; the reads read that last file)
  get   page cache dropped first (as root), then batches of ``--get-batch`` chunks (one
        request's prefix): lmctl ``Store.get_many_into`` into reused page-aligned buffers
        (one region whose pages were written in order, as an engine's staging pool; the raw
        reads get the same, see ``store_io.buffers``), verified by checksum; LMCache
        ``batched_get_blocking`` (buffers from its allocator, freed after each batch but the
        last, which is compared byte for byte with what was put once the clock stops: LMCache
        checks nothing itself); raw: O_DIRECT reads of whole chunks, 1, 2, 4 and 8 in flight
        (the best is taken). Each get also reports the bytes its process read from the block
        device per byte got (``/proc/self/io``): under 1 would mean the page cache served it

Ratios are taken within each round (lmctl / LMCache, lmctl / best raw) and reported as the
median and range over rounds, with GB/s medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: (layers, KV heads, head dim) of 256-token bf16 chunks: 32 MiB (8B-class) and 5.6 MiB (SmolLM2-135M)
SHAPES = {"8b_bf16": (32, 8, 128), "smollm2_bf16": (30, 3, 64)}
CONTENDERS = ("raw", "lmctl", "lmcache")


def chunk_bytes(shape: str) -> int:
    layers, heads, dim = SHAPES[shape]
    return layers * 2 * 256 * heads * dim * 2


def chunk_data(size: int, i: int) -> bytes:
    """Chunk ``i``'s bytes: the same in every contender's process (stdlib only)."""
    return random.Random(i).randbytes(size)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_bytes() -> int:
    """Bytes this process (all its threads) has had read from the block device so far:
    O_DIRECT reads count, reads served by the page cache do not (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- the contenders (each in its own process) ----------------------------------------------
def run_raw(d: Path, size: int, count: int, put_batch: int, get_batch: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "benchmarks"))

    from store_io import buffers, raw_read, raw_write

    src = buffers(size, 1)[0]
    src[:size] = chunk_data(size, 0)
    path = str(d / "raw.bin")
    out: dict[str, float] = {}
    for depth in (1, 4, 8):
        out[f"put_qd{depth}"] = raw_write(path, src, size, count, put_batch, depth, False)
    # last, so that the reads below read a file laid out in few extents (pieces written in
    # parallel into blocks allocated as they arrive scatter a file: store.format.segment.reserve)
    out["put_qd4_prealloc"] = raw_write(path, src, size, count, put_batch, 4, True)
    bufs = buffers(size, 8)
    disk = []
    for depth in (1, 2, 4, 8):
        drop_caches()
        before = read_bytes()
        out[f"get_qd{depth}"] = raw_read(path, bufs, size, count, depth)
        disk.append(read_bytes() - before)
    out["get_disk_fraction"] = min(disk) / (size * count)
    out["put"] = max(v for k, v in out.items() if k.startswith("put_"))
    out["get"] = max(v for k, v in out.items() if k.startswith("get_"))
    return out


def run_lmctl(d: Path, size: int, count: int, put_batch: int, get_batch: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from store_io import buffers

    from store import GiB, PutItem, Store, StoreConfig, TierConfig

    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=64 * GiB)}, segment_bytes=1 * GiB, codec="raw")
    srcs = buffers(size, put_batch)  # page-aligned, as the engine's staging buffers
    for i, m in enumerate(srcs):
        m[:size] = chunk_data(size, i)
    keys = [b"\x05" * 16 + i.to_bytes(32, "big") for i in range(count)]
    layout = {"dtype": "bfloat16", "shape": [size // 2]}
    with Store(d / "store", cfg) as st:
        t0 = time.perf_counter()
        for b in range(0, count, put_batch):
            part = keys[b : b + put_batch]
            items = [PutItem(k, memoryview(srcs[j])[:size], layout, 256) for j, k in enumerate(part)]
            assert all(st.put_many(items))
        put = gbps(size * count, time.perf_counter() - t0)
        outs = buffers(size, get_batch)
        drop_caches()
        before = read_bytes()
        t0 = time.perf_counter()
        for b in range(0, count, get_batch):
            part = keys[b : b + get_batch]
            assert all(st.get_many_into(part, outs[: len(part)], expect=size))
        get = gbps(size * count, time.perf_counter() - t0)
        disk = read_bytes() - before
        last = (count - 1) // get_batch * get_batch  # the last batch's chunks, in outs
        for j in range(count - last):
            assert outs[j][:size] == srcs[(last + j) % put_batch][:size], "lmctl read other bytes"
    return {"put": put, "get": get, "get_disk_fraction": disk / (size * count)}


def run_lmcache(d: Path, size: int, count: int, put_batch: int, get_batch: int) -> dict[str, float]:
    import asyncio
    import logging
    import threading

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    logging.getLogger("lmcache").setLevel(logging.ERROR)
    folder = d / "lmcache"
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=1.0, local_disk=f"file://{folder}/",
        max_local_disk_size=64.0, extra_config={"use_odirect": True})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(cfg, memory_allocator=MixedMemoryAllocator(max(put_batch, get_batch) * size + (64 << 20)))
    disk = LocalDiskBackend(cfg, loop, cpu)
    assert disk.use_odirect
    layers, heads, dim = next(s for n, s in SHAPES.items() if chunk_bytes(n) == size)
    shape = torch.Size([2, layers, 256, heads * dim])
    keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16) for i in range(count)]
    data = [torch.frombuffer(bytearray(chunk_data(size, i)), dtype=torch.uint8) for i in range(put_batch)]
    t0 = time.perf_counter()
    for b in range(0, count, put_batch):
        part = keys[b : b + put_batch]
        objs = []
        for j in range(len(part)):
            o = cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            o.tensor.view(torch.uint8).view(-1).copy_(data[j])  # the engine's copy into its staging buffer
            objs.append(o)
        disk.batched_submit_put_task(part, objs)
        while any(disk.exists_in_put_tasks(k) for k in part):
            time.sleep(0.0002)
        for k in part:  # durable, as lmctl's put is: LMCache never syncs its files
            fd = os.open(disk._key_to_path(k), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for o in objs:
            o.ref_count_down()
    put = gbps(size * count, time.perf_counter() - t0)
    drop_caches()
    before = read_bytes()
    last = (count - 1) // get_batch * get_batch
    t0 = time.perf_counter()
    for b in range(0, count, get_batch):
        got = disk.batched_get_blocking(keys[b : b + get_batch])
        assert all(g is not None for g in got)
        if b != last:  # the last batch is kept, to be checked after the clock stops
            for g in got:
                g.ref_count_down()
    get = gbps(size * count, time.perf_counter() - t0)
    on_disk = read_bytes() - before
    # the bytes LMCache returned are the bytes put under each key (LMCache checks nothing;
    # this makes sure the figure above is of reads that delivered the data)
    for j, g in enumerate(got):
        assert bytes(g.byte_array[:size]) == bytes(data[(last + j) % put_batch].numpy()), "LMCache read other bytes"
        g.ref_count_down()
    disk.close()
    loop.call_soon_threadsafe(loop.stop)
    return {"put": put, "get": get, "get_disk_fraction": on_disk / (size * count)}


WORKERS = {"raw": run_raw, "lmctl": run_lmctl, "lmcache": run_lmcache}


# -- the driver ----------------------------------------------------------------------------
def worker_main(args: argparse.Namespace) -> None:
    d = Path(tempfile.mkdtemp(prefix=f"bench-{args.worker}-", dir=args.dir))
    try:
        size = chunk_bytes(args.shape)
        count = max(args.put_batch, args.total_mib * (1 << 20) // size)
        res = WORKERS[args.worker](d, size, count, args.put_batch, args.get_batch)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(res))


def run_worker(python: str, name: str, shape: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [python, str(Path(__file__).resolve()), "--worker", name, "--shape", shape, "--dir", args.dir,
           "--total-mib", str(args.total_mib), "--put-batch", str(args.put_batch), "--get-batch", str(args.get_batch)]
    env = dict(os.environ, PYTHONPATH=str(ROOT)) if name != "lmcache" else None
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        sys.exit(f"the {name} worker failed:\n{p.stderr[-3000:]}")
    out: dict[str, float] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: the cwd)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--total-mib", type=int, default=1024, help="chunk bytes per contender, round and shape")
    ap.add_argument("--put-batch", type=int, default=4, help="chunks per durable put (the engine's save batch)")
    ap.add_argument("--get-batch", type=int, default=8, help="chunks per get (one request's prefix)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--lmcache-python", default=str(ROOT / ".venv-lmcache" / "bin" / "python"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=list(SHAPES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dir = os.path.abspath(args.dir or os.getcwd())
    if args.worker:
        worker_main(args)
        return
    if not os.access(args.lmcache_python, os.X_OK):
        sys.exit(f"no LMCache venv at {args.lmcache_python}: make it as this script's docstring says, "
                 "or name its python with --lmcache-python")
    pythons = {"raw": sys.executable, "lmctl": sys.executable, "lmcache": args.lmcache_python}
    load_start = os.getloadavg()
    res: dict[str, dict[str, list[dict[str, float]]]] = {}
    for r in range(args.rounds):
        for shape in args.shapes.split(","):
            order = CONTENDERS[r % 3:] + CONTENDERS[: r % 3]
            for name in order:
                res.setdefault(shape, {}).setdefault(name, []).append(run_worker(pythons[name], name, shape, args))
    result = {"rounds": args.rounds, "put_batch": args.put_batch, "get_batch": args.get_batch,
              "total_mib": args.total_mib, "page_cache_dropped": drop_caches(), "loadavg_start": load_start,
              "loadavg_end": os.getloadavg(), "shapes": {s: summarize(v) for s, v in res.items()}, "raw": res}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


def summarize(per: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rounds in per.items():
        for k in ("put", "get"):
            out[f"{name}_{k}_gbps"] = statistics.median(r[k] for r in rounds)
        # bytes read from the device over bytes asked for, the lowest of the rounds: a get
        # that the page cache served would show under 1
        out[f"{name}_get_disk_fraction"] = min(r.get("get_disk_fraction", 0.0) for r in rounds)
    for k in ("put", "get"):
        for den in ("lmcache", "raw"):
            ratios = [a[k] / b[k] for a, b in zip(per["lmctl"], per[den], strict=True)]
            out[f"{k}_vs_{den}"] = statistics.median(ratios)
            out[f"{k}_vs_{den}_range"] = [min(ratios), max(ratios)]
    return out


def report(result: dict[str, Any]) -> None:
    print(f"load average {result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}; "
          f"{result['rounds']} rounds; put batch {result['put_batch']}, get batch {result['get_batch']}; "
          f"page cache dropped before reads: {'yes' if result['page_cache_dropped'] else 'no'}")
    print("GB/s medians; ratios: median of per-round ratios [range]")
    for shape, s in result["shapes"].items():
        print(f"{shape}: put  lmctl {s['lmctl_put_gbps']:.2f}  LMCache+fsync {s['lmcache_put_gbps']:.2f}  "
              f"raw best {s['raw_put_gbps']:.2f}  lmctl/LMCache {s['put_vs_lmcache']:.2f} "
              f"[{s['put_vs_lmcache_range'][0]:.2f}-{s['put_vs_lmcache_range'][1]:.2f}]  lmctl/raw "
              f"{s['put_vs_raw']:.2f} [{s['put_vs_raw_range'][0]:.2f}-{s['put_vs_raw_range'][1]:.2f}]")
        print(f"{shape}: get  lmctl {s['lmctl_get_gbps']:.2f}  LMCache {s['lmcache_get_gbps']:.2f}  "
              f"raw best {s['raw_get_gbps']:.2f}  lmctl/LMCache {s['get_vs_lmcache']:.2f} "
              f"[{s['get_vs_lmcache_range'][0]:.2f}-{s['get_vs_lmcache_range'][1]:.2f}]  lmctl/raw "
              f"{s['get_vs_raw']:.2f} [{s['get_vs_raw_range'][0]:.2f}-{s['get_vs_raw_range'][1]:.2f}]")
        print(f"{shape}: bytes read from the device per byte got (lowest round): lmctl "
              f"{s['lmctl_get_disk_fraction']:.2f}  LMCache {s['lmcache_get_disk_fraction']:.2f}  "
              f"raw {s['raw_get_disk_fraction']:.2f}")


if __name__ == "__main__":
    main()
