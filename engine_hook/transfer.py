"""Moving KV between an engine's tensors and the store (imports torch).

* ``StagingPool``: reusable, page-aligned chunk buffers (the store reads into them
  with O_DIRECT and no extra copy; reusing them avoids first-touch page faults).
* ``ChunkWriter``: a background thread that writes gathered chunks to the store. Its
  queue is bounded by the pool: when no buffer is free the save is dropped and
  counted, so a slow disk never makes the step loop wait for a save. Dropped saves
  (a full queue, a full disk) go to the store's event log in batches, from the
  writer's thread: at most one index transaction a second. (Loads read the
  store on the step loop, before the forward pass: a slow disk does slow those.)
* ``PagedKV``: the one place that knows how an engine lays out its paged KV cache.
  It views each layer as ``[rows, planes (K, V; or one MLA latent), tokens, kv_heads,
  head_dim]`` and copies whole blocks to and from the store's canonical chunk layout
  ``[layers, planes, tokens, kv_heads, head_dim]``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from store import DiskFullError, KVFormat, PutItem, ReadOnlyError, Store, StoreError
from store.format.memory import Region
from store.format.record import ALIGN
from store.format.tensors import to_dtype

from .config import LAYOUTS
from .cpu_threads import serial_torch
from .stats import StatsRecorder

log = logging.getLogger("lmctl.engine_hook")


def chunk_layout(fmt: KVFormat, tokens: int | None = None) -> dict[str, Any]:
    """The layout a record of ``tokens`` (default: a full chunk) is stored with."""
    shape = list(fmt.chunk_shape)
    if tokens is not None:
        shape[2] = tokens
    return {"dtype": fmt.dtype, "shape": shape}


def chunk_nbytes(fmt: KVFormat, tokens: int | None = None) -> int:
    """Raw bytes of a record of ``tokens`` (default: a full chunk)."""
    return fmt.chunk_bytes if tokens is None else fmt.chunk_bytes // fmt.chunk_size * tokens


class StagingPool:
    """``count`` aligned buffers of ``nbytes`` each, handed out without blocking; ``pinned``
    (page-locked host memory) for engines on a CUDA device, so copies to it are DMA."""

    def __init__(self, nbytes: int, count: int, pinned: bool = False) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self.count = count
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        # one region for all the buffers, every page written once, in order, here (not on
        # the hot path); in host memory, on huge pages where the kernel gives them: the
        # pages' physical layout sets how many requests an O_DIRECT read of a chunk takes
        # (store/format/memory.py, docs/performance.md)
        stride = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        self._backing: list[Any] = []
        if pinned:  # page-locked by the CUDA driver, so copies to and from it are DMA
            raw = torch.empty(stride * count + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = (-raw.data_ptr()) % ALIGN
            raw[skip : skip + stride * count].fill_(0)
            self._backing.append(raw)
        else:
            region = Region(stride * count)
            raw = torch.frombuffer(region.view, dtype=torch.uint8)
            skip = 0
            self._backing += [region, raw]
        for i in range(count):
            self._free.put(raw[skip + i * stride : skip + i * stride + nbytes])

    def acquire(self, wait: bool = False) -> torch.Tensor | None:
        try:
            return self._free.get(block=wait)
        except queue.Empty:
            return None

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    def free(self) -> int:
        """Buffers not handed out now."""
        return self._free.qsize()


def chunk_tensor(buf: torch.Tensor, fmt: KVFormat, tokens: int | None = None) -> torch.Tensor:
    """View a staging buffer as one chunk: [layers, planes, tokens, kv_heads, head_dim]
    (``tokens``: of a partial chunk, a request's tail, laid out the same way)."""
    shape = fmt.chunk_shape if tokens is None else (*fmt.chunk_shape[:2], tokens, *fmt.chunk_shape[3:])
    return buf[: chunk_nbytes(fmt, tokens)].view(to_dtype(fmt.dtype)).view(shape)


@dataclass
class WriterStats:
    queued: int = 0
    saved: int = 0
    already_stored: int = 0
    not_admitted: int = 0  # the store's admission kept it off NVMe (admit = second-hit): not an error
    dropped: int = 0
    rejected_full: int = 0  # the store refused it (the tier is full of pinned chunks, or too small)
    read_only: int = 0  # the store refused it: its filesystem is read-only
    failed: int = 0
    bytes: int = 0
    busy_s: float = 0.0


@dataclass
class _Job:
    key: bytes
    buf: torch.Tensor
    layout: dict[str, Any]
    tokens: int
    queued_at: float
    prefix: bytes | None = None
    aliases: list[tuple[bytes, int]] | None = None
    nbytes: int | None = None  # the buffer's first bytes hold the record (None: all of them)


class ChunkWriter:
    """Writes chunks to the store on a background thread, in small batches. ``recorder``
    (optional) gets each chunk's outcome for the engine's metrics."""

    BATCH = 4
    #: dropped saves are written to the store's event log at most this often (seconds)
    DROP_FLUSH_S = 1.0
    #: dropped saves waiting for the event log at most (more are counted in ``stats`` only)
    MAX_PENDING_DROPS = 4096

    def __init__(self, store: Store, pool: StagingPool, recorder: StatsRecorder | None = None) -> None:
        self.store = store
        self.pool = pool
        self.stats = WriterStats()
        self.recorder = recorder
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._drops: list[tuple[bytes | None, str]] = []
        self._drops_lock = threading.Lock()
        self._drops_at = time.monotonic()
        self._drop_log_failed = False
        self._thread = threading.Thread(target=self._run, name="lmctl-writer", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, buf: torch.Tensor, layout: dict[str, Any], tokens: int,
               prefix: bytes | None = None, aliases: list[tuple[bytes, int]] | None = None,
               nbytes: int | None = None) -> None:
        """Queue a filled buffer (taken from the pool) for writing; the writer gives it back.
        ``aliases``: the record's partial keys (``PutItem.aliases``); ``nbytes``: the record is
        the buffer's first ``nbytes`` (a partial chunk's)."""
        self.stats.queued += 1
        self._q.put(_Job(key, buf, layout, tokens, time.perf_counter(), prefix, aliases, nbytes))

    #: a drop's reason in the engine's metrics -> its reason in the store's event log
    EVENT_REASONS = {"queue_full": "queue-full", "error": "failed"}

    def drop(self, key: bytes | None = None, reason: str = "queue_full") -> None:
        """Count a chunk that is not saved: ``queue_full`` (no free staging buffer) or
        ``error`` (copying it out of the engine failed: counted with the failed writes). The
        store's event log learns of it in the writer's next batch of dropped saves."""
        if reason == "error":
            self.stats.failed += 1
        else:
            self.stats.dropped += 1
        self._record({"dropped_saves": 1}, reason)
        self._note_drops([(key, self.EVENT_REASONS.get(reason, reason))])

    def _record(self, counts: dict[str, float], reason: str | None = None,
                observe: dict[str, float] | None = None) -> None:
        if self.recorder is not None:
            self.recorder.record(counts, {"reason": reason} if reason else None, observe)

    def _note_drops(self, drops: list[tuple[bytes | None, str]]) -> None:
        with self._drops_lock:
            room = self.MAX_PENDING_DROPS - len(self._drops)
            self._drops.extend(drops[: max(0, room)])

    def _flush_drops(self) -> None:
        """Write the dropped saves noted so far to the store's event log, in one transaction."""
        with self._drops_lock:
            drops, self._drops = self._drops, []
            self._drops_at = time.monotonic()
        if not drops:
            return
        try:
            self.store.record_dropped_saves(drops)
            self._drop_log_failed = False
        except Exception as exc:  # e.g. the index's disk is full too: keep them for the next try
            if not self._drop_log_failed:
                log.warning("lmctl: could not log %d dropped save(s) in the store: %s", len(drops), exc)
            self._drop_log_failed = True
            self._note_drops(drops)

    def _report_queue(self) -> None:
        """The queue's depth as this process's gauge in the store (``lmctl top``)."""
        try:
            self.store.set_gauge("engine_save_queue", self.pending, pid=str(os.getpid()))
        except Exception:  # figures for operators never get in the writer's way
            log.debug("lmctl: reporting the save queue failed", exc_info=True)

    @property
    def pending(self) -> int:
        """Chunks queued or being written."""
        return int(self._q.unfinished_tasks)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is written. Returns False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.005)
        self._flush_drops()
        return True

    def close(self) -> None:
        self.flush(timeout=60)
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        serial_torch()  # its copies stay off the engine's OpenMP threads (see cpu_threads)
        while True:
            try:
                first = self._q.get(timeout=self.DROP_FLUSH_S)
            except queue.Empty:  # idle: what was dropped meanwhile goes to the event log
                self._flush_drops()
                self._report_queue()
                continue
            if first is None:
                self._flush_drops()
                self._q.task_done()
                return
            jobs = [first]
            while len(jobs) < self.BATCH:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    self._q.task_done()
                    break
                jobs.append(nxt)
            t0 = time.perf_counter()
            try:
                items = [PutItem(j.key, j.buf[: j.nbytes].numpy().data, j.layout, j.tokens, prefix=j.prefix,
                                 aliases=j.aliases or None) for j in jobs]
                results = self.store.save_many(items)
            except ReadOnlyError as exc:  # the disk went read-only: hits go on, saves are counted
                if not self.stats.read_only:
                    log.warning("lmctl: saves are refused from now on: %s", exc)
                results = ["failed"] * len(jobs)
                self.stats.read_only += len(jobs)
                self._record({"dropped_saves": len(jobs)}, "read_only")
                self._note_drops([(j.key, "read-only") for j in jobs])
            except Exception as exc:  # never let a disk problem reach the engine
                log.warning("lmctl: saving %d chunks failed: %s", len(jobs), exc, exc_info=True)
                results = ["failed"] * len(jobs)
                self.stats.failed += len(jobs)
                self._record({"dropped_saves": len(jobs)}, "error")
                why = "disk-full" if isinstance(exc, DiskFullError) else "failed"
                self._note_drops([(j.key, why) for j in jobs])
            else:
                done = time.perf_counter()
                for j, outcome in zip(jobs, results, strict=True):
                    if outcome == "stored":
                        self.stats.saved += 1
                        self.stats.bytes += j.buf.numel()
                        self._record({"saved_chunks": 1, "saved_bytes": j.buf.numel()},
                                     observe={"save_seconds": done - j.queued_at})
                    elif outcome == "present":
                        self.stats.already_stored += 1
                        self._record({"already_stored_chunks": 1})
                    elif outcome == "not-admitted":  # kept off NVMe until its prefix comes again
                        self.stats.not_admitted += 1
                        self._record({"not_admitted_chunks": 1})
                    else:  # no-room: put_many stores nothing for a chunk that cannot fit
                        self.stats.rejected_full += 1
                        self._record({"dropped_saves": 1}, "store_full")
            self.stats.busy_s += time.perf_counter() - t0
            for j in jobs:
                self.pool.release(j.buf)
            if self._drops and (self._q.empty() or time.monotonic() - self._drops_at >= self.DROP_FLUSH_S):
                self._flush_drops()
            for _j in jobs:
                self._q.task_done()
            self._report_queue()


class PagedKV:
    """An engine's paged KV cache, one tensor per layer, seen as whole blocks.

    Supported per-layer layouts (logical shapes; physical strides may differ):

    * ``BHNC``:  [blocks, kv_heads, block_size, C]  (vLLM >= 0.31, every backend). C is K||V
      (``2 * head_dim``), or for MLA one latent of ``head_dim`` (``kv_planes`` 1). vLLM's
      ``KVCacheLayout`` chooses the physical order (LBHNC, LBNHC, LHBNC, and the cross-layer
      BLHNC, BLNHC, BHLNC): each is a strided view of this logical shape, so one view serves
      all six. Where the attention kernel's block is smaller than the scheduler's (vLLM
      splits a block into ``block_size / N`` kernel blocks), the tensor has that many more
      rows of N tokens each, and scheduler block ``b`` is rows ``b*r .. b*r+r-1``.
    * ``2BNHD``: [2, blocks, block_size, kv_heads, head_dim]  (FlashAttention, older vLLM)
    * ``B2NHD``: [blocks, 2, block_size, kv_heads, head_dim]  (FlashInfer NHD)
    * ``B2HND``: [blocks, 2, kv_heads, block_size, head_dim]  (FlashInfer HND)

    The layout is recognised from the shapes; pass ``layout`` where they are ambiguous.
    """

    LAYOUTS = LAYOUTS

    def __init__(self, layers: Sequence[torch.Tensor], fmt: KVFormat, block_size: int,
                 layout: str | None = None) -> None:
        if len(layers) != fmt.num_layers:
            raise StoreError(f"engine has {len(layers)} KV layers, the KV format says {fmt.num_layers}")
        if fmt.chunk_size % block_size:
            raise StoreError(f"chunk size {fmt.chunk_size} is not a multiple of the block size {block_size}")
        self.fmt = fmt
        self.block_size = block_size
        self.blocks_per_chunk = fmt.chunk_size // block_size
        first = layers[0]
        self.layout = layout or self.detect(first, fmt, block_size)
        if self.layout not in self.LAYOUTS:
            raise StoreError(f"unknown KV layout {self.layout!r}; known: {', '.join(self.LAYOUTS)}")
        if self.layout != "BHNC" and fmt.kv_planes != 2:
            raise StoreError(f"KV layout {self.layout} holds K and V; a latent (MLA) cache is BHNC")
        #: tokens per row of the tensors (the attention kernel's block) and rows per block
        self.rows_n = int(first.shape[2]) if self.layout == "BHNC" else block_size
        if self.rows_n <= 0 or block_size % self.rows_n:
            raise StoreError(f"KV cache rows of {self.rows_n} tokens do not divide the block size {block_size}")
        self.rows_per_block = block_size // self.rows_n
        for t in layers:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise StoreError(f"KV layers differ in shape or dtype: {tuple(t.shape)} {t.dtype} and "
                                 f"{tuple(first.shape)} {first.dtype}")
        self.views = [self._view(t) for t in layers]
        self.device = first.device
        #: indexed whole-layer copies (accelerators) rather than a copy per row (the CPU)
        self.vectorized = self.device.type != "cpu"
        self._device_chunk: torch.Tensor | None = None

    @staticmethod
    def detect(t: torch.Tensor, fmt: KVFormat, bs: int) -> str:
        h, d, p = fmt.num_kv_heads, fmt.head_dim, fmt.kv_planes
        shape = tuple(t.shape)
        found = []
        if len(shape) == 4 and shape[1] == h and shape[3] == p * d and 0 < shape[2] <= bs and bs % shape[2] == 0:
            found.append("BHNC")
        if len(shape) == 5 and p == 2:
            if shape[0] == 2 and shape[2:] == (bs, h, d):
                found.append("2BNHD")
            if shape[1:] == (2, bs, h, d):
                found.append("B2NHD")
            if shape[1:] == (2, h, bs, d):
                found.append("B2HND")
        if len(found) != 1:
            why = "ambiguous" if found else "not recognised"
            raise StoreError(
                f"KV cache layout {shape} is {why} (kv_heads={h}, head_dim={d}, planes={p}, block_size={bs}); "
                f"set kv_connector_extra_config['kv_layout'] to one of {', '.join(PagedKV.LAYOUTS)}")
        return found[0]

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        """A view (never a copy) of one layer as [rows, planes, N, kv_heads, head_dim]."""
        d, p = self.fmt.head_dim, self.fmt.kv_planes
        if self.layout == "BHNC":
            if t.stride(3) != 1:
                raise StoreError("KV cache layer's last dimension is not contiguous; it cannot be viewed "
                                 "as K||V without a copy")
            v = t.unflatten(3, (p, d)).permute(0, 3, 2, 1, 4)
        elif self.layout == "2BNHD":
            v = t.permute(1, 0, 2, 3, 4)
        elif self.layout == "B2NHD":
            v = t
        else:
            v = t.permute(0, 1, 3, 2, 4)
        if v.data_ptr() != t.data_ptr():  # pragma: no cover - a view never copies
            raise StoreError("KV cache layer could not be viewed without a copy")
        return v

    def _rows(self, block_ids: Sequence[int | None]) -> list[tuple[int, int]]:
        """(tensor row, first token of it in the chunk) for every row of the given blocks."""
        r, n, bs = self.rows_per_block, self.rows_n, self.block_size
        return [(b * r + i, j * bs + i * n) for j, b in enumerate(block_ids) if b is not None for i in range(r)]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy one chunk's blocks (in token order) into ``out`` [layers, planes, tokens, H, D].

        On the CPU, row by row. On an accelerator, each layer's rows are gathered on the
        device in one kernel into a chunk-sized device buffer, which then crosses to ``out``
        (pinned host memory) in one copy: a few large transfers instead of one per row."""
        rows = self._rows(block_ids)
        if self.vectorized:
            idx = torch.tensor([r for r, _ in rows], dtype=torch.long, device=self.device)
            dev = self._scratch(out)[:, :, : out.shape[2]]  # a tail's tokens: the first of a chunk's
            for layer, v in enumerate(self.views):
                g = v.index_select(0, idx)  # [R, planes, N, H, D]
                dev[layer, :, : len(rows) * self.rows_n].copy_(g.transpose(0, 1).flatten(1, 2))
            out.copy_(dev)  # waits: the writer thread reads ``out`` next
            return
        n = self.rows_n
        for layer, v in enumerate(self.views):
            dst = out[layer]
            for row, tok in rows:
                dst[:, tok : tok + n].copy_(v[row])

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int | None]) -> None:
        """Copy a chunk [layers, planes, tokens, H, D] into the engine's blocks; ``None`` skips
        one (a block the engine already holds). On the CPU row by row: small copies that a
        loader thread makes beside the engine's forward pass without taking every core from
        it. On an accelerator the chunk crosses in one copy, then one indexed copy per layer."""
        n = self.rows_n
        if src.device != self.device:
            src = src.to(self.device, non_blocking=True)
        rows = self._rows(block_ids)
        if self.vectorized:
            if not rows:
                return
            idx = torch.tensor([r for r, _ in rows], dtype=torch.long, device=self.device)
            toks = torch.tensor([t for _, t in rows], dtype=torch.long, device=self.device)
            for layer, v in enumerate(self.views):
                s = src[layer].unflatten(1, (-1, n)).transpose(0, 1)  # [chunk rows, planes, N, H, D]
                v.index_copy_(0, idx, s.index_select(0, toks // n))
            return
        for layer, v in enumerate(self.views):
            s = src[layer]
            for row, tok in rows:
                v[row].copy_(s[:, tok : tok + n])

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A device buffer of a full chunk shaped like ``like`` (whose tokens may be fewer)."""
        shape = (*like.shape[:2], self.block_size * self.blocks_per_chunk, *like.shape[3:])
        buf = self._device_chunk
        if buf is None or tuple(buf.shape) != shape or buf.dtype != like.dtype:
            buf = self._device_chunk = torch.empty(shape, dtype=like.dtype, device=self.device)
        return buf
