"""The connector's worker side: copies KV between vLLM's paged cache and the store.

Loads are asynchronous: ``load`` hands each request's chunks to the loader, a thread with
staging buffers of its own (never shared with saves), which reads, verifies and scatters
them into the request's blocks while the engine keeps stepping the other requests; the
request waits (vLLM's WAITING_FOR_REMOTE_KVS) until ``take_finished`` reports it. Saves
copy each chunk into a staging buffer after the forward pass and hand it to a background
writer; when no buffer is free the save is dropped and counted, never waited for.

Failures never reach the engine's step loop: they are logged with their traceback. A chunk
that cannot be loaded is reported, with every block after it, through
``take_load_errors`` (vLLM recomputes from there), no later than the step that reports its
request finished; a chunk that cannot be saved is dropped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from store import open_shared, release_shared

from .cpu_threads import serial_torch
from .ops import LoadOp, SaveOp
from .stats import StatsRecorder
from .transfer import ChunkWriter, PagedKV, StagingPool, chunk_layout, chunk_nbytes, chunk_tensor

if TYPE_CHECKING:
    from .context import ConnectorContext

log = logging.getLogger("lmctl.engine_hook")

#: loader threads: one request's chunks load in order on one
LOADERS = 2
#: a loader reads up to this many of a request's chunks together (``Store.get_many_into``:
#: whole records, several in flight), and the next as many while it copies those; its two
#: windows of staging buffers take at most ``LOAD_WINDOW_BYTES``
LOAD_WINDOW = 4
LOAD_WINDOW_BYTES = 64 << 20


def load_window(chunk_bytes: int) -> int:
    """Chunks a loader reads together (it holds two windows of staging buffers)."""
    return max(1, min(LOAD_WINDOW, (LOAD_WINDOW_BYTES // 2) // max(1, chunk_bytes)))


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
        self._pool: StagingPool | None = None       # saves' staging buffers
        self._load_pool: StagingPool | None = None  # the loader's own
        self._writer: ChunkWriter | None = None
        # serial_torch: a loader's scatter must not give it an OpenMP team of its own, which
        # would slow every forward pass of a CPU engine (see cpu_threads)
        self._loader = ThreadPoolExecutor(max_workers=LOADERS, thread_name_prefix="lmctl-load",
                                          initializer=serial_torch)
        # reads ahead of the loaders' copies (one per loader: each keeps at most one in flight)
        self._reader = ThreadPoolExecutor(max_workers=LOADERS, thread_name_prefix="lmctl-read",
                                          initializer=serial_torch)
        self.read_ahead = True
        self._lock = threading.Lock()
        self._local = threading.local()
        self._inflight: dict[str, Future[set[int]]] = {}
        self._load_errors: set[int] = set()
        self._load_report: dict[str, list[float]] = {}  # tier -> [bytes, seconds] since the last report
        self.loaded_chunks = 0
        self.failed_loads = 0
        self.load_s = 0.0
        self.recorder = StatsRecorder()  # figures for vLLM's metrics, since the last step's report

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        layers = [kv_caches[n] for n in ctx.layer_names if n in kv_caches]
        if len(layers) != len(ctx.layer_names):
            layers = list(kv_caches.values())
        self._paged = PagedKV(layers, ctx.kv_format, ctx.block_size, ctx.settings.kv_layout)
        cuda = self._paged.device.type == "cuda"
        self._pool = StagingPool(ctx.kv_format.chunk_bytes, ctx.settings.save_queue + 2, pinned=cuda)
        self._window = load_window(ctx.kv_format.chunk_bytes)
        # two windows per loader: one copied into the engine's blocks while the next is read
        self._load_pool = StagingPool(ctx.kv_format.chunk_bytes, 2 * LOADERS * self._window, pinned=cuda)
        self._writer = ChunkWriter(self.store, self._pool, self.recorder)
        log.info("lmctl: KV layout %s, %d layers, chunk %.1f MiB, %d save buffers", self._paged.layout,
                 len(layers), ctx.kv_format.chunk_bytes / 2**20, ctx.settings.save_queue)

    # -- loads ------------------------------------------------------------------------
    def load(self, ops: Sequence[LoadOp]) -> None:
        """Start loading each op's chunks on the loader; returns at once."""
        for op in ops:
            if self._paged is None:  # no KV caches registered: nothing can be loaded into
                fut: Future[set[int]] = Future()
                fut.set_result({b for row in op.blocks for b in row if b is not None})
            else:
                fut = self._loader.submit(self._load, op, time.perf_counter())
            with self._lock:
                self._inflight[op.req_id] = fut
        if ops:
            self._report_queues()

    def _load(self, op: LoadOp, received: float) -> set[int]:
        """Load one request's chunks in order; the first that fails ends the load. Returns
        its blocks and every later chunk's, for recomputing. ``received``: when the worker
        was given the load (its wait is measured from there).

        Chunks are read ``load_window`` at a time (``Store.get_many_into``: whole records,
        several in flight). With ``read_ahead`` and a second window of staging buffers free,
        the next window is read (on a reader thread) while this one is copied into the
        engine's blocks."""
        assert self._paged is not None and self._load_pool is not None
        fmt = self.ctx.kv_format
        n = len(op.keys)
        sizes = [op.record_tokens(i, fmt.chunk_size) for i in range(n)]  # a tail record holds fewer
        wants = [chunk_nbytes(fmt, t) for t in sizes]
        w = max(1, min(self._window, n))
        done = 0
        bufs: list[torch.Tensor] = []
        pending: Future[Any] | None = None
        why = "missing"
        stream = None
        t0 = time.perf_counter()

        def read(start: int, half: int) -> tuple[list[Any], float]:
            part = op.keys[start : start + w]
            outs = [b.numpy().data for b in bufs[half * w : half * w + len(part)]]
            t = time.perf_counter()
            infos = self.store.get_many_into(part, outs, expect=wants[start : start + len(part)])
            return list(infos), (time.perf_counter() - t) / max(1, len(part))

        try:
            for _ in range(w):  # a loader never holds more than two windows
                buf = self._load_pool.acquire(wait=True)
                assert buf is not None
                bufs.append(buf)
            if self.read_ahead and n > w:
                for _ in range(w):
                    buf = self._load_pool.acquire()
                    if buf is None:
                        break
                    bufs.append(buf)
                if len(bufs) < 2 * w:  # no second window free: read, then copy
                    for b in bufs[w:]:
                        self._load_pool.release(b)
                    del bufs[w:]
            ahead = len(bufs) == 2 * w
            stream = self._stream()
            start, half = 0, 0
            if ahead:
                pending = self._reader.submit(read, 0, 0)
            ok = True
            while ok and start < n:
                if pending is not None:
                    fut, pending = pending, None
                    infos, each = fut.result()
                else:
                    infos, each = read(start, half)
                good = 0
                for j, info in enumerate(infos):
                    if info is None:
                        break  # missing, or failed its checks (the store dropped and counted it)
                    if info.raw_bytes != wants[start + j]:
                        # the rest of the buffer would still hold the previous chunk's KV
                        why = "bad_length"
                        log.warning("lmctl: request %s: chunk %s holds %d bytes, not the %d of its %d tokens; a miss",
                                    op.req_id, op.keys[start + j].hex()[:16], info.raw_bytes, wants[start + j],
                                    sizes[start + j])
                        break
                    good += 1
                ok = good == len(infos)
                nxt = start + len(infos)
                if ok and ahead and nxt < n:
                    pending = self._reader.submit(read, nxt, 1 - half)  # into the other window
                for j in range(good):
                    info = infos[j]
                    chunk = chunk_tensor(bufs[half * w + j], fmt, sizes[start + j])
                    if stream is None:
                        self._paged.scatter(chunk, op.blocks[start + j])
                    else:  # on a side stream, so the engine's own stream never waits for it
                        with torch.cuda.stream(stream):
                            self._paged.scatter(chunk, op.blocks[start + j])
                    done += 1
                    with self._lock:
                        self.loaded_chunks += 1
                        rep = self._load_report.setdefault(info.tier, [0.0, 0.0])
                        rep[0] += info.raw_bytes
                        rep[1] += each
                    self.recorder.record({"loaded_chunks": 1, "loaded_bytes": info.raw_bytes}, {"tier": info.tier})
                if stream is not None:
                    stream.synchronize()  # the copies are done before the buffers take the next chunks
                start = nxt
                if ahead:
                    half = 1 - half
        except Exception:
            why = "error"
            key_hex = op.keys[done].hex()[:16] if done < len(op.keys) else "?"
            log.warning("lmctl: request %s: loading chunk %s failed", op.req_id, key_hex, exc_info=True)
        finally:
            if pending is not None:  # a read ahead of chunks not needed: let it land first
                try:
                    pending.result()
                except Exception:
                    pass
            if stream is not None:
                stream.synchronize()  # no copy out of a buffer outlives its loan
            for buf in bufs:
                self._load_pool.release(buf)
            with self._lock:
                self.load_s += time.perf_counter() - t0
        failed: set[int] = set()
        if done < len(op.keys):
            self.recorder.record({"failed_loads": 1, "failed_load_chunks": len(op.keys) - done}, {"reason": why},
                                 observe={"load_seconds": time.perf_counter() - received})
            with self._lock:
                self.failed_loads += 1
            for row in op.blocks[done:]:
                failed.update(b for b in row if b is not None)
            log.warning("lmctl: request %s: chunk %d of %d could not be loaded; vLLM recomputes from there",
                        op.req_id, done + 1, len(op.keys))
        else:
            self.recorder.record(observe={"load_seconds": time.perf_counter() - received})
        return failed

    def _stream(self) -> Any:
        """This loader thread's CUDA stream (None on a CPU engine)."""
        assert self._paged is not None
        if self._paged.device.type != "cuda":
            return None
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = torch.cuda.Stream(device=self._paged.device)
        return s

    def take_finished(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose loads finished since the last call (waiting up to ``wait_s`` for
        one, when loads are in flight); their failed blocks go to ``take_load_errors`` now,
        so vLLM sees them in the same step."""
        if wait_s > 0:
            with self._lock:
                futs = list(self._inflight.values())
            if futs:
                wait(futs, timeout=wait_s, return_when=FIRST_COMPLETED)
        done: set[str] = set()
        with self._lock:
            for req_id, fut in list(self._inflight.items()):
                if fut.done():
                    del self._inflight[req_id]
                    done.add(req_id)
                    try:
                        self._load_errors.update(fut.result())
                    except Exception:  # _load catches everything; this is a last resort
                        log.warning("lmctl: request %s: the load failed", req_id, exc_info=True)
        if done:
            self._report_queues()
        return done

    def _report_queues(self) -> None:
        """This engine's loads in flight and saves waiting for the writer, as gauges in the
        store (``lmctl top``, the daemon's metrics), labelled by the process."""
        try:
            pid = str(os.getpid())
            self.store.set_gauge("engine_loads_in_flight", len(self._inflight), pid=pid)
            if self._writer is not None:
                self.store.set_gauge("engine_save_queue", self._writer.pending, pid=pid)
        except Exception:  # figures for operators never get in the engine's way
            log.debug("lmctl: reporting queue depths failed", exc_info=True)

    def wait_loads(self, timeout: float | None = None) -> bool:
        """Wait for every load in flight (tests and shutdown); whether they all finished."""
        with self._lock:
            futs = list(self._inflight.values())
        end = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            try:
                f.result(None if end is None else max(0.0, end - time.monotonic()))
            except Exception:
                return False
        return True

    def take_load_errors(self) -> set[int]:
        """The block ids that failed to load, of requests reported finished."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def take_load_report(self) -> dict[str, tuple[int, float]]:
        """Bytes and seconds of the chunks loaded since the last call, per tier."""
        with self._lock:
            rep, self._load_report = self._load_report, {}
        return {t: (int(b), s) for t, (b, s) in rep.items()}

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
                self._writer.drop(op.key)
                continue
            try:
                self._paged.gather(op.blocks, chunk_tensor(buf, fmt, op.tokens))
            except Exception:
                log.warning("lmctl: gathering a chunk of request %s failed", op.req_id, exc_info=True)
                self._pool.release(buf)
                self._writer.drop(op.key, "error")
                continue
            if op.tokens is None or op.tokens == fmt.chunk_size:
                self._writer.submit(op.key, buf, self._layout, fmt.chunk_size, op.prefix, op.aliases)
            else:  # a request's tail: its whole blocks, laid out as a chunk of fewer tokens
                self._writer.submit(op.key, buf, chunk_layout(fmt, op.tokens), op.tokens, op.prefix, op.aliases,
                                    chunk_nbytes(fmt, op.tokens))
        self._report_queues()

    def take_stats(self) -> dict[str, Any] | None:
        """The figures recorded since the last call, for vLLM's metrics (None if none)."""
        return self.recorder.take()

    # -- life cycle -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loaded_chunks": self.loaded_chunks, "failed_loads": self.failed_loads,
                               "load_s": round(self.load_s, 4)}
        if self._writer is not None:
            out["writer"] = dict(self._writer.stats.__dict__)
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves."""
        return True if self._writer is None else self._writer.flush(timeout)

    def close(self) -> None:
        """Finish the loads in flight, write what is queued and let go of the store (safe to
        call more than once)."""
        self._loader.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._closed:
            self._closed = True
            release_shared(self.store)
