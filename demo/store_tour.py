"""A tour of the lmctl store: adapter-aware keys, prefix lookup, pins, eviction,
integrity and a warm restart. Runs in seconds on any machine.

    bash scripts/demo.sh            (or: .venv/bin/python demo/store_tour.py [--keep DIR])
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from store import AdapterIdentity, KVFormat, MiB, Namespace, PutItem, Store, StoreConfig, TierConfig

# SmolLM2-135M's KV format: 30 layers, 3 KV heads, head dim 64, bf16, 256-token chunks
FMT = KVFormat("bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)
LAYOUT = {"dtype": "bfloat16", "shape": list(FMT.chunk_shape)}


def fake_kv(seed: int) -> bytes:
    """bf16 activations-like data (smooth values; high bytes carry little entropy)."""
    rng = np.random.default_rng(seed)
    f32 = (rng.standard_normal(FMT.chunk_bytes // 2) * 0.7).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def make_adapter(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj", "v_proj"]}')
    (folder / "adapter_model.safetensors").write_bytes(np.random.default_rng(seed).bytes(4096))
    return folder


def save_prompt(store: Store, ns: Namespace, tokens: list[int]) -> int:
    keys = ns.chunk_keys(tokens)
    items = [PutItem(k, fake_kv(i + len(ns.model)), LAYOUT, FMT.chunk_size) for i, k in enumerate(keys)]
    return sum(store.put_many(items))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="build the store in this directory and keep it")
    args = ap.parse_args()
    logging.basicConfig(format="   store log: %(message)s", level=logging.WARNING)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lmctl-tour-"))
    store_dir = root / "store"
    chunk_disk = FMT.chunk_bytes + 4096
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=40 * chunk_disk, pin_budget=0.5)},
                      segment_bytes=64 * MiB)
    print(f"store: {store_dir}  (nvme capacity {40 * chunk_disk / MiB:.0f} MiB, "
          f"one 256-token chunk = {FMT.chunk_bytes / MiB:.2f} MiB)")

    civil = AdapterIdentity.from_path("civil", make_adapter(root / "adapters/civil", 1))
    legal = AdapterIdentity.from_path("legal", make_adapter(root / "adapters/legal", 2))
    spaces = {
        "base": Namespace("SmolLM2-135M-Instruct", FMT),
        str(civil): Namespace("SmolLM2-135M-Instruct", FMT, civil),
        str(legal): Namespace("SmolLM2-135M-Instruct", FMT, legal),
    }
    document = list(range(1000, 1000 + 2048 + 100))  # a 2148-token shared document prefix

    with Store(store_dir, cfg) as store:
        print("\n1. the same document, served under the civil adapter only")
        n = save_prompt(store, spaces[str(civil)], document)
        print(f"   saved {n} chunks")
        for name, ns in spaces.items():
            r = store.lookup(ns, document)
            print(f"   lookup as {name:<45} hit {r.hit_tokens:>4} / {r.total_tokens} tokens")

        print("\n2. pin the base model's system prompt before it is ever served")
        system = list(range(5000, 5000 + 1024))
        keys = spaces["base"].chunk_keys(system)
        store.pin("system-prompt", keys, expected_bytes=chunk_disk)
        save_prompt(store, spaces["base"], system)
        print(f"   pinned {len(keys)} chunks; stored: {store.locate(keys)}")

        print("\n3. traffic: 60 chunks of other prompts into a 40-chunk tier; the civil document stays hot")
        t0 = time.perf_counter()
        hot = spaces[str(civil)].chunk_keys(document)
        for i in range(15):
            save_prompt(store, spaces["base"], list(range(100_000 * (i + 1), 100_000 * (i + 1) + 1024)))
            for k in hot:  # the document is requested again: its chunks are loaded
                store.get(k)
            store.flush()
        st = store.stats()
        nv = st.tiers["nvme"]
        print(f"   {time.perf_counter() - t0:.2f}s; evicted {st.counters['evicted']}, "
              f"on disk {nv.disk_bytes / MiB:.0f}/{nv.capacity / MiB:.0f} MiB")
        print(f"   pinned system prompt still cached: {store.lookup(spaces['base'], system).hit_tokens} tokens")

        print("\n4. a flipped byte on disk is a miss, never wrong KV")
        k = keys[0]
        info = store.info(k)
        assert info is not None
        seg = store_dir / "nvme" / f"seg-{info.segment:012d}.lseg"
        with open(seg, "r+b") as f:
            f.seek(info.offset + 1234)
            b = f.read(1)
            f.seek(info.offset + 1234)
            f.write(bytes([b[0] ^ 0xFF]))
        print(f"   get after corruption: {store.get(k)}; corrupt counted: {store.stats()['counters']['corrupt']}")
        store.put(k, fake_kv(0 + len(spaces['base'].model)), LAYOUT, FMT.chunk_size)  # re-saved next request

        print("\n5. compression off the hot path: zstd with byte-plane shuffle")
        data = fake_kv(99)
        store.put(b"\x09" * 48, data, LAYOUT, FMT.chunk_size, codec="zstd-shuffle")
        ci = store.info(b"\x09" * 48)
        assert ci is not None
        print(f"   {ci.raw_bytes / MiB:.2f} MiB -> {ci.stored_bytes / MiB:.2f} MiB "
              f"(ratio {ci.raw_bytes / ci.stored_bytes:.2f})")
        before = {name: store.lookup(ns, document).hit_tokens for name, ns in spaces.items()}
        before_sys = store.lookup(spaces["base"], system).hit_tokens

    print("\n6. restart: close and reopen the store")
    t0 = time.perf_counter()
    with Store(store_dir) as store:
        opened = time.perf_counter() - t0
        after = {name: store.lookup(ns, document).hit_tokens for name, ns in spaces.items()}
        after_sys = store.lookup(spaces["base"], system).hit_tokens
        print(f"   reopened in {opened * 1000:.0f} ms; document hits {after} (before {before})")
        print(f"   system prompt hits {after_sys} (before {before_sys}); pins: "
              f"{ {k: len(v) for k, v in store.labels().items()} }")
        problems = store.check(deep=True)
        print(f"   deep verify: {'ok' if not problems else problems}")
        st = store.stats()
        print(f"   write amplification {st.write_amplification:.4f}")
    if not args.keep:
        shutil.rmtree(root)
    os.sync()


if __name__ == "__main__":
    main()
