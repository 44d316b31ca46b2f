"""Paged KV caches laid out as vLLM's allocator lays them out, without vLLM (for machines
that have only torch, like the GPU check's). ``test_kv_layouts.py`` checks that these are
the strides vLLM's own ``create_kv_cache_views`` gives, layout by layout.

vLLM (0.32) describes a cache by its logical axes ``[L, B, H, N, C]`` (layers, blocks, head
slots, tokens per block, the bytes of one token: K||V, or an MLA latent) and a physical order
of them (``KVCacheLayout``); each layer sees a ``[B, H, N, C]`` view.
"""

from __future__ import annotations

import torch

#: vLLM's ``KVCacheLayout`` members: the physical order of the logical axes L, B, H, N, C
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def splittable(layout: str, layers: int, heads: int) -> bool:
    """Whether each block is one dense page, the only blocks vLLM splits into kernel blocks:
    nothing but the layers outside the block axis (or only axes of size 1)."""
    order = ORDERS[layout]
    outer = order[: order.index(1)]
    return all(d == 0 or (d == 2 and heads == 1) for d in outer) and (0 in outer or layers == 1)


def paged_caches(layout: str, layers: int, blocks: int, heads: int, tokens: int, width: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", split: int = 1) -> list[torch.Tensor]:
    """``layers`` views ``[blocks * split, heads, tokens // split, width]`` over one zeroed
    allocation in ``layout``'s physical order (``split``: kernel blocks per block)."""
    if split > 1 and not splittable(layout, layers, heads):
        raise ValueError(f"{layout} does not split blocks")
    shape = (layers, blocks * split, heads, tokens // split, width)
    order = ORDERS[layout]
    physical = torch.zeros([shape[d] for d in order], dtype=dtype, device=device)
    logical = physical.permute([order.index(d) for d in range(5)])
    return [logical[i] for i in range(layers)]
