"""NVMe bytes written per hit with ``admit = "all"`` and ``admit = "second-hit"``, on seeded traces
replayed through a real store as an engine uses it.

    .venv/bin/python benchmarks/admission.py --rounds 3

A trace is a list of requests, each the chunk keys of its prompt (prefix-chained, as an
engine's: a chunk key stands for its whole prefix). ``zipf_trace`` makes one: a share of the
requests are one-off prompts (never seen again), the others read one of ``docs`` documents
picked by a Zipf law (a few hot documents, a long tail), each several chunks long. ``replay``
plays a trace through a store as the connector does: the leading chunks the store holds are
loaded (``get_many_into``: hits, and promotions into dram where there is a dram tier), the
rest are computed and saved (``save_many``), and the access log is flushed after each
request (so that what eviction sees does not depend on a timer). It reports the bytes written
to the nvme tier (every byte: records, segment headers, spills from dram, compaction;
``Store.write_rates``), the chunk hits, the hit ratio (chunks loaded / chunks asked for) and
the NVMe bytes written per hit. ``benchmarks/churn.py`` can call ``zipf_trace`` and
``replay`` with its own traces and settings.

Each round makes a trace of a new seed and replays it through each setup (nvme alone, and a
small dram tier over it) with each ``admit``, in an order that turns each round; medians and
ranges over the rounds. The figures are counts, not times, so a busy machine changes only
the wall time (printed too). The stores live under /dev/shm by default: what is measured is
what the store decides to write, not the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import MiB, PutItem, Store, StoreConfig, TierConfig  # noqa: E402

LAYOUT = {"dtype": "uint8"}
NAMESPACE = b"\x07" * 16


def chain(parent: bytes, label: bytes) -> bytes:
    """The key of the chunk after ``parent`` (a prefix chain, as the connector's keys are)."""
    return NAMESPACE + hashlib.blake2b(parent + label, digest_size=32).digest()


def zipf_trace(seed: int, requests: int = 3000, docs: int = 600, zipf_s: float = 1.0, one_off: float = 0.5,
               chunks: tuple[int, int] = (2, 8)) -> list[list[bytes]]:
    """A seeded trace: ``requests`` prompts, a share ``one_off`` of them seen once, the rest one
    of ``docs`` documents chosen with probability ~ 1 / rank ** ``zipf_s``; each prompt
    ``chunks`` (low, high) chunks long."""
    rng = random.Random(seed)
    lengths = [rng.randint(*chunks) for _ in range(docs)]
    weights = [1.0 / (r + 1) ** zipf_s for r in range(docs)]
    doc_keys: list[list[bytes]] = []
    for d, n in enumerate(lengths):
        ks, k = [], b"doc-%d" % d
        for c in range(n):
            k = chain(k, b"%d" % c)
            ks.append(k)
        doc_keys.append(ks)
    out = []
    for r in range(requests):
        if rng.random() < one_off:
            k, ks = b"once-%d-%d" % (seed, r), []
            for c in range(rng.randint(*chunks)):
                k = chain(k, b"%d" % c)
                ks.append(k)
            out.append(ks)
        else:
            out.append(doc_keys[rng.choices(range(docs), weights)[0]])
    return out


def chat_trace(seed: int, requests: int = 3000, sessions: int = 400, first: tuple[int, int] = (1, 4),
               turn: tuple[int, int] = (1, 2), one_off: float = 0.3) -> list[list[bytes]]:
    """A seeded multi-turn chat: each request is the next turn of one of ``sessions``
    conversations (chosen at random, so turns of others come between), its prompt the last
    turn's plus ``turn`` (low, high) more chunks (the first turn ``first`` chunks); a share
    ``one_off`` of the requests are one-off prompts. Here every prefix but a session's last is
    read again, once or more: the case against ``second-hit``."""
    rng = random.Random(seed)
    chats: list[list[bytes]] = [[] for _ in range(sessions)]
    out = []
    for r in range(requests):
        if rng.random() < one_off:
            k, ks = b"once-%d-%d" % (seed, r), []
            for c in range(rng.randint(*first)):
                k = chain(k, b"%d" % c)
                ks.append(k)
            out.append(ks)
            continue
        s = rng.randrange(sessions)
        ks = chats[s]
        k = ks[-1] if ks else b"chat-%d-%d" % (seed, s)
        for c in range(rng.randint(*(turn if ks else first))):
            k = chain(k, b"%d" % (len(ks) + c))
            ks.append(k)
        if len(ks) > 24:  # a conversation this long ends; a new one takes its place
            chats[s] = []
        out.append(list(ks))
    return out


TRACES = {"zipf": zipf_trace, "chat": chat_trace}


@dataclass
class Replay:
    """What one replay did."""

    setup: str
    admit: str
    requests: int
    chunks_asked: int
    hits: int
    saves: int
    not_admitted: int
    nvme_written_bytes: int
    wall_s: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.chunks_asked if self.chunks_asked else 0.0

    @property
    def nvme_bytes_per_hit(self) -> float:
        return self.nvme_written_bytes / self.hits if self.hits else float("inf")

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "hit_ratio": round(self.hit_ratio, 4),
                "nvme_bytes_per_hit": round(self.nvme_bytes_per_hit)}


def config(setup: str, admit: str, nvme_bytes: int, dram_bytes: int, folder: Path) -> StoreConfig:
    """``nvme``: an nvme tier alone; ``dram+nvme``: a dram tier of ``dram_bytes`` in front."""
    tiers = {"nvme": TierConfig(capacity=nvme_bytes)}
    if setup == "dram+nvme":
        tiers["dram"] = TierConfig(capacity=dram_bytes, path=str(folder / "dram"))
    return StoreConfig(tiers=tiers, default_tier="dram" if "dram" in tiers else "nvme", admit=admit,
                       segment_bytes=1 * MiB, fsync=False)


def replay(trace: Sequence[Sequence[bytes]], cfg: StoreConfig, folder: Path, chunk_bytes: int = 16 << 10,
           setup: str = "") -> Replay:
    """Play ``trace`` through a new store of ``cfg`` in ``folder`` (see the module's docstring)."""
    payload = bytes(chunk_bytes)
    bufs = [bytearray(chunk_bytes) for _ in range(max(map(len, trace), default=0))]
    asked = hits = saves = 0
    t0 = time.perf_counter()
    with Store(folder / "store", cfg) as s:
        for keys in trace:
            asked += len(keys)
            have = s.locate(list(keys), remote=False)
            n = next((i for i, t in enumerate(have) if t is None), len(keys))
            if n:
                got = s.get_many_into(list(keys[:n]), bufs[:n], expect=chunk_bytes)
                n = next((i for i, g in enumerate(got) if g is None), n)
                hits += n
            todo = [PutItem(k, payload, LAYOUT, 256) for k in keys[n:]]
            if todo:
                saves += s.save_many(todo).count("stored")
            s.flush()
        written = s.write_rates()["nvme"].written_bytes
        declined = sum(s.admission_stats()["not_admitted"].values())  # saves kept off nvme, and spills dropped
    return Replay(setup, cfg.admit, len(trace), asked, hits, saves, declined, written, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace", choices=sorted(TRACES), default="zipf",
                    help="zipf: documents by popularity and one-off prompts; chat: multi-turn conversations")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--one-off", type=float, default=0.5, help="the share of requests seen once")
    ap.add_argument("--chunk-kib", type=int, default=16)
    ap.add_argument("--nvme-mib", type=int, default=24, help="the nvme tier (the documents take about 60 MiB)")
    ap.add_argument("--dram-mib", type=int, default=6)
    ap.add_argument("--work", default="/dev/shm")
    args = ap.parse_args()
    import os

    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)", flush=True)
    setups = [(setup, admit) for setup in ("nvme", "dram+nvme") for admit in ("all", "second-hit")]
    runs: dict[tuple[str, str], list[Replay]] = {k: [] for k in setups}
    for r in range(args.rounds):
        trace = (zipf_trace(1000 + r, args.requests, args.docs, one_off=args.one_off) if args.trace == "zipf" else
                 chat_trace(1000 + r, args.requests))
        order = setups[r % len(setups):] + setups[: r % len(setups)]
        for setup, admit in order:
            with tempfile.TemporaryDirectory(dir=args.work, prefix="lmctl-admission-") as tmp:
                cfg = config(setup, admit, args.nvme_mib * MiB, args.dram_mib * MiB, Path(tmp))
                rep = replay(trace, cfg, Path(tmp), args.chunk_kib << 10, setup)
            runs[(setup, admit)].append(rep)
            print(f"round {r + 1} {setup:9} {admit:10} hits {rep.hits:6d}/{rep.chunks_asked:6d} "
                  f"({rep.hit_ratio:.3f})  nvme written {rep.nvme_written_bytes / MiB:8.1f} MiB  "
                  f"per hit {rep.nvme_bytes_per_hit / 1024:7.1f} KiB  not admitted {rep.not_admitted:6d}  "
                  f"{rep.wall_s:.1f} s", flush=True)
    what = (f"{args.one_off:.0%} one-off, {args.docs} documents by Zipf" if args.trace == "zipf" else
            "multi-turn chat, 30% one-off")
    print(f"\n{args.rounds} rounds, {args.requests} requests each ({what}), {args.chunk_kib} KiB chunks, "
          f"nvme {args.nvme_mib} MiB, dram {args.dram_mib} MiB")
    print(f"{'setup':9} {'admit':10} {'hit ratio':>18} {'NVMe KiB/hit':>22} {'NVMe MiB written':>24}")
    for setup, admit in setups:
        rs = runs[(setup, admit)]

        def fmt(xs: list[float], spec: str) -> str:
            return f"{statistics.median(xs):{spec}} ({min(xs):{spec}}-{max(xs):{spec}})"

        print(f"{setup:9} {admit:10} {fmt([x.hit_ratio for x in rs], '.3f'):>18} "
              f"{fmt([x.nvme_bytes_per_hit / 1024 for x in rs], '.1f'):>22} "
              f"{fmt([x.nvme_written_bytes / MiB for x in rs], '.1f'):>24}")
    for setup in ("nvme", "dram+nvme"):
        ratios = [b.nvme_bytes_per_hit / a.nvme_bytes_per_hit for a, b in
                  zip(runs[(setup, "all")], runs[(setup, "second-hit")], strict=True)]
        dhit = [b.hit_ratio - a.hit_ratio for a, b in zip(runs[(setup, "all")], runs[(setup, "second-hit")],
                                                          strict=True)]
        print(f"{setup}: second-hit writes {statistics.median(ratios):.2f}x the NVMe bytes per hit of all "
              f"({min(ratios):.2f}-{max(ratios):.2f}); hit ratio {statistics.median(dhit) * 100:+.1f} points "
              f"({min(dhit) * 100:+.1f} to {max(dhit) * 100:+.1f})")


if __name__ == "__main__":
    main()
