"""Every KV cache layout vLLM's attention backends use, plus MLA, through the store bit-exact.

The engine's caches are built the way vLLM builds them (its own ``KVCacheSpec``s,
``compute_layout_strides`` and ``create_kv_cache_views`` over one flat buffer), in each of
the six physical ``KVCacheLayout``s, with and without the kernel splitting a scheduler block
into smaller attention blocks. Blocks are gathered from one engine's caches, saved to a real
store, loaded and scattered into another engine's caches in another layout: every bit must
arrive, in the right block, and nothing else may change. The canonical chunk is checked
against an independent reading of the logical ``[B, H, N, C]`` view, so a chunk one layout
saved is the chunk every other layout loads.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm.v1.kv_cache_interface as vllm_kv
from vllm.v1.kv_cache_layout import KVCacheLayout

from engine_hook import KVCacheClient
from engine_hook.context import kv_format_of_spec
from engine_hook.transfer import PagedKV
from store import KVFormat, Namespace, StoreError
from testsupport.kv_layouts import ORDERS, paged_caches, splittable

BLOCK = 16
CHUNK = 64  # four blocks a chunk
LAYERS = 3
NUM_BLOCKS = 12
SPECS = {
    "gqa-bf16": lambda: vllm_kv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                                  dtype=torch.bfloat16),
    "mha-f16": lambda: vllm_kv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32,
                                                 dtype=torch.float16),
    "mla-bf16": lambda: vllm_kv.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                                 dtype=torch.bfloat16),
}
LAYOUTS = list(KVCacheLayout)


def engine_caches(spec: Any, layout: KVCacheLayout, kernel: int | None) -> list[torch.Tensor] | None:
    """One engine's per-layer caches, as vLLM's allocator views them (None: a split this
    layout cannot make, which vLLM refuses too)."""
    layer_stride, block_stride, *_ = vllm_kv.compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    t = vllm_kv.KVCacheTensor(size=LAYERS * NUM_BLOCKS * spec.page_size_bytes,
                              layers=[f"layer.{i}" for i in range(LAYERS)],
                              layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(t.size, dtype=torch.int8)
    try:
        return list(vllm_kv.create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, t, kernel_block_size=kernel))
    except ValueError:
        assert kernel is not None
        return None


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def canonical(layer: torch.Tensor, blocks: list[int], fmt: KVFormat) -> torch.Tensor:
    """The chunk of ``blocks`` read straight off one logical [rows, H, N, C] layer:
    [planes, tokens, H, D]. Independent of PagedKV's views and copies."""
    r = BLOCK // layer.shape[2]
    rows = [b * r + i for b in blocks for i in range(r)]
    x = layer[rows]  # [rows, H, N, C]
    x = x.reshape(len(rows), fmt.num_kv_heads, layer.shape[2], fmt.kv_planes, fmt.head_dim)
    return x.permute(3, 0, 2, 1, 4).reshape(fmt.kv_planes, len(rows) * layer.shape[2], fmt.num_kv_heads,
                                            fmt.head_dim)


def fill(caches: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in caches:  # random finite values, written through the strided view
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("kernel", [None, BLOCK // 2], ids=["whole-blocks", "kernel-split"])
def test_the_caches_the_gpu_check_builds_are_vllms(name: str, kernel: int | None) -> None:
    """The GPU check has no vLLM: it builds caches with tests/kv_layout_support.py. Here, where
    vLLM is, those caches must have vLLM's own shapes and strides, in every layout."""
    spec = SPECS[name]()
    assert set(ORDERS) == {x.name for x in LAYOUTS}
    for layout in LAYOUTS:
        theirs = engine_caches(spec, layout, kernel)
        split = 1 if kernel is None else BLOCK // kernel
        assert (theirs is not None) == (split == 1 or splittable(layout.name, LAYERS, spec.num_kv_heads)), layout
        if theirs is None:
            continue
        ours = paged_caches(layout.name, LAYERS, NUM_BLOCKS, spec.num_kv_heads, BLOCK,
                            theirs[0].shape[3], spec.dtype, split=split)
        for a, b in zip(theirs, ours, strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), layout
        offsets = [t.data_ptr() - theirs[0].data_ptr() for t in theirs]
        assert offsets == [t.data_ptr() - ours[0].data_ptr() for t in ours], layout


@pytest.mark.parametrize("name", list(SPECS))
def test_the_format_of_vllms_specs(name: str) -> None:
    spec = SPECS[name]()
    fmt = kv_format_of_spec(spec, LAYERS, 1, 0, CHUNK)
    if name.startswith("mla"):
        assert (fmt.kv_planes, fmt.num_kv_heads, fmt.head_dim) == (1, 1, 576)
        assert fmt.chunk_bytes == LAYERS * CHUNK * 576 * 2  # one latent, no V
    else:
        assert fmt.kv_planes == 2 and fmt.chunk_bytes == LAYERS * 2 * CHUNK * spec.num_kv_heads * spec.head_size * 2
    # the chunk is exactly the blocks' pages: what vLLM holds is what the store keeps
    assert fmt.chunk_bytes == LAYERS * (CHUNK // BLOCK) * spec.page_size_bytes


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("kernel", [None, BLOCK // 2], ids=["whole-blocks", "kernel-split"])
@pytest.mark.parametrize("vectorized", [False, True], ids=["row-copies", "indexed-copies"])
def test_every_layout_saves_and_loads_bit_exact_into_every_other(tmp_path: Path, name: str,
                                                                kernel: int | None, vectorized: bool) -> None:
    """``indexed-copies``: the accelerator's copies (one indexed copy per layer), run here on
    the CPU so that their indexing is checked where there is no GPU."""
    spec = SPECS[name]()
    fmt = kv_format_of_spec(spec, LAYERS, 1, 0, CHUNK)
    client = KVCacheClient(tmp_path / "s", "m", fmt)
    src_blocks = [7, 0, 11, 3]  # one chunk's blocks, in token order, scattered in the cache
    dst_blocks = [2, 9, 5, 10]
    tried = 0
    try:
        for i, (a, b) in enumerate(itertools.product(LAYOUTS, LAYOUTS)):
            src = engine_caches(spec, a, kernel)
            dst = engine_caches(spec, b, kernel)
            if src is None or dst is None:
                continue
            tried += 1
            fill(src, seed=i)
            fill(dst, seed=1000 + i)
            before = [bits(d).clone() for d in dst]
            pa, pb = PagedKV(src, fmt, BLOCK), PagedKV(dst, fmt, BLOCK)
            assert pa.layout == pb.layout == "BHNC" and not pa.vectorized
            pa.vectorized = pb.vectorized = vectorized
            out = torch.empty(fmt.chunk_shape, dtype=src[0].dtype)
            pa.gather(src_blocks, out)
            for layer in range(LAYERS):  # the canonical chunk, whatever the layout
                assert torch.equal(bits(out[layer]), bits(canonical(src[layer], src_blocks, fmt))), (a, layer)
            tokens = [i * 1000 + t for t in range(CHUNK)]
            assert client.save(tokens, out) == 1 and client.flush(10)
            hit = client.load(tokens)
            assert hit.chunks == 1
            pb.scatter(hit.kv, dst_blocks if i % 3 else [dst_blocks[0], None, dst_blocks[2], None])
            if not i % 3:  # None: a block the engine holds already is left as it was
                for layer in range(LAYERS):
                    keep = [dst_blocks[1], dst_blocks[3]]
                    assert torch.equal(bits(canonical(dst[layer], keep, fmt)),
                                       bits(canonical(before[layer].view(dst[layer].dtype), keep, fmt)))
                pb.scatter(hit.kv, dst_blocks)
            for layer in range(LAYERS):
                assert torch.equal(bits(canonical(dst[layer], dst_blocks, fmt)), bits(out[layer])), (a, b, layer)
                others = [x for x in range(NUM_BLOCKS) if x not in dst_blocks]
                assert torch.equal(bits(canonical(dst[layer], others, fmt)),
                                   bits(canonical(before[layer].view(dst[layer].dtype), others, fmt)))
        assert tried >= (4 if kernel else 36), tried  # a kernel split needs dense pages (2 or 3 layouts of 6)
    finally:
        client.close()


def test_a_latent_chunk_is_another_namespace_than_a_k_and_v_chunk_of_the_same_bytes() -> None:
    """MLA's 1 x 1152 latent and a K/V cache of 2 x 576 have equal chunk bytes; they must never
    meet. K/V formats keep the ids they had before MLA was known."""
    kv = KVFormat("bfloat16", num_layers=2, num_kv_heads=1, head_dim=576)
    mla = KVFormat("bfloat16", num_layers=2, num_kv_heads=1, head_dim=1152, kv_planes=1)
    assert kv.chunk_bytes == mla.chunk_bytes
    assert Namespace("m", kv).ns_id != Namespace("m", mla).ns_id
    assert "kv_planes" not in Namespace("m", kv).to_json() and '"kv_planes":1' in Namespace("m", mla).to_json()
    # the id of a K/V namespace recorded before kv_planes existed (computed on the earlier code)
    from store.format.keys import AdapterIdentity
    ns = Namespace("smollm2", KVFormat("bfloat16", num_layers=30, num_kv_heads=3, head_dim=64),
                   AdapterIdentity("civil", "ab" * 16), "tenant-7", "fp1")
    assert ns.ns_id.hex() == "8038dc4349c778e5ffc14cd11d81b7a4"
    assert Namespace.from_json(Namespace("m", mla).to_json()).kv_format == mla


@pytest.mark.parametrize("planes", [0, 3, True, 2.0])
def test_kv_planes_is_one_or_two(planes: Any) -> None:
    with pytest.raises(StoreError, match="kv_planes"):
        KVFormat("bfloat16", num_layers=2, num_kv_heads=1, head_dim=64, kv_planes=planes)


def test_specs_whose_bytes_are_not_plain_tensors_are_refused() -> None:
    packed = vllm_kv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                       head_size_v=32)
    with pytest.raises(StoreError, match="V head size"):
        kv_format_of_spec(packed, LAYERS, 1, 0, CHUNK)
    slots = vllm_kv.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                      state_content_bytes=100)
    with pytest.raises(StoreError, match="packed or quantized"):
        kv_format_of_spec(slots, LAYERS, 1, 0, CHUNK)


def test_a_kv_layout_for_k_and_v_refuses_a_latent_and_rows_that_do_not_divide_a_block() -> None:
    mla = kv_format_of_spec(SPECS["mla-bf16"](), LAYERS, 1, 0, CHUNK)
    caches = [torch.zeros(NUM_BLOCKS, 2, BLOCK, 1, 288, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(StoreError, match="latent"):
        PagedKV(caches, mla, BLOCK, layout="B2NHD")
    odd = [torch.zeros(NUM_BLOCKS, 1, 6, 576, dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(StoreError, match="not recognised"):
        PagedKV(odd, mla, BLOCK)


def test_the_gpu_check_and_its_benchmark_run_here_as_far_as_a_cpu_lets_them(tmp_path: Path) -> None:
    """No GPU here: the check says so in one line; the benchmark's code runs on the CPU."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                       timeout=120)
    if r.returncode == 0:  # a CUDA machine: the check ran
        assert "goal save and load" in r.stdout
        return
    assert r.stderr.strip().splitlines()[-1] == "gpu_check: torch sees no CUDA device", r.stderr
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_transfer.py"), "--device", "cpu",
                        "--rounds", "2", "--chunks", "1", "--shapes", "mla_bf16", "--layouts", "LBNHC"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "mla_bf16      LBNHC" in r.stdout and "goal save and load >= 0.8x the copy" in r.stdout


@pytest.mark.parametrize("vectorized", [False, True], ids=["row-copies", "indexed-copies"])
def test_a_tail_of_fewer_blocks_than_a_chunk_gathers_and_scatters_bit_exact(vectorized: bool) -> None:
    """A request's tail record: two blocks of a four-block chunk, in the canonical layout with
    fewer tokens (``chunk_tensor(buf, fmt, tokens)``), gathered and scattered by both copy
    paths (the accelerator's indexed copies use a full chunk's device buffer, of which the
    tail takes the first tokens), then into the second half of other blocks untouched."""
    from engine_hook.transfer import chunk_nbytes, chunk_tensor

    spec = SPECS["gqa-bf16"]()
    fmt = kv_format_of_spec(spec, LAYERS, 1, 0, CHUNK)
    src = engine_caches(spec, LAYOUTS[0], None)
    dst = engine_caches(spec, LAYOUTS[0], None)
    assert src is not None and dst is not None
    fill(src, seed=5)
    fill(dst, seed=6)
    before = [bits(d).clone() for d in dst]
    pa, pb = PagedKV(src, fmt, BLOCK), PagedKV(dst, fmt, BLOCK)
    pa.vectorized = pb.vectorized = vectorized
    buf = torch.zeros(fmt.chunk_bytes, dtype=torch.uint8)
    for _ in range(2):  # the second time a full chunk's gather has used the device buffer first
        tail = chunk_tensor(buf, fmt, 2 * BLOCK)
        assert tail.shape[2] == 2 * BLOCK and tail.numel() * tail.element_size() == chunk_nbytes(fmt, 2 * BLOCK)
        pa.gather([7, 3], tail)
        for layer in range(LAYERS):
            assert torch.equal(bits(tail[layer]), bits(canonical(src[layer], [7, 3], fmt)))
        pa.gather([1, 2, 4, 5], chunk_tensor(buf, fmt))  # a full chunk between two tails
        pa.gather([7, 3], tail)
    pb.scatter(tail, [9, None])
    for layer in range(LAYERS):
        assert torch.equal(bits(canonical(dst[layer], [9], fmt)), bits(canonical(src[layer], [7], fmt)))
        others = [x for x in range(NUM_BLOCKS) if x != 9]
        assert torch.equal(bits(canonical(dst[layer], others, fmt)),
                           bits(canonical(before[layer].view(dst[layer].dtype), others, fmt)))
