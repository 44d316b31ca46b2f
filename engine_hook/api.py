"""An engine-agnostic Python API: save a prompt's KV, load the longest cached prefix.

For engines other than vLLM (and for tools and tests). KV tensors use the store's
canonical layout ``[layers, 2 (K, V), tokens, kv_heads, head_dim]`` (for MLA, ``KVFormat(...,
kv_planes=1)``: one latent plane, ``[layers, 1, tokens, 1, latent]``), one tensor-parallel
rank's heads, in the KV format's dtype::

    from engine_hook import KVCacheClient
    from store import KVFormat

    cache = KVCacheClient("/var/cache/lmctl", model="my-model",
                          kv_format=KVFormat("bfloat16", num_layers=30, num_kv_heads=3, head_dim=64))
    cache.save(token_ids, kv)                 # queued; written in the background
    hit = cache.load(token_ids)               # hit.tokens leading tokens, hit.kv their KV
    cache.close()

Identity (model, KV format, adapter, cache salt) is the same as the vLLM connector's, so
chunks are shared with vLLM engines that use the same model id and format.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from store import AdapterIdentity, KVFormat, Namespace, StoreConfig, StoreError, open_shared, release_shared
from store.format.tensors import to_dtype

from . import fingerprint
from .fingerprint import ModelFingerprint
from .identity import AdapterCache
from .namespaces import NamespaceBook
from .transfer import ChunkWriter, StagingPool, chunk_layout, chunk_tensor

log = logging.getLogger("lmctl.engine_hook")


@dataclass
class LoadedPrefix:
    """The cached prefix of a prompt: its first ``tokens`` tokens and their KV."""

    tokens: int
    chunks: int
    kv: torch.Tensor


class KVCacheClient:
    """Save and load prompt KV through an lmctl store, for any engine."""

    def __init__(self, store_path: str | os.PathLike[str], model: str, kv_format: KVFormat, *,
                 tokenizer: str | None = None, model_fingerprint: str | None = None,
                 model_path: str | os.PathLike[str] | None = None, quantization: str | None = None,
                 save_buffers: int = 8, config: StoreConfig | None = None) -> None:
        """``model_fingerprint``: ``"auto"`` (the default when ``model_path`` is given)
        computes it from the checkpoint in ``model_path`` (see ``engine_hook.fingerprint``;
        ``quantization`` and the KV format's dtype are part of it); ``"off"`` or None
        without ``model_path``: no fingerprint; any other string is used as is."""
        self.kv_format = kv_format
        self.fingerprint: ModelFingerprint | None = None
        if model_fingerprint == "off":
            model_fingerprint = None
        elif model_fingerprint == "auto" or (model_fingerprint is None and model_path is not None):
            if model_path is None:
                raise StoreError("model_fingerprint='auto' needs model_path (the checkpoint's folder)")
            self.fingerprint = fingerprint.model_fingerprint(os.fspath(model_path), None, quantization, kv_format.dtype)
            model_fingerprint = self.fingerprint.digest
        self.store = open_shared(store_path, config)
        self.adapters = AdapterCache()
        info: dict[str, Any] = {"engine": "engine_hook.api"}
        if tokenizer:
            info["tokenizer"] = tokenizer
        if model_path is not None:
            info["model_path"] = os.fspath(model_path)
        self.book = NamespaceBook(self.store, model, info, model_fingerprint)
        self.pool = StagingPool(kv_format.chunk_bytes, max(1, save_buffers) + 1)
        self.writer = ChunkWriter(self.store, self.pool)
        self._layout = chunk_layout(kv_format)

    def adapter(self, name: str, folder: str | os.PathLike[str]) -> AdapterIdentity:
        """The identity of the adapter in ``folder`` (hashed once, re-hashed if it changes)."""
        return self.adapters.identity(name, folder)

    def namespace(self, adapter: AdapterIdentity | None = None, cache_salt: str | None = None) -> Namespace:
        return self.book.get(self.kv_format, adapter, cache_salt)

    def lookup(self, tokens: Sequence[int], adapter: AdapterIdentity | None = None,
               cache_salt: str | None = None) -> int:
        """How many leading tokens of ``tokens`` are cached (a multiple of the chunk size)."""
        return self.store.lookup(self.namespace(adapter, cache_salt), tokens, block=None).hit_tokens

    def save(self, tokens: Sequence[int], kv: torch.Tensor, adapter: AdapterIdentity | None = None,
             cache_salt: str | None = None) -> int:
        """Queue the full chunks of ``tokens`` that the store lacks. ``kv`` holds at least
        their KV, [layers, planes, tokens, kv_heads, head_dim] (planes: 2, K and V; 1 for an MLA
        latent). Returns how many were queued;
        chunks that find no free buffer are dropped (and counted), never waited for."""
        fmt = self.kv_format
        want = (fmt.num_layers, fmt.kv_planes, fmt.num_kv_heads, fmt.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise StoreError(f"kv must be [layers, planes, tokens, kv_heads, head_dim] = "
                             f"[{want[0]}, {want[1]}, T, {want[2]}, {want[3]}], got {list(kv.shape)}")
        if kv.dtype != to_dtype(fmt.dtype):
            raise StoreError(f"kv dtype {kv.dtype} does not match the KV format's {fmt.dtype}")
        ns = self.namespace(adapter, cache_salt)
        keys = ns.chunk_keys(tokens)
        keys = keys[: kv.shape[2] // fmt.chunk_size]
        tiers = self.store.locate(keys)
        prefixes = self.store.prefix_ids(tokens, fmt.chunk_size, len(keys)) if None in tiers else []
        queued = 0
        cs = fmt.chunk_size
        for i, (key, tier) in enumerate(zip(keys, tiers, strict=True)):
            if tier is not None:
                continue
            buf = self.pool.acquire()
            if buf is None:
                self.writer.drop(key)
                continue
            chunk_tensor(buf, fmt).copy_(kv[:, :, i * cs : (i + 1) * cs])
            self.writer.submit(key, buf, self._layout, cs, prefixes[i] if i < len(prefixes) else None)
            queued += 1
        return queued

    def load(self, tokens: Sequence[int], adapter: AdapterIdentity | None = None,
             cache_salt: str | None = None, max_tokens: int | None = None) -> LoadedPrefix:
        """The longest cached prefix of ``tokens`` (whole chunks), read and verified.
        A chunk that fails its checks (checksum, length, a disk error) ends the prefix there;
        nothing raises."""
        fmt = self.kv_format
        ns = self.namespace(adapter, cache_salt)
        res = self.store.lookup(ns, tokens, block=None)  # whole chunks: this API saves only those
        n = res.hit_chunks
        if max_tokens is not None:
            n = min(n, max_tokens // fmt.chunk_size)
        cs = fmt.chunk_size
        shape = (fmt.num_layers, fmt.kv_planes, n * cs, fmt.num_kv_heads, fmt.head_dim)
        out = torch.empty(shape, dtype=to_dtype(fmt.dtype))
        buf = self.pool.acquire(wait=True)
        assert buf is not None
        got = 0
        try:
            for i in range(n):
                try:
                    info = self.store.get_into(res.keys[i], buf.numpy().data, expect=fmt.chunk_bytes)
                except Exception:  # the engine recomputes from here; it never sees the store's trouble
                    log.warning("lmctl: loading chunk %s failed", res.keys[i].hex()[:16], exc_info=True)
                    break
                if info is None or info.raw_bytes != fmt.chunk_bytes:
                    break
                out[:, :, i * cs : (i + 1) * cs].copy_(chunk_tensor(buf, fmt))
                got += 1
        finally:
            self.pool.release(buf)
        return LoadedPrefix(got * cs, got, out[:, :, : got * cs])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued saves are on disk."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        self.writer.close()
        release_shared(self.store)
