"""``lmctl drain`` next to the remote tier's bare puts of the same bytes, in one run.

    .venv/bin/python benchmarks/drain.py [--rounds 5] [--total-mib 512] [--json]

The benchmark starts its own ``redis-server`` on a free loopback port (persistence off,
``noeviction`` with room for two copies of a round: see remote_io.py's ``Server``) and a store
in a temporary folder whose nvme tier holds --total-mib of SmolLM2-135M chunks (5.6 MiB raw, 256
tokens of bf16 drawn like real activations, as in store_io.py; stored with the store's default
codec) with a deployment secret, as a host of a deployment has. Each round, in alternating
order:

  put    ``RemoteTier.put`` of every chunk's stored bytes, read from the store beforehand (not
         timed): the client library, the MAC and the server on this machine, the limit drain
         can reach
  drain  the daemon's ``drain`` operation (``lmctl/ops/drain.py``, as ``lmctl drain`` runs it, less
         the socket) over the whole store: order the chunks, then for each read its stored
         bytes from the nvme tier, verify them, put them, log an event every 64 chunks; the
         next chunk is read while one is put
  serial ``Store.copy_to_remote`` of every chunk, one after the other (read, verify, put):
         drain's path without the read-ahead

and the server is emptied (FLUSHDB, not timed) after each. The ratio drain / put is taken
within each round (and drain / serial: what the read-ahead gains); the report gives medians
and ranges over the rounds, and GB/s of stored
bytes (what crosses the network) and of raw bytes (what the replacement does not recompute).
The local segment files are in the page cache (they were just written): the figures are the
cost of drain's own path, not of the disk. Drain reads the next chunk while it puts one, so
at best it matches the bare puts; client, reader and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from remote_io import Server  # noqa: E402
from store_io import SHAPES, chunk_bytes, fill_bf16  # noqa: E402

from lmctl.ops import Job, op_drain  # noqa: E402
from store import GiB, KVFormat, Namespace, PutItem, Store, StoreConfig, TierConfig  # noqa: E402
from store.config import RemoteConfig  # noqa: E402
from store.format.codec import CODEC_NAMES  # noqa: E402
from store.tiers.remote import RemoteMeta  # noqa: E402

MiB = 1 << 20


class Quiet(Job):
    """A job nobody watches: drain's streamed manifest entries go nowhere."""

    def emit(self, rows: list[dict[str, Any]], into: str = "chunks") -> None:
        return


def build(folder: Path, url: str, total: int) -> tuple[Store, list[bytes], int]:
    """A store holding ``total`` bytes of SmolLM2 chunks; its keys and raw bytes."""
    layers, heads, dim = SHAPES["smollm2_bf16"]
    size = chunk_bytes(layers, heads, dim)
    fmt = KVFormat("bfloat16", num_layers=layers, num_kv_heads=heads, head_dim=dim, chunk_size=256)
    ns = Namespace("smollm2", fmt)
    secret = folder / "remote.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=8 * GiB)},
                      remote=RemoteConfig(url, key_prefix="bench", secret_file=str(secret), write="evict"))
    store = Store(folder / "store", cfg)
    store.register_namespace(ns, {"model_id": "smollm2", "tokenizer": None})
    layout = {"dtype": "bfloat16", "shape": list(fmt.chunk_shape)}
    buf = mmap.mmap(-1, size)
    keys = []
    for i in range(max(1, total // size)):
        fill_bf16(buf, size, seed=i)
        k = ns.chunk_keys(list(range(256 * i, 256 * (i + 1))))[0]
        assert store.put_many([PutItem(k, memoryview(buf), layout, 256)]) == [True]
        keys.append(k)
    store.flush()
    return store, keys, size


def bare_puts(store: Store, keys: list[bytes]) -> tuple[float, int]:
    """Seconds to put every chunk's stored bytes (read beforehand) through the store's own
    RemoteTier, and the bytes put."""
    sharing = store._sharing
    assert sharing is not None
    todo = []
    for k in keys:
        got = store.read_stored(k)
        assert not isinstance(got, str)
        e, data = got
        todo.append((k, data, RemoteMeta(raw_len=e.raw_len, codec=CODEC_NAMES[e.codec], level=e.level,
                                         layout=e.layout, tokens=e.tokens, checksum=e.checksum)))
    t0 = time.perf_counter()
    for k, data, meta in todo:
        assert sharing.tier.put(k, data, meta)
    return time.perf_counter() - t0, sum(len(d) for _k, d, _m in todo)


def serial(store: Store, keys: list[bytes]) -> float:
    t0 = time.perf_counter()
    for k in keys:
        assert store.copy_to_remote(k)[0] == "copied"
    return time.perf_counter() - t0


def drained(store: Store) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    r = op_drain(store, {}, Quiet())
    took = time.perf_counter() - t0
    assert r["left"]["chunks"] == 0, r["left"]
    return took, r["went"]["bytes"], r["went"]["chunks"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--json", action="store_true", help="print every figure as JSON")
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    a = ap.parse_args()
    total = a.total_mib * MiB
    with tempfile.TemporaryDirectory(prefix="lmctl-drain-bench-") as tmp:
        folder = Path(tmp)
        server = Server(a.redis_server, folder, 4 * total)
        try:
            store, keys, size = build(folder, server.url, total)
            raw = size * len(keys)
            rounds = []
            try:
                for r in range(a.rounds):
                    row: dict[str, Any] = {}
                    sides = ["put", "drain", "serial"]
                    for side in sides[r % 3:] + sides[:r % 3]:  # the order rotates with the round
                        if side == "put":
                            row["put_s"], row["stored_bytes"] = bare_puts(store, keys)
                        elif side == "serial":
                            row["serial_s"] = serial(store, keys)
                        else:
                            row["drain_s"], row["drain_bytes"], row["chunks"] = drained(store)
                        server.client().flushdb()
                    row["ratio"] = row["put_s"] / row["drain_s"]
                    row["read_ahead_gain"] = row["serial_s"] / row["drain_s"]
                    rounds.append(row)
            finally:
                store.close()
        finally:
            server.stop()
    ratios = [x["ratio"] for x in rounds]
    gains = [x["read_ahead_gain"] for x in rounds]
    stored = rounds[0]["stored_bytes"]
    out = {"chunks": len(keys), "raw_bytes": raw, "stored_bytes": stored, "rounds": rounds,
           "put_gbs": statistics.median(stored / x["put_s"] / 1e9 for x in rounds),
           "drain_gbs": statistics.median(stored / x["drain_s"] / 1e9 for x in rounds),
           "drain_raw_gbs": statistics.median(raw / x["drain_s"] / 1e9 for x in rounds),
           "serial_gbs": statistics.median(stored / x["serial_s"] / 1e9 for x in rounds),
           "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
           "read_ahead_gain": statistics.median(gains), "gain_range": [min(gains), max(gains)],
           "load": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{len(keys)} chunks of {size / MiB:.1f} MiB ({raw / MiB:.0f} MiB raw, {stored / MiB:.0f} MiB stored), "
          f"{a.rounds} rounds, load {out['load']:.1f}")
    print(f"bare puts   {out['put_gbs']:.2f} GB/s stored")
    print(f"drain       {out['drain_gbs']:.2f} GB/s stored, {out['drain_raw_gbs']:.2f} GB/s raw")
    lo, hi = out["ratio_range"]
    print(f"serial      {out['serial_gbs']:.2f} GB/s stored (read, verify, put one after the other)")
    print(f"drain / bare puts: {out['ratio']:.2f} [{lo:.2f}-{hi:.2f}] (median [range] over rounds)")
    lo, hi = out["gain_range"]
    print(f"drain / serial:    {out['read_ahead_gain']:.2f} [{lo:.2f}-{hi:.2f}] (the read-ahead's gain)")


if __name__ == "__main__":
    main()
