"""The vLLM connector's two sides without an engine: the worker side's copies and how it
handles failures (fault injection), and the facade that builds one side per role.

The facade tests import vLLM (for its connector base class and KV cache spec) but start no
engine: vLLM's config and scheduler output are stood in for by plain objects.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import env_with_path

from engine_hook.config import ConnectorSettings
from engine_hook.context import ConnectorContext
from engine_hook.ops import LoadOp, SaveOp
from engine_hook.transfer import ChunkWriter, StagingPool
from engine_hook.worker import LMCtlConnectorWorker
from store import KVFormat, Namespace, open_shared, release_shared

FMT = KVFormat("float32", num_layers=3, num_kv_heads=2, head_dim=8, chunk_size=32)
BS = 16
NB = 12
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(FMT.num_layers)]
EXTRA = {"chunk_size": FMT.chunk_size, "model_fingerprint": "off", "save_queue": 2}
PROMPT = list(range(100, 180))  # 80 tokens: two full chunks and a 16-token tail


def kv_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """One paged KV tensor per layer, as vLLM hands them over: [blocks, kv_heads, block_size, K||V]."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NB, FMT.num_kv_heads, BS, 2 * FMT.head_dim, generator=g) for n in LAYERS}


def same_blocks(caches: dict[str, torch.Tensor], dst: list[int], src: list[int]) -> bool:
    return all(torch.equal(t[dst], t[src]) for t in caches.values())


@pytest.fixture
def worker(tmp_path: Path) -> Any:
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "store"), **EXTRA})
    ctx = ConnectorContext(settings, "m", FMT, LAYERS, BS, None, None, {"engine": "test"})
    w = LMCtlConnectorWorker(ctx)
    yield w
    w.close()


def saved_chunks(worker: LMCtlConnectorWorker, caches: dict[str, torch.Tensor]) -> list[bytes]:
    """Save the prompt's two chunks from blocks 0-3 and wait for the writer."""
    keys = Namespace("m", FMT).chunk_keys(PROMPT)
    worker.save([SaveOp("r1", keys[0], [0, 1]), SaveOp("r1", keys[1], [2, 3])])
    assert worker.flush(10)
    assert worker.stats()["writer"]["saved"] == 2
    return keys


def hold_store_reads(worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the worker's store reads wait until the returned event is set (a slow tier)."""
    gate = threading.Event()
    real = worker.store.get_many_into

    def held(*args: Any, **kw: Any) -> Any:
        assert gate.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(worker.store, "get_many_into", held)
    return gate


def finish(worker: LMCtlConnectorWorker, req_id: str) -> None:
    """Wait for the worker's loads, as the engine does by polling get_finished each step."""
    assert worker.wait_loads(30)
    assert worker.take_finished() == {req_id}


# -- the worker side ---------------------------------------------------------------------
def test_worker_saves_chunks_and_loads_them_into_other_blocks(worker: LMCtlConnectorWorker) -> None:
    caches = kv_caches()
    worker.register_kv_caches(caches)
    keys = saved_chunks(worker, caches)
    untouched = {n: t[7].clone() for n, t in caches.items()}
    worker.load([LoadOp("r2", keys, [[4, 5], [6, None]])])  # block 7: the engine holds it already
    finish(worker, "r2")
    assert same_blocks(caches, [4, 5, 6], [0, 1, 2])
    assert all(torch.equal(caches[n][7], untouched[n]) for n in LAYERS)
    assert worker.loaded_chunks == 2 and worker.failed_loads == 0 and worker.take_load_errors() == set()


def test_the_next_chunk_is_read_while_one_is_copied_and_every_buffer_goes_back(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's load reads chunk i+1 (on a reader thread, into a second staging buffer)
    while chunk i is copied into the engine's blocks; a miss ends it with both buffers back.
    (A window of one chunk here: with a larger one, the next window is read the same way.)"""
    caches = kv_caches()
    worker.register_kv_caches(caches)
    keys = saved_chunks(worker, caches)
    assert worker._paged is not None and worker._load_pool is not None
    worker._window = 1
    log_: list[tuple[str, str, float]] = []
    real_get, real_scatter = worker.store.get_many_into, worker._paged.scatter

    def get_into(*args: Any, **kw: Any) -> Any:
        log_.append(("read", threading.current_thread().name, time.monotonic()))
        time.sleep(0.05)
        return real_get(*args, **kw)

    def scatter(*args: Any, **kw: Any) -> Any:
        log_.append(("copy", threading.current_thread().name, time.monotonic()))
        time.sleep(0.2)
        real_scatter(*args, **kw)
        log_.append(("copied", threading.current_thread().name, time.monotonic()))

    monkeypatch.setattr(worker.store, "get_many_into", get_into)
    monkeypatch.setattr(worker._paged, "scatter", scatter)
    worker.load([LoadOp("r2", keys, [[4, 5], [6, 7]])])
    finish(worker, "r2")
    assert same_blocks(caches, [4, 5, 6, 7], [0, 1, 2, 3]) and worker.take_load_errors() == set()
    steps = [s for s, _, _ in log_]
    reads = [i for i, step in enumerate(steps) if step == "read"]
    assert len(reads) == 2 and reads[1] < steps.index("copied"), steps  # the 2nd read before the 1st copy ends
    assert [step for step in steps if step != "read"] == ["copy", "copied", "copy", "copied"], steps
    assert all(name.startswith("lmctl-read") for s, name, _ in log_ if s == "read")
    # a miss in the middle: the load ends there, the read ahead lands, both buffers go back
    missing = Namespace("m", FMT).chunk_keys(list(range(1000, 1000 + 3 * FMT.chunk_size)))
    worker.load([LoadOp("r3", [keys[0], missing[1], keys[1]], [[8, 9], [10, 11], [12, 13]])])
    finish(worker, "r3")
    assert worker.take_load_errors() == {10, 11, 12, 13}
    assert same_blocks(caches, [8, 9], [0, 1])
    assert worker._load_pool.free() == worker._load_pool.count
    worker.read_ahead = False  # one buffer, one thread: the same result
    worker.load([LoadOp("r4", keys, [[8, 9], [10, 11]])])
    finish(worker, "r4")
    assert same_blocks(caches, [8, 9, 10, 11], [0, 1, 2, 3]) and worker.take_load_errors() == set()


def test_a_requests_chunks_are_read_together_and_a_miss_among_them_ends_the_load(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader reads a request's chunks in one ``get_many_into`` (whole records, several in
    flight); the chunks before a miss are loaded, the miss and every later chunk recomputed."""
    caches = kv_caches()
    worker.register_kv_caches(caches)
    keys = saved_chunks(worker, caches)
    calls: list[int] = []
    real = worker.store.get_many_into

    def spy(ks: Any, outs: Any, *a: Any, **kw: Any) -> Any:
        calls.append(len(ks))
        return real(ks, outs, *a, **kw)

    monkeypatch.setattr(worker.store, "get_many_into", spy)
    worker.load([LoadOp("r2", keys, [[4, 5], [6, 7]])])
    finish(worker, "r2")
    assert calls == [2] and same_blocks(caches, [4, 5, 6, 7], [0, 1, 2, 3])
    worker.store.evict([keys[1]])  # gone between the lookup and the load: the second of the two
    worker.load([LoadOp("r3", keys, [[8, 9], [10, 11]])])
    finish(worker, "r3")
    assert calls == [2, 2] and worker.take_load_errors() == {10, 11}
    assert same_blocks(caches, [8, 9], [0, 1])
    assert worker.loaded_chunks == 3 and worker.failed_loads == 1


@pytest.mark.parametrize("fault", ["store read", "copy into the engine's blocks"])
def test_a_failed_load_is_logged_with_its_traceback_and_reported_not_raised(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        fault: str) -> None:
    caches = kv_caches()
    worker.register_kv_caches(caches)
    keys = saved_chunks(worker, caches)
    calls = []

    def fail_on_the_second_chunk(real: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            calls.append(args)
            if len(calls) == 2:
                raise OSError("injected fault")
            return real(*args, **kw)
        return call

    if fault == "store read":  # a read of one chunk at a time, so that the second read is the second chunk's
        worker._window = 1
        monkeypatch.setattr(worker.store, "get_many_into", fail_on_the_second_chunk(worker.store.get_many_into))
    else:
        assert worker._paged is not None
        monkeypatch.setattr(worker._paged, "scatter", fail_on_the_second_chunk(worker._paged.scatter))

    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        worker.load([LoadOp("r2", keys, [[4, 5], [6, 7]])])  # must not raise into the step loop
        assert worker.wait_loads(30)
        assert worker.take_load_errors() == set()  # not before the request is reported finished
        assert worker.take_finished() == {"r2"}

    failed = [r for r in caplog.records if r.exc_info is not None]
    assert len(failed) == 1 and "request r2: loading chunk" in failed[0].getMessage()
    assert "Traceback (most recent call last)" in caplog.text and "OSError: injected fault" in caplog.text
    assert "chunk 2 of 2 could not be loaded" in caplog.text
    # chunk 1 was loaded; chunk 2's blocks go back to vLLM, which recomputes them
    assert worker.take_load_errors() == {6, 7}
    assert worker.take_load_errors() == set()  # reported once
    assert worker.loaded_chunks == 1 and worker.failed_loads == 1
    assert same_blocks(caches, [4, 5], [0, 1])
    # the staging buffer went back: the next load works
    monkeypatch.undo()
    worker.load([LoadOp("r3", keys, [[8, 9], [10, 11]])])
    finish(worker, "r3")
    assert same_blocks(caches, [8, 9, 10, 11], [0, 1, 2, 3]) and worker.take_load_errors() == set()


def test_loads_run_beside_the_step_loop_and_never_wait_for_saves(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """load() returns at once; the request is reported finished only when its chunks are
    in its blocks. Meanwhile saves go on (their buffers are not the loader's), and the
    load's figures reach the scheduler side through the load report."""
    caches = kv_caches()
    worker.register_kv_caches(caches)
    keys = saved_chunks(worker, caches)
    gate = hold_store_reads(worker, monkeypatch)
    t0 = time.monotonic()
    worker.load([LoadOp("r2", keys, [[4, 5], [6, 7]])])
    assert time.monotonic() - t0 < 1.0
    assert worker.take_finished() == set()
    other = Namespace("m", FMT, cache_salt="other").chunk_keys(PROMPT)
    worker.save([SaveOp("r3", other[0], [0, 1]), SaveOp("r3", other[1], [2, 3])])
    assert worker.flush(30) and worker.stats()["writer"]["saved"] == 4
    assert worker.take_finished() == set() and not same_blocks(caches, [4, 5, 6, 7], [0, 1, 2, 3])
    gate.set()
    finish(worker, "r2")
    assert same_blocks(caches, [4, 5, 6, 7], [0, 1, 2, 3])
    report = worker.take_load_report()
    assert set(report) == {"nvme"} and report["nvme"][0] == 2 * FMT.chunk_bytes and report["nvme"][1] > 0
    assert worker.take_load_report() == {}


def test_a_failed_save_is_logged_with_its_traceback_and_dropped(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    worker.register_kv_caches(kv_caches())
    keys = Namespace("m", FMT).chunk_keys(PROMPT)
    assert worker._paged is not None
    real = worker._paged.gather

    def gather(blocks: list[int], out: torch.Tensor) -> None:
        if blocks == [0, 1]:
            raise RuntimeError("injected fault")
        real(blocks, out)

    monkeypatch.setattr(worker._paged, "gather", gather)
    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        worker.save([SaveOp("r1", keys[0], [0, 1]), SaveOp("r1", keys[1], [2, 3])])
    assert worker.flush(10)
    assert "RuntimeError: injected fault" in caplog.text and "Traceback" in caplog.text
    assert worker.store.locate(keys) == [None, "nvme"]  # the other chunk was saved


class _FailingStore:
    def save_many(self, items: list[Any]) -> list[str]:
        raise OSError("injected disk error")


def test_a_failed_write_is_logged_with_its_traceback_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    pool = StagingPool(4096, 2)
    writer = ChunkWriter(_FailingStore(), pool)  # type: ignore[arg-type]
    buf = pool.acquire()
    assert buf is not None
    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        writer.submit(b"k" * 48, buf, {"dtype": "uint8", "shape": [4096]}, 1)
        assert writer.flush(10)
    writer.close()
    assert writer.stats.failed == 1 and writer.stats.saved == 0
    assert "OSError: injected disk error" in caplog.text and "Traceback" in caplog.text
    assert pool.acquire() is not None and pool.acquire() is not None  # its buffer came back


def test_the_scheduler_side_imports_neither_torch_nor_vllm() -> None:
    code = ("import sys, engine_hook.scheduler, engine_hook.context, engine_hook.namespaces, engine_hook.ops; "
            "print(sorted({'torch', 'vllm'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_path(), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# -- the facade: one side per role -------------------------------------------------------------
def fake_vllm(store: Path) -> tuple[Any, Any]:
    """What LMCtlConnector reads from vLLM's config, as plain objects (and vLLM's real KV spec)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=FMT.num_kv_heads, head_size=FMT.head_dim,
                             dtype=torch.float32)
    ktc = SimpleNamespace(kv_connector_extra_config={"store_path": str(store), **EXTRA},
                          kv_load_failure_policy="fail")
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc, model_config=SimpleNamespace(served_model_name="m", model="m", tokenizer="m"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), cache_config=SimpleNamespace(cache_dtype="auto"))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=LAYERS)])
    return vllm_config, kv_cache_config


def request(req_id: str) -> Any:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=PROMPT, lora_request=None, cache_salt=None)


def step(req_id: str, block_ids: list[int], computed: int, scheduled: int) -> Any:
    """A scheduler output with one new request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=computed)],
        num_scheduled_tokens={req_id: scheduled}, total_num_scheduled_tokens=scheduled,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                              num_computed_tokens=[]),
        finished_req_ids=set())


def empty_step() -> Any:
    """A scheduler output that schedules nothing (every request waits)."""
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                 num_computed_tokens=[]),
                           finished_req_ids=set())


def test_each_role_builds_only_its_side_and_the_metadata_carries_the_plan(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_hook.scheduler import LMCtlConnectorScheduler
    from engine_hook.vllm import LMCtlConnector, LMCtlMetadata, live_connectors

    vllm_config, kv_cache_config = fake_vllm(tmp_path / "store")
    sched = LMCtlConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)  # type: ignore[arg-type]
    work = LMCtlConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)  # type: ignore[arg-type]
    try:
        assert isinstance(sched.connector_scheduler, LMCtlConnectorScheduler) and sched.connector_worker is None
        assert isinstance(work.connector_worker, LMCtlConnectorWorker) and work.connector_scheduler is None
        assert sched.store is work.store  # one store per folder per process
        assert {sched, work} <= set(live_connectors())
        assert vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"  # a failed load is a miss
        assert len(sched.store.namespaces()) == 1  # the base model's namespace, recorded at start
        caches = kv_caches()
        work.register_kv_caches(caches)

        # first request: a miss; its two full chunks are saved from blocks 0-3, and its
        # 16-token tail (one whole block) from block 4, as a record of 16 tokens
        assert sched.get_num_new_matched_tokens(request("r1"), 0) == (0, False)
        sched.update_state_after_alloc(request("r1"), None, 0)  # type: ignore[arg-type]
        meta = sched.build_connector_meta(step("r1", [0, 1, 2, 3, 4], 0, 80))  # type: ignore[arg-type]
        assert isinstance(meta, LMCtlMetadata) and meta.loads == []
        assert [(op.blocks, op.tokens) for op in meta.saves] == [([0, 1], None), ([2, 3], None), ([4], 16)]
        work.bind_connector_metadata(meta)
        work.start_load_kv(None)  # type: ignore[arg-type]
        work.wait_for_save()
        work.clear_connector_metadata()
        assert work.flush(10)

        # the same prompt again: both chunks come from the store, into blocks 5-8, while
        # the request waits (an asynchronous load); then it is scheduled with them computed
        assert sched.get_num_new_matched_tokens(request("r2"), 0) == (64, True)
        blocks = SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8, 9],))
        sched.update_state_after_alloc(request("r2"), blocks, 64)  # type: ignore[arg-type]
        meta = sched.build_connector_meta(empty_step())  # type: ignore[arg-type]
        assert isinstance(meta, LMCtlMetadata) and meta.saves == []
        assert [(op.req_id, op.blocks) for op in meta.loads] == [("r2", [[5, 6], [7, 8]])] and meta.idle
        work.bind_connector_metadata(meta)
        work.start_load_kv(None)  # type: ignore[arg-type]
        work.wait_for_save()
        work.clear_connector_metadata()
        finished: set[str] = set()
        for _ in range(200):
            finished |= work.get_finished(set())[1] or set()
            if finished:
                break
            time.sleep(0.05)
        assert finished == {"r2"}
        assert same_blocks(caches, [5, 6, 7, 8], [0, 1, 2, 3])
        assert work.get_block_ids_with_load_errors() == set() == sched.get_block_ids_with_load_errors()
        report = work.build_connector_worker_meta()
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=report))  # type: ignore[arg-type]
        assert "nvme" in sched.stats()["load_gbps"]
        sched.update_state_after_alloc(request("r2"), blocks, 0)  # type: ignore[arg-type]  # after the load
        meta = sched.build_connector_meta(step("r2", [5, 6, 7, 8, 9], 64, 16))  # type: ignore[arg-type]
        assert isinstance(meta, LMCtlMetadata) and meta.loads == [] and meta.saves == []

        s, w = sched.stats(), work.stats()
        assert (s["lookups"], s["hit_tokens"], s["loaded_chunks"], "writer" in s) == (2, 64, 0, False)
        assert (w["lookups"], w["loaded_chunks"], w["failed_loads"], w["writer"]["saved"]) == (0, 2, 0, 3)
        assert sched.request_finished(request("r2"), []) == (False, None)
    finally:
        store = sched.store
        sched.shutdown()
        work.shutdown()
        work.shutdown()  # safe twice
    again = open_shared(tmp_path / "store")
    try:
        assert again is not store  # both sides let go: the last one closed it
    finally:
        release_shared(again)


@pytest.mark.gpu
def test_on_a_cuda_engine_loads_use_pinned_buffers_and_a_side_stream(worker: LMCtlConnectorWorker) -> None:
    """The same round trip as on the CPU, with the paged KV on a CUDA device: staging buffers
    are page-locked and loads copy on the loader's own stream."""
    caches = {n: t.cuda() for n, t in kv_caches().items()}
    worker.register_kv_caches(caches)
    assert worker._pool is not None and worker._pool.pinned and worker._load_pool is not None
    keys = saved_chunks(worker, caches)
    worker.load([LoadOp("r2", keys, [[4, 5], [6, 7]])])
    finish(worker, "r2")
    torch.cuda.synchronize()
    assert same_blocks(caches, [4, 5, 6, 7], [0, 1, 2, 3])
    assert worker.take_load_errors() == set()


def test_an_idle_step_waits_for_a_load_instead_of_spinning(
        worker: LMCtlConnectorWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every request waits for its load, vLLM's loop comes straight back to
    get_finished; spinning there held the GIL that the loader needs (loads ran about 30x
    slower on an idle engine). An idle step now waits for a load to finish (up to a bound)."""
    caches = kv_caches()
    worker.register_kv_caches(caches)
    keys = saved_chunks(worker, caches)
    gate = hold_store_reads(worker, monkeypatch)
    worker.load([LoadOp("r2", keys, [[4, 5], [6, 7]])])
    t0 = time.monotonic()
    assert worker.take_finished(0.05) == set()  # bounded: nothing finished within the wait
    assert 0.04 <= time.monotonic() - t0 < 5
    threading.Timer(0.1, gate.set).start()
    t0 = time.monotonic()
    assert worker.take_finished(10.0) == {"r2"}  # returns when the load finishes, not at the bound
    assert time.monotonic() - t0 < 5
    assert same_blocks(caches, [4, 5, 6, 7], [0, 1, 2, 3])


def _native_threads() -> set[int]:
    """This process's threads that Python did not start (an OpenMP team's are among them)."""
    ours = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - ours


def test_the_connectors_threads_never_start_an_openmp_team_of_their_own(tmp_path: Path) -> None:
    """A CPU engine's forward pass runs on an OpenMP team that spins between regions only
    while OpenMP manages no more threads than there are CPUs. A scatter on a loader thread
    used to give that thread a team of its own, for good: every later step of a 2-core
    engine ran 10-20% slower (issue 23's steady state). Chunks here are large enough that
    torch copies them in parallel when a thread lets it."""
    fmt = KVFormat("float32", num_layers=2, num_kv_heads=8, head_dim=64, chunk_size=256)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(fmt.num_layers)]
    block = 128
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "store"), "chunk_size": 256,
                                        "model_fingerprint": "off", "save_queue": 2})
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # what a 2-core engine runs with, whatever this machine has
    w = LMCtlConnectorWorker(ConnectorContext(settings, "m", fmt, layers, block, None, None, {"engine": "test"}))
    try:
        caches = {n: torch.randn(6, fmt.num_kv_heads, block, 2 * fmt.head_dim) for n in layers}
        w.register_kv_caches(caches)
        torch.zeros(1 << 22).add_(1)  # this thread's own team exists before the count
        before = _native_threads()
        keys = Namespace("m", fmt).chunk_keys(list(range(300, 556)))
        w.save([SaveOp("r1", keys[0], [0, 1])])
        assert w.flush(30) and w.stats()["writer"]["saved"] == 1
        w.load([LoadOp("r2", keys, [[2, 3]])])
        finish(w, "r2")
        assert same_blocks(caches, [2, 3], [0, 1])
        started = _native_threads() - before
        assert not started, f"the connector's threads started {len(started)} OpenMP thread(s)"
        # and the engine's own thread keeps its width
        assert torch.get_num_threads() == 2
    finally:
        w.close()
        torch.set_num_threads(before_threads)
