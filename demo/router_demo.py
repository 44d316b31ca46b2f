"""A router sees lmctl's tiers: a real vLLM engine (CPU, the tiny random-weight Llama and a LoRA
adapter) with the lmctl connector and vLLM's KV-events publisher on, Dynamo's KV indexer
subscribed to it, and the lmctl daemon on the same store.

It prints the indexer's answer for one prompt after the request saved it, after an engine
restart (a fresh indexer: what it knows comes from the re-announce), and after
``lmctl evict`` of the prompt's chunks; ``lmctl lookup --router`` and ``lmctl events --kind
announce`` on the way; then the event volume per saved 256-token chunk, measured on the wire.

    python demo/router_demo.py            # needs .venv-router (scripts/setup.sh makes it)
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import demo.engine  # noqa: E402, F401  (sets vLLM's environment first)
from demo.engine import Engine  # noqa: E402
from demo.models import make_lora, tiny_llama  # noqa: E402
from demo.router_index import Indexer  # noqa: E402
from testsupport.lmctl import Daemon  # noqa: E402
from testsupport.ports import free_port  # noqa: E402

BLOCK = 128
TOPIC = "kv@pod-1@tiny"


class Wire:
    """A ZMQ subscriber on the engine's publisher: frames and bytes per event type, every
    message decoded with vLLM's own classes."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(endpoint)
        self.dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.enc = msgspec.msgpack.Encoder()
        self.log: list[tuple[str, int]] = []  # (event type, its msgpack bytes)
        self.frames = 0
        self.frame_bytes = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import zmq

        while not self.stop.is_set():
            try:
                parts = self.sock.recv_multipart()
            except zmq.Again:
                continue
            batch = self.dec.decode(parts[2])
            with self.lock:
                self.frames += 1
                self.frame_bytes += sum(len(p) for p in parts)
                self.log.extend((type(e).__name__, len(self.enc.encode(e))) for e in batch.events)

    def mark(self) -> tuple[int, int, int]:
        with self.lock:
            return len(self.log), self.frames, self.frame_bytes

    def since(self, m: tuple[int, int, int]) -> tuple[dict[str, list[int]], int, int]:
        with self.lock:
            by: dict[str, list[int]] = {}
            for name, n in self.log[m[0]:]:
                by.setdefault(name, []).append(n)
            return by, self.frames - m[1], self.frame_bytes - m[2]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def show_query(idx: Indexer, tokens: list[int], lora: str) -> None:
    body = {"token_ids": f"<{len(tokens)} token ids>", "model_name": idx.model_name, "lora_name": lora}
    print(f"$ curl -s {idx.url}/query -d '{json.dumps(body)}'")
    print(json.dumps(idx.query(tokens, lora)))


def lmctl(sock: Path, *args: str) -> None:
    print("$ lmctl " + " ".join(shlex.quote(a) for a in args))
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(sock), *args], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "110"}, timeout=120)
    print((r.stdout + r.stderr).rstrip())


def main() -> None:
    from vllm.config import KVEventsConfig
    from vllm.lora.request import LoRARequest

    cache = Path(os.environ.get("LMCTL_TEST_MODELS", str(ROOT / ".cache" / "test-models")))
    base = tiny_llama(cache / "tiny-llama-v2")
    adapter = make_lora(base, cache / "lora-a", seed=1)
    work = Path(tempfile.mkdtemp(prefix="lmctl-router-demo-"))
    store, sock, port = work / "store", work / "lmctl.sock", free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic=TOPIC)
    wire = Wire(f"tcp://127.0.0.1:{port}")
    eng = Engine(base, store, connector={"load_policy": "always"}, kv_events_config=events)
    idx = Indexer(work, f"tcp://127.0.0.1:{port}", BLOCK, model_name="tiny")
    time.sleep(0.5)
    daemon = Daemon(store, sock, command=["serve", "--store", str(store), "--socket", str(sock)],
                    stderr=subprocess.DEVNULL)
    daemon.start(wait=False)
    ids = iter(range(1, 1000))
    doc = work / "contract.json"
    p = prompt(11, 600)
    doc.write_text(json.dumps(p))
    try:
        print(f"# engine: {base.name} + adapter 'a', store {store}, KV events on tcp://*:{port} topic {TOPIC}")
        print(f"# indexer: python -m dynamo.indexer --port {idx.port} --block-size {BLOCK} "
              f"--workers 1=tcp://127.0.0.1:{port} --model-name tiny")
        print("\n## 1. a request saves the prompt's two full chunks (600 tokens: 512 stored)")
        eng.generate(p, LoRARequest("a", next(ids), str(adapter)), 2)
        idx.wait_matched(p, 512, "a")
        show_query(idx, p, "a")
        show_query(idx, p, "b")
        time.sleep(1)
        lmctl(sock, "lookup", "--model", str(base), "--adapter", "a", "--tokens", str(doc), "--router", idx.url,
              "--router-model", "tiny")

        print("\n## 2. engine restart (its KV memory is empty) and a fresh indexer: the re-announce")
        eng.close()
        idx.stop()
        m = wire.mark()
        t0 = time.perf_counter()
        eng.start()
        idx = Indexer(work, f"tcp://127.0.0.1:{port}", BLOCK, model_name="tiny")
        time.sleep(0.5)
        end = time.monotonic() + 15
        while idx.matched(p, "a") != 512 and time.monotonic() < end:  # idle steps, as vllm serve makes
            eng.llm.llm_engine.step()  # them while the connector has something to announce
            time.sleep(0.1)
        print(f"# engine up and announced in {time.perf_counter() - t0:.1f} s")
        show_query(idx, p, "a")

        print("\n## 3. lmctl evict of the prompt's chunks (by the daemon, another process)")
        lmctl(sock, "evict", "--model", str(base), "--adapter", "a", "--tokens", str(doc))
        end = time.monotonic() + 15
        while idx.matched(p, "a") and time.monotonic() < end:  # idle steps, as vllm serve makes them
            eng.llm.llm_engine.step()
            time.sleep(0.1)
        show_query(idx, p, "a")
        from engine_hook.vllm import live_connectors

        for c in live_connectors():  # what was announced is written every few seconds: now
            if c.connector_scheduler is not None and c.connector_scheduler.announcer is not None:
                c.connector_scheduler.announcer.flush()
        lmctl(sock, "events", "--kind", "announce")
        re_by, _f, _b = wire.since(m)

        print("\n## 4. event volume per saved 256-token chunk (on the wire, vLLM's msgpack)")
        m = wire.mark()
        n_chunks = 0
        for i in range(8):
            q = prompt(100 + i, 1024 + 40)
            eng.generate(q, LoRARequest("a", next(ids), str(adapter)), 1)
            n_chunks += 4
        time.sleep(1)
        by, frames, frame_bytes = wire.since(m)
        stored = by.get("BlockStored", [])
        print(f"saved chunks: {n_chunks}; BlockStored events: {len(stored)} "
              f"({len(stored) / n_chunks:.2f} per chunk, 2 block hashes of {BLOCK} tokens each)")
        print(f"bytes per BlockStored event: {sum(stored) / max(1, len(stored)):.0f} (msgpack); frames: {frames}, "
              f"{frame_bytes / n_chunks:.0f} bytes per saved chunk on the wire incl. topic and sequence")
        removed = re_by.get("BlockRemoved", [])
        print(f"bytes per BlockRemoved event: {sum(removed) / max(1, len(removed)):.0f}; "
              f"re-announce: {len(re_by.get('BlockStored', []))} BlockStored for 2 chunks")
        kv = 4 * 2 * 2 * 64 * 256 * 4  # the tiny model's float32 KV of one chunk: 4 layers, K+V, 2 heads, dim 64
        print(f"for scale: one chunk's KV is {kv} bytes on this tiny model "
              f"(SmolLM2-135M bf16: {30 * 2 * 256 * 3 * 64 * 2} bytes)")
    finally:
        daemon.stop()
        eng.close()
        idx.stop()
        wire.close()


if __name__ == "__main__":
    main()
