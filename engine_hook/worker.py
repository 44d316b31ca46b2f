"""The connector's worker side: copies KV between vLLM's paged cache and the store.

Loads run in ``start_load_kv``, before the forward pass, and read the store there: a slow
disk slows that step. Saves copy each chunk into a staging buffer after the forward pass
and hand it to a background writer; when no buffer is free the save is dropped and counted.

Failures never reach the engine's step loop: they are logged with their traceback. A chunk
that cannot be loaded is reported, with every block after it, through
``take_load_errors`` (vLLM recomputes from there); a chunk that cannot be saved is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from store import open_shared, release_shared

from .ops import LoadOp, SaveOp
from .transfer import ChunkWriter, PagedKV, StagingPool, chunk_layout, chunk_tensor

if TYPE_CHECKING:
    from .context import ConnectorContext

log = logging.getLogger("lmctl.engine_hook")


class LMCtlConnectorWorker:
    """The worker side of ``LMCtlConnector``, on its own reference to the process's store.

    It records its rank's namespace when it starts; its buffers and writer exist once vLLM
    registers the KV caches."""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.store = open_shared(ctx.settings.store_path)
        self._closed = False
        ctx.namespace_book(self.store)
        self._layout = chunk_layout(ctx.kv_format)
        self._paged: PagedKV | None = None
        self._pool: StagingPool | None = None
        self._writer: ChunkWriter | None = None
        self._load_errors: set[int] = set()
        self.loaded_chunks = 0
        self.load_failures = 0
        self.load_s = 0.0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        layers = [kv_caches[n] for n in ctx.layer_names if n in kv_caches]
        if len(layers) != len(ctx.layer_names):
            layers = list(kv_caches.values())
        self._paged = PagedKV(layers, ctx.kv_format, ctx.block_size, ctx.settings.kv_layout)
        self._pool = StagingPool(ctx.kv_format.chunk_bytes, ctx.settings.save_queue + 2)
        self._writer = ChunkWriter(self.store, self._pool)
        log.info("lmctl: KV layout %s, %d layers, chunk %.1f MiB, %d save buffers", self._paged.layout,
                 len(layers), ctx.kv_format.chunk_bytes / 2**20, ctx.settings.save_queue)

    # -- loads ------------------------------------------------------------------------
    def load(self, ops: Sequence[LoadOp]) -> None:
        """Read and scatter each op's chunks into the engine's blocks, now."""
        if not ops or self._paged is None:
            return
        t0 = time.perf_counter()
        for op in ops:
            self._load(op)
        self.load_s += time.perf_counter() - t0

    def _load(self, op: LoadOp) -> None:
        """Load one request's chunks in order; the first that fails ends the load, and its
        blocks and every later chunk's are reported for recomputing."""
        assert self._paged is not None and self._pool is not None
        fmt = self.ctx.kv_format
        done = 0
        buf = None
        try:
            buf = self._pool.acquire(wait=True)
            assert buf is not None
            chunk = chunk_tensor(buf, fmt)
            for key, blocks in zip(op.keys, op.blocks, strict=True):
                if self.store.get_into(key, buf.numpy().data) is None:
                    break  # missing, or failed its checksum (the store dropped and counted it)
                self._paged.scatter(chunk, blocks)
                done += 1
                self.loaded_chunks += 1
        except Exception:
            key_hex = op.keys[done].hex()[:16] if done < len(op.keys) else "?"
            log.warning("lmctl: request %s: loading chunk %s failed", op.req_id, key_hex, exc_info=True)
        finally:
            if buf is not None:
                self._pool.release(buf)
        if done < len(op.keys):
            self.load_failures += 1
            for row in op.blocks[done:]:
                self._load_errors.update(b for b in row if b is not None)
            log.warning("lmctl: request %s: chunk %d of %d could not be loaded; vLLM recomputes from there",
                        op.req_id, done + 1, len(op.keys))

    def take_load_errors(self) -> set[int]:
        """The block ids that failed to load since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves ------------------------------------------------------------------------
    def save(self, ops: Sequence[SaveOp]) -> None:
        """Copy each op's blocks into a staging buffer and queue it for the writer; an op
        that finds no free buffer is dropped and counted, never waited for."""
        if not ops or self._paged is None:
            return
        assert self._pool is not None and self._writer is not None
        fmt = self.ctx.kv_format
        for op in ops:
            buf = self._pool.acquire()
            if buf is None:
                self._writer.drop()
                continue
            try:
                self._paged.gather(op.blocks, chunk_tensor(buf, fmt))
            except Exception:
                log.warning("lmctl: gathering a chunk of request %s failed", op.req_id, exc_info=True)
                self._pool.release(buf)
                continue
            self._writer.submit(op.key, buf, self._layout, fmt.chunk_size)

    # -- life cycle -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loaded_chunks": self.loaded_chunks, "load_failures": self.load_failures,
                               "load_s": round(self.load_s, 4)}
        if self._writer is not None:
            out["writer"] = dict(self._writer.stats.__dict__)
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves."""
        return True if self._writer is None else self._writer.flush(timeout)

    def close(self) -> None:
        """Write what is queued and let go of the store (safe to call more than once)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._closed:
            self._closed = True
            release_shared(self.store)
