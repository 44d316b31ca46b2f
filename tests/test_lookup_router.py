"""``lmctl lookup --router URL``: a real router index (Dynamo's KV indexer, tests/router_index.py)
fed with vLLM KV events over ZMQ, asked through the CLI; and every way asking can fail is one
line and the exit code of the map. The connector's own events reach the same indexer in
tests/test_router_index.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from conftest import fake_engine
from redis_server import free_port
from test_daemon import TOKENS, Daemon, cj, cli, tokens_file

from demo.router_index import Indexer

if TYPE_CHECKING:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK = 16  # the test store's chunk size, and the "engine's" block size here


def publish(endpoint_port: int, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
    """Publish events as vLLM's ZMQ publisher does: (topic, 8-byte sequence, msgpack batch)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    sock.bind(f"tcp://127.0.0.1:{endpoint_port}")
    try:
        time.sleep(1.0)  # the indexer's subscription arrives
        payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
        sock.send_multipart([b"kv@pod-1@m", (0).to_bytes(8, "big"), payload])
        time.sleep(0.2)
    finally:
        sock.close(linger=1000)


def test_lookup_shows_what_each_instance_holds_per_the_router(daemon: Daemon, tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockStored

    port = free_port()
    idx = Indexer(tmp_path / "router", f"tcp://127.0.0.1:{port}", BLOCK, model_name="m", worker_id=7)
    try:
        # worker 7 holds TOKENS' first two blocks: the first in CPU memory, the second on disk
        publish(port, [
            BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=TOKENS[:16], block_size=BLOCK,
                        lora_id=None, medium="CPU", lora_name=None, locality="LOCAL"),
            BlockStored(block_hashes=[12], parent_block_hash=11, token_ids=TOKENS[16:32], block_size=BLOCK,
                        lora_id=None, medium="STORAGE", lora_name=None, locality="LOCAL")])
        assert idx.wait_matched(TOKENS, 32) == 32
        doc = tokens_file(tmp_path, TOKENS)
        r = cj(daemon, "lookup", "--model", "m", "--tokens", doc, "--router", idx.url)
        assert r["hit_tokens"] == 64  # this store's own answer is still there
        assert "token_ids" not in r
        assert r["router"]["model_name"] == "m" and r["router"]["lora_name"] is None
        got = r["router"]["instances"]["7"]
        assert got["longest_matched"] == 32 and got["gpu"] == 0 and got["cpu"] == 16 and got["disk"] == 32
        shown = cli(daemon, "lookup", "--model", "m", "--tokens", doc, "--router", idx.url + "/query")
        assert shown.returncode == 0, shown.stderr
        assert "1 instance(s) hold some of it" in shown.stdout
        rows = [line.replace("│", " ").split() for line in shown.stdout.splitlines()]
        assert ["7", "32", "50%", "0", "16", "32"] in rows
        # another model name: the router knows none
        x = cli(daemon, "lookup", "--model", "m", "--tokens", doc, "--router", idx.url, "--router-model", "x")
        assert x.returncode == 1 and "knows no model 'x'" in x.stderr and len(x.stderr.strip().splitlines()) == 1
    finally:
        idx.stop()


def test_asking_a_router_fails_in_one_line(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    cases = [
        (["--router", "ftp://host/x"], 2, "--router must be the router index's http(s) URL"),
        (["--router", "http://127.0.0.1:99999"], 2, "the port is not a number"),
        (["--router-model", "m"], 2, "--router-model needs --router URL"),
        (["--router", f"http://127.0.0.1:{free_port()}"], 1, "cannot be reached"),
    ]
    for extra, code, words in cases:
        r = cli(daemon, "lookup", "--model", "m", "--tokens", doc, *extra)
        assert r.returncode == code and words in r.stderr, (extra, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    with fake_engine() as (url, seen):  # an HTTP server that is no KV indexer: answers {}
        r = cli(daemon, "lookup", "--model", "m", "--tokens", doc, "--router", url)
        assert r.returncode == 1 and "without 'instances'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert seen and seen[0][0] == "/query" and seen[0][1] == {"token_ids": TOKENS, "model_name": "m"}
    # chunks by key make no document: there are no tokens to ask by
    key = cj(daemon, "lookup", "--model", "m", "--tokens", doc)["chunks"][0]["key"]
    r = cli(daemon, "lookup", "--key", key, "--router", "http://127.0.0.1:1")
    assert r.returncode == 2 and "needs a document" in r.stderr
    assert json.loads(cli(daemon, "--json", "lookup", "--model", "m", "--tokens", doc).stdout)["hit_tokens"] == 64
