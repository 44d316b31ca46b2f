"""The reliability suite's ``big-records`` scenario: chunks at a real model's size.

Each trial stores Llama-8B chunks (bf16 KV of 256 tokens: 32 layers x 2 x 8 KV heads x 128
x 2 bytes = 32 MiB raw each) in a store with a dram and an nvme tier, as an engine saves them
(raw), and then takes them down every path a record of that size goes: read back, compressed
(zstd-shuffle, as the cold compression does: a realistic compressed length is unaligned and
over the 8 MiB write piece), the store closed (sealing its segments), half of the chunks
evicted so that compaction moves the compressed survivors, then moved to dram and back to
nvme (every other trial: spilled to nvme by a dram tier made smaller than one chunk); each
step read back byte for byte (``get``, ``get_into`` a page-aligned and an unaligned buffer), and
``verify --deep`` (``check(deep=True)``) clean at the end.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np

from store import GiB, MiB, PutItem, Store, StoreConfig, TierConfig
from store.format.record import ALIGN
from store.format.segment import WRITE_SPAN
from stress.common import Tally, key, quiet_store_log

#: Llama-8B: layers, KV heads, head dim; 256 tokens of bf16
LAYERS, HEADS, DIM, TOKENS = 32, 8, 128, 256
CHUNK = LAYERS * 2 * HEADS * DIM * TOKENS * 2  # 32 MiB
#: chunks per trial
CHUNKS = 6


def _source() -> mmap.mmap:
    """bf16 values of a smooth activation-like distribution, page-aligned: each chunk is a
    window of it at its own offset (some page-aligned, most not)."""
    n = CHUNK + 16 * MiB
    buf = mmap.mmap(-1, n)
    rng = np.random.default_rng(8)
    f32 = (rng.standard_normal(n // 2, dtype=np.float32) * 0.5).view(np.uint32)
    np.frombuffer(buf, dtype=np.uint16)[:] = (f32 >> 16).astype(np.uint16)
    return buf


def _config(folder: Path, dram: int = 4 * GiB) -> StoreConfig:
    return StoreConfig(tiers={"nvme": TierConfig(capacity=16 * GiB),
                              "dram": TierConfig(capacity=dram, path=str(folder / "dram"))},
                       default_tier="nvme", segment_bytes=256 * MiB)


def _same(got: Any, want: memoryview) -> bool:
    a = np.frombuffer(memoryview(got).cast("B"), dtype=np.uint8)
    return a.shape == (len(want),) and bool(np.array_equal(a, np.frombuffer(want, dtype=np.uint8)))


def scenario_big_records(work: Path, n: int) -> Tally:
    t = Tally("big-records")
    src = _source()
    out = mmap.mmap(-1, CHUNK)  # page-aligned: read into with O_DIRECT
    spare = bytearray(CHUNK + 1)  # not page-aligned: read into through staging buffers
    layout = {"dtype": "bfloat16", "shape": [LAYERS, 2, TOKENS, HEADS, DIM]}
    reads = wrong = missed = compacted = moved = spilled = 0
    stored_sizes: list[int] = []
    problems: list[str] = []

    def check_all(s: Store, keys: list[bytes], want: dict[bytes, memoryview], step: str,
                  tier: str | None = None) -> None:
        nonlocal reads, wrong, missed
        for i, k in enumerate(keys):
            reads += 1
            got: Any = None
            where: str | None = None
            if i % 3 == 2:
                c = s.get(k)
                if c is not None:
                    got, where = c.data, c.tier
            else:
                buf = out if i % 3 == 0 else memoryview(spare)[1:]
                info = s.get_into(k, buf, expect=CHUNK)
                if info is not None:
                    got, where = buf, info.tier
            if got is None:
                missed += 1
                t.check(False, f"{step}: chunk {i} missed")
            elif not _same(got, want[k]):
                wrong += 1
                t.check(False, f"{step}: chunk {i} read back other bytes")
            elif tier is not None and where != tier:
                t.check(False, f"{step}: chunk {i} read from {where}, not {tier}")

    with quiet_store_log():
        for trial in range(n):
            folder = work / f"t{trial}"
            cfg = _config(folder)
            keys = [key(trial * 100 + i) for i in range(CHUNKS)]
            # each a window of its own: the first page-aligned, the others not
            want = {k: memoryview(src)[(trial * CHUNKS + i) * 4100:][:CHUNK] for i, k in enumerate(keys)}
            t.trials += 1
            with Store(folder / "store", cfg) as s:
                # saved as an engine saves them: raw
                ok = s.put_many([PutItem(k, want[k], layout, TOKENS, "raw") for k in keys])
                t.check(all(ok), f"trial {trial}: {ok.count(False)} chunk(s) not stored")
                check_all(s, keys, want, f"trial {trial}: raw")
                # compressed as the cold compression does
                res = s.rewrite(keys, codec="zstd-shuffle", level=1)
                t.check(res.chunks == CHUNKS, f"trial {trial}: {res.chunks} of {CHUNKS} compressed")
                for i, k in enumerate(keys):
                    info = s.info(k)
                    if info is None or info.codec != "zstd-shuffle":
                        t.check(False, f"trial {trial}: chunk {i} is not compressed")
                        continue
                    stored_sizes.append(info.stored_bytes)
                check_all(s, keys, want, f"trial {trial}: compressed")
                before = {k: s.info(k) for k in keys}
            with Store(folder / "store") as s:  # its segments sealed: compaction may take them
                gone, kept = keys[::2], keys[1::2]
                t.check(s.evict(gone).chunks == len(gone), f"trial {trial}: eviction")
                s.compact(tier="nvme", min_dead_ratio=0.0)
                for k in kept:
                    a, b = before[k], s.info(k)
                    if a is None or b is None:
                        t.check(False, f"trial {trial}: a kept chunk vanished in compaction")
                    elif (a.segment, a.offset) != (b.segment, b.offset) and b.codec == "zstd-shuffle":
                        compacted += 1
                t.check(all(s.info(k) is None for k in gone), f"trial {trial}: an evicted chunk came back")
                check_all(s, kept, want, f"trial {trial}: compacted", tier="nvme")
                res = s.rewrite(kept, tier="dram")
                t.check(res.chunks == len(kept), f"trial {trial}: {res.chunks} of {len(kept)} moved to dram")
                moved += res.chunks
                check_all(s, kept, want, f"trial {trial}: moved to dram", tier="dram")
                if trial % 2 == 0:  # moved back
                    res = s.rewrite(kept, tier="nvme")
                    t.check(res.chunks == len(kept), f"trial {trial}: {res.chunks} of {len(kept)} moved to nvme")
                    moved += res.chunks
                    how = "moved back to nvme"
                else:  # dram made smaller than one chunk: its chunks spill down to nvme
                    s.configure(_config(folder, dram=16 * MiB))
                    spilled += sum(t_ == "nvme" for t_ in s.locate(kept))
                    how = "spilled to nvme"
                check_all(s, kept, want, f"trial {trial}: {how}", tier="nvme")
                found = s.check(deep=True)
                problems += [f"{p.kind}: {p.detail}" for p in found]
                t.check(not found, f"trial {trial}: verify --deep found {[p.kind for p in found]}")
    out.close()
    unaligned = sum(1 for n_ in stored_sizes if n_ % ALIGN)
    t.check(len(stored_sizes) == n * CHUNKS and all(WRITE_SPAN < n_ < CHUNK for n_ in stored_sizes),
            f"compressed sizes {stored_sizes[:4]}... are not between the 8 MiB write piece and 32 MiB")
    t.check(compacted == n * len(range(1, CHUNKS, 2)), f"only {compacted} compressed chunks were moved by compaction")
    t.check(spilled == n // 2 * len(range(1, CHUNKS, 2)), f"only {spilled} chunks spilled from dram to nvme")
    t.facts.update(chunk_bytes=CHUNK, chunks=n * CHUNKS, compressed_min=min(stored_sizes, default=0),
                   compressed_max=max(stored_sizes, default=0), compressed_unaligned=unaligned,
                   compacted_compressed=compacted, moved_between_tiers=moved, spilled_to_nvme=spilled,
                   reads_checked=reads, wrong_bytes=wrong, missed=missed, verify_problems=len(problems))
    return t

