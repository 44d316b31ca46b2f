"""Why did this miss? Every reason ``lmctl lookup --explain`` gives, each from a real scenario.

    .venv/bin/python demo/explain_tour.py [--keep DIR]

Seconds to a minute on any machine: no model download, no GPU, no vLLM. In a temporary
folder it starts ``lmctl serve`` on a new store, then plays engines through the
engine-agnostic API (``engine_hook.KVCacheClient``, which keys chunks and records prefix ids
the way the vLLM connector does) on small made-up checkpoints and adapters, and asks the
real CLI why documents miss, after:

* nothing was ever saved (never-stored);
* a burst of traffic filled the tier (evicted, lru);
* the document was served for another model id, for an adapter, for the previous weights
  of the same adapter, under another tenant's cache salt, by the previous checkpoint, by a
  deployment with another tensor-parallel size (other-model, other-adapter,
  other-adapter-version, other-salt, other-model-fingerprint, other-kv-format);
* a byte of a segment file flipped on disk, found by the engine's next load (corrupt);
* the engine's writer could not keep up (save-dropped, queue-full; the slow disk is
  simulated by holding the writer);
* the store's remote tier, a local ``redis-server`` (Debian's package), was stopped after
  the document was moved there (remote-unavailable).

It ends with ``lmctl events --since 1h``. The transcript shows the CLI's real output, the
chunk tables left out. Everything it starts is stopped, and the folder removed (unless
``--keep``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine_hook import KVCacheClient  # noqa: E402
from store import KVFormat  # noqa: E402
from testsupport.lmctl import Daemon  # noqa: E402
from testsupport.redis import Server  # noqa: E402

#: the KV format of the made-up model "smol": 2 layers, 4 KV heads of 64, fp16, 64-token chunks (128 KiB)
FMT = KVFormat("float16", num_layers=2, num_kv_heads=4, head_dim=64, chunk_size=64)
CS = FMT.chunk_size
#: the same model on two GPUs: each tensor-parallel rank holds two of the four KV heads
TP2 = [KVFormat("float16", num_layers=2, num_kv_heads=2, head_dim=64, tp_size=2, tp_rank=r, chunk_size=64)
       for r in range(2)]
CAPACITY = "64MiB"
#: prompts of 8 chunks that, after the handbook's 4, overflow the tier (a chunk takes its
#: bytes and a 4 KiB trailer on disk) once: eviction then leaves room for the rest of the tour
BURST = math.ceil((64 * 2**20 // (FMT.chunk_bytes + 4096) - 4) / 8) + 1


# -- the made-up world: checkpoints, adapters, documents --------------------------------------
def safetensors_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A minimal safetensors file (header length, JSON header, raw little-endian data)."""
    header: dict[str, Any] = {}
    blobs = []
    off = 0
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F16", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def checkpoint(folder: Path, seed: int) -> Path:
    """A tiny checkpoint folder: config.json and one safetensors file (weights from ``seed``)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                    "num_key_value_heads": 4, "head_dim": 64}))
    g = torch.Generator().manual_seed(seed)
    safetensors_file(folder / "model.safetensors",
                     {f"layers.{i}.w": torch.randn(64, 64, generator=g).half() for i in range(2)})
    return folder


def adapter(folder: Path, seed: int) -> Path:
    """A LoRA adapter folder (config and weights from ``seed``); written again: retrained."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    g = torch.Generator().manual_seed(seed)
    safetensors_file(folder / "adapter_model.safetensors", {"lora_A": torch.randn(8, 64, generator=g).half()})
    return folder


def document(work: Path, name: str, first: int, chunks: int) -> tuple[str, list[int]]:
    """A document of ``chunks`` full chunks of token ids (unlike any other document's),
    written as ``docs/NAME.json`` for ``lmctl ... --tokens``."""
    toks = list(range(first, first + chunks * CS))
    rel = f"docs/{name}.json"
    (work / rel).parent.mkdir(exist_ok=True)
    (work / rel).write_text(json.dumps(toks))
    return rel, toks


def kv(tokens: list[int], fmt: KVFormat = FMT) -> torch.Tensor:
    """The KV an engine would have computed for ``tokens`` (random here)."""
    return torch.randn(fmt.num_layers, 2, len(tokens), fmt.num_kv_heads, fmt.head_dim).half()


def serve(client: KVCacheClient, tokens: list[int], **kw: Any) -> int:
    """An engine serves a prompt: saves its chunks, waits until they are on disk."""
    n = client.save(tokens, kv(tokens, client.kv_format), **kw)
    assert client.flush(60), "the engine's writer did not finish"
    return n


# -- processes: the daemon, redis-server, the CLI ---------------------------------------------
class Demo:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p), LMCTL_STORE="cache",
            NO_COLOR="1")
        self.env.pop("LMCTL_SOCKET", None)
        self.daemon: Daemon | None = None
        self.redis: Server | None = None
        self.redis_port = 0

    def say(self, text: str) -> None:
        print(f"\n# {text}", flush=True)

    def lmctl(self, *args: str, keep: str = "all") -> str:
        """Run ``lmctl ARGS`` in the work folder and print it as a terminal would
        (``keep``: "all", "summary" for a lookup without its chunk table, "last" for the
        last line only)."""
        here = str(self.work) + os.sep  # shown as ./ : the commands run in the work folder
        print(f"$ lmctl {shlex.join(args).replace(here, './')}", flush=True)
        res = subprocess.run([sys.executable, "-m", "lmctl.cli", *args], cwd=self.work, env=self.env,
                             capture_output=True, text=True, timeout=120)
        out = (res.stdout + res.stderr).replace(here, "./")
        lines = out.splitlines()
        if keep == "summary" and not res.returncode:  # a lookup: its two first lines and its why
            head = lines[:2]
            tail = [ln for ln in lines if ln.startswith(("why:", "nothing misses"))]
            out = "\n".join([*head, "  ... (chunk table left out)", *tail]) + "\n"
        elif keep == "last" and not res.returncode:  # config set: what changed, not every setting
            out = "  ... (settings table left out)\n" + lines[-1] + "\n"
        sys.stdout.write(out)
        if res.returncode:
            print(f"(exit {res.returncode})")
        sys.stdout.flush()
        if res.returncode:
            raise SystemExit(f"lmctl {shlex.join(args)} failed")
        return out

    def start_daemon(self) -> None:
        args = ["serve", "--init", "--store", "cache", "--capacity", CAPACITY]
        print(f"$ lmctl {shlex.join(args)} &", flush=True)
        with open(self.work / "daemon.log", "ab") as log:
            self.daemon = Daemon(self.work / "cache", command=args, env=self.env, stderr=log, cwd=self.work)
            try:
                self.daemon.start(timeout=60)
            except AssertionError:
                raise SystemExit("lmctl serve did not start:\n" + (self.work / "daemon.log").read_text()) from None

    def start_redis(self) -> str:
        self.redis = Server(self.work / "redis")  # persistence off, on a free loopback port
        self.redis.wait(self.redis.client)
        self.redis_port = self.redis.port
        return self.redis.url

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.stop()

    def close(self) -> None:
        if self.daemon is not None and self.daemon.proc is not None:
            self.daemon.stop()
        self.stop_redis()


class SlowDisk:
    """The store as an engine's writer sees it, with writes held until ``release`` (a disk
    that does not keep up with the engine)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._gate = threading.Event()

    def put_many(self, *a: Any, **kw: Any) -> Any:
        self._gate.wait(60)
        return self._store.put_many(*a, **kw)

    def release(self) -> None:
        self._gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def flip_byte(store: Any, key: bytes) -> str:
    """Flip one byte in the middle of a stored chunk's payload, in its segment file; the
    file's path relative to the store."""
    info = store.info(key)
    assert info is not None
    rel = f"{info.tier}/seg-{info.segment:012d}.lseg"
    with open(Path(store.path) / rel, "r+b") as f:
        f.seek(info.offset + info.stored_bytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    return rel


# -- the tour ---------------------------------------------------------------------------------
def tour(d: Demo) -> None:
    work = d.work
    v1 = checkpoint(work / "checkpoints/smol-v1", seed=1)
    v2 = checkpoint(work / "checkpoints/smol-v2", seed=2)
    civil = adapter(work / "adapters/civil", seed=3)

    d.say(f"a new store, capacity {CAPACITY}, and its daemon")
    d.start_daemon()

    d.say("an engine serves model smol from checkpoints/smol-v2 (fingerprinted from its files); "
          "it has saved nothing yet")
    engine = KVCacheClient(work / "cache", "smol", FMT, model_path=v2)
    clients = [engine]
    try:
        report, report_toks = document(work, "report", 1_000_000, 2)
        engine.lookup(report_toks)  # the engine looks the prompt up: a miss
        d.lmctl("lookup", "--model", "smol", "--tokens", report, "--explain", keep="summary")

        d.say(f"the engine serves the handbook, then a burst of {BURST} other prompts fills the tier")
        handbook, handbook_toks = document(work, "handbook", 2_000_000, 4)
        serve(engine, handbook_toks)
        for i in range(BURST):
            serve(engine, document(work, f"burst-{i:02d}", 3_000_000 + 10_000 * i, 8)[1])
        d.lmctl("lookup", "--model", "smol", "--tokens", handbook, "--explain", keep="summary")

        d.say("an engine still on the previous checkpoint (checkpoints/smol-v1) serves the contract; "
              "a tensor-parallel deployment of smol-v2 (TP=2: two ranks, two KV heads each) serves the manual; "
              "a sibling model, smol-instruct, starts on the same store")
        old = KVCacheClient(work / "cache", "smol", FMT, model_path=v1)
        clients.append(old)
        contract, contract_toks = document(work, "contract", 4_000_000, 2)
        serve(old, contract_toks)
        manual, manual_toks = document(work, "manual", 5_000_000, 2)
        for fmt in TP2:  # each rank's worker saves its half of the heads
            rank = KVCacheClient(work / "cache", "smol", fmt, model_path=v2)
            clients.append(rank)
            serve(rank, manual_toks)
        sibling = KVCacheClient(work / "cache", "smol-instruct", FMT, model_fingerprint="off")
        clients.append(sibling)
        sibling.lookup(document(work, "hello", 6_000_000, 1)[1])

        # the smol-v2 engine records its namespaces (adapter, salt) after those: lmctl then
        # takes smol-v2 on one GPU as the way smol is served now (the newest recorded)
        d.say("the smol-v2 engine serves a lease with adapter civil (adapters/civil), the FAQ for "
              "tenant-a (cache salt), and the minutes")
        civil_id = engine.adapter("civil", civil)
        lease, lease_toks = document(work, "lease", 7_000_000, 3)
        serve(engine, lease_toks, adapter=civil_id)
        faq, faq_toks = document(work, "faq", 8_000_000, 2)
        serve(engine, faq_toks, cache_salt="tenant-a")
        minutes, minutes_toks = document(work, "minutes", 9_000_000, 2)
        serve(engine, minutes_toks)

        d.say("asked for the base model, the lease misses")
        d.lmctl("lookup", "--model", "smol", "--base", "--tokens", lease, "--explain", keep="summary")
        d.say("adapters/civil is retrained in place; asked with the new weights, the lease misses")
        adapter(civil, seed=4)
        d.lmctl("lookup", "--model", "smol", "--adapter", "adapters/civil", "--tokens", lease, "--explain",
                keep="summary")
        d.say("tenant-b asks for the FAQ")
        d.lmctl("lookup", "--model", "smol", "--cache-salt", "tenant-b", "--tokens", faq, "--explain",
                keep="summary")
        d.say("smol-instruct asks for the minutes")
        d.lmctl("lookup", "--model", "smol-instruct", "--tokens", minutes, "--explain", keep="summary")
        d.say("smol, as served now (smol-v2), asks for the contract")
        d.lmctl("lookup", "--model", "smol", "--tokens", contract, "--explain", keep="summary")
        d.say("smol, as served now (one GPU), asks for the manual")
        d.lmctl("lookup", "--model", "smol", "--tokens", manual, "--explain", keep="summary")

        d.say("the engine serves the invoice; then one byte of its second chunk flips on disk")
        invoice, invoice_toks = document(work, "invoice", 10_000_000, 3)
        serve(engine, invoice_toks)
        seg = flip_byte(engine.store, engine.namespace().chunk_keys(invoice_toks)[1])
        print(f"(flipped one byte of cache/{seg})")
        loaded = engine.load(invoice_toks)
        print(f"(the engine's next load of the invoice reads {loaded.tokens} of {len(invoice_toks)} tokens: "
              "the second chunk fails its checksum)")
        d.lmctl("lookup", "--model", "smol", "--tokens", invoice, "--explain", keep="summary")

        d.say("an engine whose disk does not keep up (its writer is held) serves the memo: "
              "one chunk being written, one queued, the rest dropped")
        slow = KVCacheClient(work / "cache", "smol", FMT, model_path=v2, save_buffers=1)
        clients.append(slow)
        disk = SlowDisk(slow.store)
        slow.writer.store = disk  # type: ignore[assignment]
        memo, memo_toks = document(work, "memo", 11_000_000, 4)
        queued = slow.save(memo_toks, kv(memo_toks))
        disk.release()
        assert slow.flush(60)
        print(f"(the engine queued {queued} of {len(memo_toks) // CS} chunks)")
        d.lmctl("lookup", "--model", "smol", "--tokens", memo, "--explain", keep="summary")

        d.say("the store gets a remote tier (a redis-server); the minutes are moved there")
        url = d.start_redis()
        print(f"$ redis-server --port {d.redis_port} --save '' --appendonly no &")
        d.lmctl("remote", "secret", "remote.secret")
        # settings that name a file take an absolute path (shown relative to the work folder)
        d.lmctl("config", "set", f"remote.url={url}", f"remote.secret_file={d.work / 'remote.secret'}", keep="last")
        d.lmctl("move", "--to", "remote", "--model", "smol", "--tokens", minutes)
        d.lmctl("lookup", "--model", "smol", "--tokens", minutes, keep="summary")
        d.say("the redis-server stops")
        d.stop_redis()
        d.lmctl("lookup", "--model", "smol", "--tokens", minutes, "--explain", keep="summary")

        d.say("what the event log says")
        d.lmctl("events", "--since", "1h")
    finally:
        for c in clients:
            c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", help="work in this folder (created; kept afterwards)")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("the tour needs redis-server for the remote tier (Debian: apt-get install redis-server)")
    logging.basicConfig(format="(engine log: %(message)s)", level=logging.WARNING)
    if args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="lmctl-explain-"))
    d = Demo(work)
    t0 = time.monotonic()
    try:
        tour(d)
    finally:
        d.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n# done in {time.monotonic() - t0:.0f} s; daemon and redis-server stopped"
          + ("" if args.keep else ", work folder removed"))


if __name__ == "__main__":
    main()
