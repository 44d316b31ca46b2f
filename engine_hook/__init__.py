"""lmctl's engine side: the vLLM v1 connector (``engine_hook.vllm``) and an
engine-agnostic API (``engine_hook.api``).

Importing this package imports neither torch nor vllm. Of its modules, ``vllm`` (the
connector), ``worker``, ``transfer`` and ``api`` import torch, and only ``vllm`` and
``metrics`` (its figures in vLLM's metrics) import vllm at import time; the scheduler side
and the bookkeeping modules (``stats`` included) import neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import KVCacheClient, LoadedPrefix

__all__ = ["KVCacheClient", "LoadedPrefix"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(name)
