"""An attacker on the shared Redis tier, against two stores of one deployment.

    .venv/bin/python demo/trust_demo.py

Starts its own ``redis-server`` on a free loopback port and two stores (``host-a`` and
``host-b`` in a temporary folder) that share it under one deployment secret. A plain redis-py
client with full access to the prefix, but not the secret, then:

1. rewrites a chunk's pieces under the head its writer made;
2. writes a whole value of the format at the chunk's name with every xxh3 checksum valid;
3. swaps the values of two chunks;
4. (standing in for a trusted writer's bug) a head with a valid MAC that claims a chunk of
   16 GiB.

After each, host B reads the chunk: every attack is a miss, counted (``forged`` or
``foreign``), the attacked value is dropped from the server, nothing is promoted, and the
16 GiB claim allocates nothing (the peak of Python's allocations during the reads is printed).
"""

from __future__ import annotations

import logging
import resource
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import redis
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import MiB, Namespace, Store, StoreConfig  # noqa: E402
from store.config import RemoteConfig, TierConfig  # noqa: E402
from store.format.keys import KVFormat  # noqa: E402
from store.format.remote_auth import MODE_MAC, MODE_PLAIN, Keys, new_nonce  # noqa: E402
from store.format.remote_value import MAX_STORED, RemoteMeta, pack_meta  # noqa: E402
from testsupport.redis import Server, secret_file  # noqa: E402

FMT = KVFormat("bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, chunk_size=256)  # SmolLM2-135M's
LAYOUT = {"dtype": "bfloat16", "shape": list(FMT.chunk_shape)}
PREFIX = "demo"
NS = Namespace("public-model", FMT)  # unsalted: anyone can compute its chunk keys


def payload(key: bytes, n: int) -> bytes:
    seed = xxhash.xxh3_64_digest(key)
    return (seed * (n // len(seed) + 1))[:n]


def heads(r: redis.Redis) -> list[bytes]:
    return sorted(n for n in r.keys(f"{PREFIX}:*") if n.endswith(b":h"))


def pieces_of(r: redis.Redis, head: bytes) -> list[bytes]:
    return sorted((n for n in r.keys(head[:-2] + b":*") if not n.endswith(b":h")),
                  key=lambda n: int(n.rsplit(b":", 1)[1]))


def counters(s: Store) -> str:
    st = s.stats().remote or {}
    return ", ".join(f"{k} {st.get(k, 0)}" for k in ("hits", "forged", "foreign", "torn"))


def main() -> None:
    logging.disable(logging.WARNING)  # the store logs each forged value; the counters say it here
    work = Path(tempfile.mkdtemp(prefix="lmctl-trust-demo-"))
    n = FMT.chunk_bytes
    srv = Server(work / "redis")
    secret = str(secret_file(work))
    try:
        def host(name: str) -> Store:
            cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)},
                              remote=RemoteConfig(srv.url, key_prefix=PREFIX, write="always", secret_file=secret))
            return Store(work / name, cfg)

        a, b = host("host-a"), host("host-b")
        r = srv.client()
        k1, k2 = NS.chunk_keys(list(range(4 * 256)))[:2]
        print(f"two stores, one redis-server at {srv.url}, one deployment secret; chunks of {n / MiB:.2f} MiB")

        print("\n1. the attacker rewrites a chunk's pieces (all zeros) under the head its writer made")
        assert a.put(k1, payload(k1, n), LAYOUT, 256)
        for p in pieces_of(r, heads(r)[0]):
            r.set(p, bytes(len(r.get(p) or b"")))
        out = bytearray(n)
        print(f"   host B reads it: {'served' if b.get_into(k1, out) else 'miss'}; {counters(b)}; "
              f"keys left on the server: {r.dbsize()}")

        print("2. the attacker writes a whole value at the chunk's name, every xxh3 checksum valid")
        a.evict([k1])  # host A shares it again
        assert a.put(k1, payload(k1, n), LAYOUT, 256)
        [head] = heads(r)
        evil = bytes(n)
        meta = RemoteMeta(raw_len=n, layout=LAYOUT, tokens=256)
        body = pack_meta(meta, n, 4 << 20, time.time(), 0, xxhash.xxh3_64(evil).digest() + bytes(24))
        r.set(head, Keys.derive(None).seal_head(MODE_PLAIN, head.decode(), k1, new_nonce(), body))
        r.set(head[:-2] + b":0", evil)
        print(f"   host B reads it: {'served' if b.get_into(k1, out) else 'miss'}; {counters(b)}; "
              f"keys left on the server: {r.dbsize()}")

        print("3. the attacker swaps the values of two chunks (it cannot tell which name is which)")
        a.evict([k1])
        assert a.put(k1, payload(k1, n), LAYOUT, 256) and a.put(k2, payload(k2, n), LAYOUT, 256)
        h1, h2 = heads(r)
        v1 = [(x, r.get(x)) for x in [h1, *pieces_of(r, h1)]]
        v2 = [(x, r.get(x)) for x in [h2, *pieces_of(r, h2)]]
        for (n1, x1), (n2, x2) in zip(v1, v2, strict=True):
            r.set(n1, x2 or b"")
            r.set(n2, x1 or b"")
        got = [b.get(k) is not None for k in (k1, k2)]
        print(f"   host B reads both: {['served' if g else 'miss' for g in got]}; {counters(b)}; "
              f"keys left on the server: {r.dbsize()}")
        local = b.locate([k1, k2], remote=False)
        print(f"   promoted into host B's own tiers: {sum(x is not None for x in local)} of 2")

        print("4. a head with a valid MAC (a trusted writer's bug) claims a chunk of 16 GiB in 32 pieces of 512 MiB")
        a.evict([k1, k2])
        assert a.put(k1, payload(k1, n), LAYOUT, 256)
        [head] = heads(r)
        tier = a._sharing.tier if a._sharing is not None else None
        assert tier is not None
        keys = tier.keyring[0]  # a head with a valid MAC: a trusted writer's bug, the worst case
        size = MAX_STORED - 1
        body = pack_meta(RemoteMeta(raw_len=size, layout=LAYOUT, tokens=256), size, 512 * MiB, time.time(), 0,
                         bytes(32))
        r.set(head, keys.seal_head(MODE_MAC, head.decode(), k1, new_nonce(), body))
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        served = b.get_into(k1, out) is not None or b.get(k1) is not None
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"   host B reads it twice (get_into, get): {'served' if served else 'miss'}; {counters(b)}; "
              f"peak Python allocation {peak / 1024:.0f} KiB; max RSS grew {max(0, rss1 - rss0)} KiB")
        print("\nwhat was never attacked is still served:")
        k3 = NS.chunk_keys(list(range(4 * 256)))[2]
        assert a.put(k3, payload(k3, n), LAYOUT, 256)
        ok = b.get_into(k3, out) is not None and bytes(out) == payload(k3, n)
        print(f"   host B reads a fresh chunk: {'served, bytes identical' if ok else 'NOT served'}; {counters(b)}")
        a.close()
        b.close()
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
