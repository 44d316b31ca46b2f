"""The connector's CUDA path: paged KV on the GPU in every layout vLLM uses (and MLA),
saved through page-locked staging buffers into a real store and loaded back bit-exact.

Every test here is marked ``gpu``: it runs where torch sees a CUDA device
(``scripts/gpu_check.sh``) and is skipped elsewhere. It needs no vLLM: the caches are built
as vLLM's allocator builds them (tests/kv_layout_support.py, checked against vLLM itself in
test_kv_layouts.py), and the worker is driven as vLLM drives it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_hook.config import ConnectorSettings
from engine_hook.context import ConnectorContext
from engine_hook.ops import LoadOp, SaveOp
from engine_hook.transfer import PagedKV, StagingPool, chunk_tensor
from engine_hook.worker import LMCtlConnectorWorker
from store import KVFormat, Namespace
from testsupport.kv_layouts import ORDERS, paged_caches, splittable

pytestmark = pytest.mark.gpu

BLOCK = 16
CHUNK = 64
LAYERS = 4
NUM_BLOCKS = 16
FORMATS = {
    "gqa-bf16": KVFormat("bfloat16", num_layers=LAYERS, num_kv_heads=8, head_dim=128, chunk_size=CHUNK),
    "mla-bf16": KVFormat("bfloat16", num_layers=LAYERS, num_kv_heads=1, head_dim=576, chunk_size=CHUNK,
                         kv_planes=1),
}


def caches(fmt: KVFormat, layout: str, split: int, seed: int) -> list[torch.Tensor]:
    out = paged_caches(layout, LAYERS, NUM_BLOCKS, fmt.num_kv_heads, BLOCK, fmt.kv_planes * fmt.head_dim,
                       torch.bfloat16, device="cuda", split=split)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for c in out:
        c.copy_(torch.randn(c.shape, generator=g, device="cuda").to(c.dtype))
    return out


def blocks_of(layer: torch.Tensor, blocks: list[int], split: int) -> torch.Tensor:
    rows = [b * split + i for b in blocks for i in range(split)]
    return layer[rows].view(torch.int16)


#: every layout, with whole blocks and (where vLLM makes them) blocks split in two kernel blocks
CASES = [(name, layout, split) for name, fmt in FORMATS.items() for layout in ORDERS for split in (1, 2)
         if split == 1 or splittable(layout, LAYERS, fmt.num_kv_heads)]


@pytest.mark.parametrize(("name", "layout", "split"), CASES)
def test_every_layout_round_trips_through_pinned_buffers_bit_exact(tmp_path: Path, name: str, layout: str,
                                                                   split: int) -> None:
    fmt = FORMATS[name]
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "store"), "chunk_size": CHUNK,
                                        "model_fingerprint": "off", "save_queue": 2})
    names = [f"layer.{i}" for i in range(LAYERS)]
    worker = LMCtlConnectorWorker(ConnectorContext(settings, "m", fmt, names, BLOCK, None, None, {"engine": "gpu"}))
    try:
        src = caches(fmt, layout, split, seed=1)
        worker.register_kv_caches(dict(zip(names, src, strict=True)))
        assert worker._paged is not None and worker._paged.vectorized and worker._paged.layout == "BHNC"
        assert worker._pool is not None and worker._pool.pinned
        key = Namespace("m", fmt).chunk_keys(list(range(CHUNK)))[0]
        worker.save([SaveOp("r1", key, [9, 2, 14, 5])])
        assert worker.flush(30) and worker.stats()["writer"]["saved"] == 1
        want = [blocks_of(t, [9, 2, 14, 5], split).clone() for t in src]
        for t in src:  # the engine's memory reused for other requests
            t.zero_()
        worker.load([LoadOp("r2", [key], [[1, None, 7, 12]])])  # None: a block the engine holds
        deadline = 0
        while "r2" not in worker.take_finished(1.0):
            deadline += 1
            assert deadline < 30
        torch.cuda.synchronize()
        assert worker.take_load_errors() == set()
        for t, w in zip(src, want, strict=True):
            got = blocks_of(t, [1, 7, 12], split)
            assert torch.equal(got, torch.cat([w[: split], w[2 * split :]])), (name, layout, split)
            assert not blocks_of(t, [0, 2, 3], split).any()  # nothing else written
    finally:
        worker.close()


def test_the_indexed_copies_match_the_row_copies_on_the_device() -> None:
    fmt = FORMATS["gqa-bf16"]
    src = caches(fmt, "BLNHC", 1, seed=3)
    pk = PagedKV(src, fmt, BLOCK)
    pool = StagingPool(fmt.chunk_bytes, 2, pinned=True)
    a, b = pool.acquire(), pool.acquire()
    assert a is not None and b is not None
    pk.gather([3, 1, 4, 15], chunk_tensor(a, fmt))
    pk.vectorized = False
    pk.gather([3, 1, 4, 15], chunk_tensor(b, fmt))
    assert torch.equal(a, b)
