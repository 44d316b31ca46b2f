"""One request's load through the connector's worker: read each chunk from the store and copy
it into the engine's paged KV, with and without reading the next chunk while one is copied.

    .venv/bin/python benchmarks/loads.py --rounds 9

The worker is the one vLLM runs (engine_hook/worker.py), on CPU tensors in vLLM's layout; the
store's reads use O_DIRECT, so they come from the disk. Per round, in alternating order, one
load of a 4k-token prompt's 16 chunks of SmolLM2-135M's float32 KV (11.25 MiB each, 180 MiB)
with ``read_ahead`` off and on; medians over rounds, and the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine_hook.config import ConnectorSettings  # noqa: E402
from engine_hook.context import ConnectorContext  # noqa: E402
from engine_hook.ops import LoadOp, SaveOp  # noqa: E402
from engine_hook.worker import LMCtlConnectorWorker  # noqa: E402
from store import KVFormat, Namespace  # noqa: E402

FMT = KVFormat("float32", num_layers=30, num_kv_heads=3, head_dim=64, chunk_size=256)
BS = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--work", default=str(ROOT / ".cache"))
    args = ap.parse_args()
    n, bpc = args.chunks, FMT.chunk_size // BS
    Path(args.work).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work, prefix="lmctl-loads-") as tmp:
        settings = ConnectorSettings.parse({"store_path": str(Path(tmp) / "store"), "chunk_size": 256,
                                            "model_fingerprint": "off", "save_queue": 4, "capacity": "8GiB"})
        names = [f"layer.{i}" for i in range(FMT.num_layers)]
        w = LMCtlConnectorWorker(ConnectorContext(settings, "m", FMT, names, BS, None, None, {"engine": "bench"}))
        blocks = 2 * n * bpc + 8
        caches = {nm: torch.randn(blocks, FMT.num_kv_heads, BS, 2 * FMT.head_dim) for nm in names}
        w.register_kv_caches(caches)
        keys = Namespace("m", FMT).chunk_keys(list(range(n * FMT.chunk_size)))
        for c, k in enumerate(keys):
            w.save([SaveOp("r0", k, list(range(c * bpc, (c + 1) * bpc)))])
            assert w.flush(60)
        assert w.stats()["writer"]["saved"] == n
        dst = [list(range(n * bpc + c * bpc, n * bpc + (c + 1) * bpc)) for c in range(n)]
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for ahead in ((False, True) if r % 2 == 0 else (True, False)):
                w.read_ahead = ahead
                t0 = time.perf_counter()
                w.load([LoadOp(f"r{r}{ahead}", keys, [list(b) for b in dst])])
                while not w.take_finished(5.0):
                    pass
                times[ahead].append(time.perf_counter() - t0)
                assert w.take_load_errors() == set()
        w.close()
    mb = n * FMT.chunk_bytes / 1e6
    off, on = statistics.median(times[False]), statistics.median(times[True])
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    print(f"{n} chunks, {mb:.0f} MB, {args.rounds} rounds")
    print(f"read then copy     {off * 1e3:7.1f} ms  {mb / off / 1e3:.2f} GB/s")
    print(f"read ahead         {on * 1e3:7.1f} ms  {mb / on / 1e3:.2f} GB/s")
    print(f"read ahead / read then copy: {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] "
          f"(time; median and range of the per-round ratio)")


if __name__ == "__main__":
    main()
