"""torch helpers: pack KV tensors into store payloads and back, without needless copies.

Imported only by engines (never by the CLI): it imports torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import StoreError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise StoreError(f"dtype {dtype} cannot be stored; known: {', '.join(_DTYPES)}") from None


def to_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise StoreError(f"unknown dtype {name!r}") from None


def pack(tensor: torch.Tensor) -> tuple[memoryview, dict[str, Any]]:
    """A CPU tensor as a byte view plus its layout. Copies only if it is not contiguous
    (or not on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    layout = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    flat = t.reshape(-1).view(torch.uint8)
    return flat.numpy().data, layout


def unpack(data: Any, layout: dict[str, Any]) -> torch.Tensor:
    """A tensor viewing ``data`` (no copy; ``data`` must be writable and outlive it)."""
    dt = to_dtype(layout["dtype"])
    shape = tuple(layout["shape"])
    raw = torch.frombuffer(data, dtype=torch.uint8)
    n = raw.numel() // max(1, raw.element_size())
    t = raw.view(dt)
    want = 1
    for d in shape:
        want *= d
    if t.numel() < want:
        raise StoreError(f"payload of {n} bytes is too small for shape {shape} {layout['dtype']}")
    return t[:want].view(shape)
