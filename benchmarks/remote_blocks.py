"""What reuse at the block costs through the shared tier: a second store's lookup that asks
Redis for the partial keys of its first missing chunk too (alias values and tail heads, in
the same pipeline as the full chunks), against one that asks for full chunks only, and a
first store's write-through of a request's records with their alias values against without.

Two stores of one deployment share a redis-server on loopback (started here, persistence
off) and a secret. Store A saves prompts of a fixed prefix (250 and 4096 tokens) plus a
question; store B, empty, looks up the prefix with another question. The variants run
interleaved (A B, B A, ... rotating order), several rounds; medians and spread per variant.

    python benchmarks/remote_blocks.py [--rounds 5] [--lookups 200] [--block 16]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import KVFormat, MiB, Namespace, PutItem, Store, StoreConfig, record_key  # noqa: E402
from store.config import RemoteConfig, TierConfig  # noqa: E402
from testsupport.redis import Server, secret_file  # noqa: E402

FMT = KVFormat("bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, chunk_size=256)  # SmolLM2-135M
NS = Namespace("bench", FMT, model_fingerprint="fp")


def prompt(prefix: int, question: int, seed: int) -> list[int]:
    return list(range(1000, 1000 + prefix)) + list(range(90000 + 100 * seed, 90000 + 100 * seed + question))


def items(tokens: list[int], block: int, aliases: bool) -> list[PutItem]:
    """A request's records as the connector saves them: full chunks and the tail."""
    keys = NS.chunk_keys(tokens)
    cs = FMT.chunk_size
    per = FMT.chunk_bytes // cs
    out = []
    for c in range(len(keys)):
        k, al = record_key(NS, keys, tokens, c, block)
        out.append(PutItem(k, hashlib.shake_256(k).digest(FMT.chunk_bytes), layout(cs), cs,
                           aliases=al if aliases else None))
    tail = (len(tokens) - len(keys) * cs) // block * block
    if tail:
        k, al = record_key(NS, keys, tokens, len(keys), block, tail)
        out.append(PutItem(k, hashlib.shake_256(k).digest(tail * per), layout(tail), tail,
                           aliases=al if aliases else None))
    return out


def layout(tokens: int) -> dict[str, object]:
    return {"dtype": FMT.dtype, "shape": [FMT.num_layers, 2, tokens, FMT.num_kv_heads, FMT.head_dim]}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.3f} ms (min {min(xs):.3f}, max {max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=200, help="lookups per variant per round")
    ap.add_argument("--saves", type=int, default=10, help="4k-token requests saved per variant per round")
    ap.add_argument("--block", type=int, default=16)
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="remote-blocks-"))
    secret = secret_file(folder)
    srv = Server(folder / "redis", "--maxmemory", str(4096 * MiB), "--maxmemory-policy", "noeviction")
    try:
        srv.wait(srv.client)
        def store(name: str) -> Store:
            cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=4096 * MiB)},
                              remote=RemoteConfig(srv.url, key_prefix="bench", secret_file=str(secret),
                                                  promote=False))
            return Store(folder / name, cfg)

        sa, sb = store("a"), store("b")
        bs = a.block
        for prefix in (250, 4096):
            assert all(sa.put_many(items(prompt(prefix, 6, 1), bs, True)))
        print(f"block {bs}; SmolLM2-135M KV format; redis-server on loopback; {a.rounds} rounds")
        lookups: dict[str, list[float]] = {}
        found: dict[str, int] = {}
        variants = [(f"{p} tok, {name}", p, blk) for p in (250, 4096) for name, blk in
                    (("full chunks only", None), ("with partial keys", bs))]
        for r in range(a.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for name, p, blk in order:
                q = prompt(p, 23, 2)
                t0 = time.perf_counter()
                for _ in range(a.lookups):
                    res = sb.lookup(NS, q, block=blk)
                lookups.setdefault(name, []).append((time.perf_counter() - t0) / a.lookups * 1e3)
                found[name] = res.hit_tokens
        print("B's lookup (empty locally, the prefix in Redis):")
        for name, xs in lookups.items():
            print(f"  {name:28s} {spread(xs)}  hit {found[name]} tokens")
        saves: dict[str, list[float]] = {}
        n = 0
        for r in range(a.rounds):
            for name, al in (("records only", False), ("records + alias values", True))[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                for _ in range(a.saves):
                    n += 1
                    assert all(sa.put_many(items(prompt(4096, 6, 1000 + n), bs, al)[16:]))  # the unique tail chunk
                saves.setdefault(name, []).append((time.perf_counter() - t0) / a.saves * 1e3)
        print("A's write-through of a request's last chunk and tail (local + Redis):")
        for name, xs in saves.items():
            print(f"  {name:28s} {spread(xs)}")
        sa.close()
        sb.close()
    finally:
        srv.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
