"""Eviction under churn: exact LRU next to the segment policy, on seeded traces, in one run.

    .venv/bin/python benchmarks/churn.py [--rounds 3] [--quick] [--json] [--dir DIR]

Each trace is a seeded stream of requests replayed through a real ``Store`` (real LMDB, real
segment files in a folder on this disk, default: a temporary folder under the current one) with
one nvme tier of --tier-mib, once per eviction policy (``eviction = "lru"`` and ``"segment"``).
A request is a prefix-chained list of chunk keys, as an engine sees a prompt: its longest cached
prefix is read (``Store.get``, verified), the rest "recomputed" and saved in one ``put_many``;
a request may pin its chunks. The geometry is the issue's scaled down (by default 1/16: a
64 MiB tier of 4 MiB segments, chunks of 360 KiB, about 11 chunks a segment, like a 1 GiB
tier of 5.6 MiB SmolLM2 chunks), and every trace ingests about three tiers' worth:

  churn  new chunks, each followed by a re-read of a chunk drawn from the last 1.5 tiers' worth
         (so LRU order departs from write order); 5% of the new chunks pinned
  zipf   documents of 1-8 chunks, requested by a Zipf law (s = 0.9) over 4 tiers' worth of them
  chat   conversations; each turn sends the whole conversation so far (a hit on the earlier
         turns) and adds one or two chunks; new conversations start, old ones end
  flood  a one-off flood (unique documents, never read again) through a hot set of documents
         (a quarter of the tier) that gets half of the requests

Per trace and policy: write amplification (bytes written to the tier, compaction and segment
headers included, per payload byte put: the store's own ``write_amplification``), hit ratio
(chunks found / chunks asked for), bytes read per hit (bytes read by gets and by compaction
per chunk hit: compaction reads what it moves) and fill (the tier's live bytes over its
capacity, averaged over the requests). A third row, ``lru-sim``, is an ideal exact LRU
simulated in memory on the same requests (chunk by chunk, no segments, so no dead space to
pay for; pinned chunks kept; the same low watermark): the hit ratio a perfect LRU would have,
a reference beside the store's own ``lru``, which pays for the dead space it leaves in partly
live segments with live chunks (it evicts by disk bytes, dead ones included).

Rounds use seeds ``--seed``, ``--seed``+1, ...; in each round every trace runs under both
policies, the order alternating (A B, then B A), so that a load on the machine falls on both.
Medians and [min-max] over rounds; the goals: WA <= 1.1 under churn for ``segment``, and its
hit ratio within 2 points of the store's exact LRU (``lru``) on every trace (both by
medians); the gap to ``lru-sim`` is printed too. Timing is not measured: the figures are
counts, the same on any disk for a given seed (wall seconds are printed for information only).

A trace is a function ``(rng, geometry) -> Iterator[Request]``; ``run_trace`` runs one trace
against one store config (``StoreConfig`` built by ``store_config``): a further dimension
(an admission setting, say) is one more argument there and one more loop in ``main``.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import MiB, PutItem, Store, StoreConfig, TierConfig  # noqa: E402
from store.clock import ManualClock  # noqa: E402
from store.format.keys import KEY_BYTES  # noqa: E402

POLICIES = ("lru", "segment")
#: the goals (issue 22, item 2)
WA_GOAL = 1.1
HIT_POINTS = 2.0
LAYOUT = {"dtype": "uint8"}


@dataclass(frozen=True)
class Geometry:
    """The tier and the chunks of a run."""

    tier_bytes: int
    chunk_bytes: int
    ingest: float = 3.0  # tiers' worth of chunks each trace puts, about

    @property
    def fit(self) -> int:
        """Chunks that fit in the tier, about."""
        return max(8, self.tier_bytes // self.chunk_bytes)


@dataclass
class Request:
    """One prompt: its chunk keys, prefix-chained (a chunk is useful only after the ones
    before it), and whether its chunks are pinned once saved."""

    keys: list[bytes]
    pin: bool = False


Trace = Callable[[random.Random, Geometry], Iterator[Request]]


def chunk_key(trace: str, *parts: object) -> bytes:
    """A chunk key, the same for the same trace and parts (all traces share a namespace id)."""
    h = hashlib.blake2b("/".join(map(str, (trace, *parts))).encode(), digest_size=KEY_BYTES - 16).digest()
    return b"churn-benchmark!" + h


def chain(trace: str, doc: object, n: int) -> list[bytes]:
    """The ``n`` chunk keys of document ``doc``."""
    return [chunk_key(trace, doc, i) for i in range(n)]


# -- the traces ----------------------------------------------------------------------------
def churn(rng: random.Random, g: Geometry) -> Iterator[Request]:
    """New chunks, each followed by a re-read of a recent one; 5% of the new ones pinned."""
    total = int(g.ingest * g.fit)
    recent = int(1.5 * g.fit)
    for i in range(total):
        yield Request([chunk_key("churn", i)], pin=rng.random() < 0.05)
        j = rng.randrange(max(0, i - recent), i + 1)
        yield Request([chunk_key("churn", j)])


def zipf(rng: random.Random, g: Geometry, s: float = 0.9) -> Iterator[Request]:
    """Documents of 1-8 chunks, 4 tiers' worth of them, requested by a Zipf law."""
    sizes: list[int] = []
    while sum(sizes) < 4 * g.fit:
        sizes.append(rng.randint(1, 8))
    cum: list[float] = []
    acc = 0.0
    for rank in range(len(sizes)):
        acc += 1.0 / (rank + 1) ** s
        cum.append(acc)
    order = list(range(len(sizes)))
    rng.shuffle(order)  # popularity is not the order documents were made in
    put = 0
    while put < g.ingest * g.fit * 1.5:
        doc = order[bisect.bisect_left(cum, rng.random() * acc)]
        put += sizes[doc]
        yield Request(chain("zipf", doc, sizes[doc]))


def chat(rng: random.Random, g: Geometry) -> Iterator[Request]:
    """Conversations whose every turn extends the last; the recent ones are the active ones."""
    active: list[tuple[int, int, int]] = []  # (conversation, chunks so far, turns left)
    nxt = put = 0
    while put < g.ingest * g.fit:
        if not active or (len(active) < 24 and rng.random() < 0.25):
            active.append((nxt, 0, rng.randint(2, 12)))
            nxt += 1
        i = min(len(active) - 1, int(rng.expovariate(1 / 4)))  # the most recently started, mostly
        i = len(active) - 1 - i
        conv, n, left = active[i]
        more = rng.randint(1, 2)
        n += more
        put += more
        yield Request(chain("chat", conv, n))
        if left <= 1:
            active.pop(i)
        else:
            active[i] = (conv, n, left - 1)


def flood(rng: random.Random, g: Geometry) -> Iterator[Request]:
    """One-off documents (never again) through a hot set of documents (a quarter of the tier)
    that gets half of the requests."""
    hot: list[int] = []
    while sum(hot) < g.fit // 4:
        hot.append(rng.randint(1, 4))
    once = n = 0
    while once < g.ingest * g.fit:
        if rng.random() < 0.5:
            d = rng.randrange(len(hot))
            yield Request(chain("flood-hot", d, hot[d]))
        else:
            size = rng.randint(1, 8)
            once += size
            n += 1
            yield Request(chain("flood-once", n, size))


TRACES: dict[str, Trace] = {"churn": churn, "zipf": zipf, "chat": chat, "flood": flood}


# -- running a trace -------------------------------------------------------------------------
@dataclass
class Result:
    trace: str
    policy: str
    seed: int
    requests: int = 0
    asked: int = 0  # chunks asked for
    hits: int = 0
    hit_bytes: int = 0  # bytes read by gets
    payload_bytes: int = 0
    written_bytes: int = 0
    compacted_bytes: int = 0
    evicted: int = 0
    pinned_lost: int = 0  # pinned chunks not found (must stay 0)
    over_capacity: int = 0  # times the tier's disk bytes exceeded its capacity (must stay 0)
    fill_sum: float = 0.0  # the tier's live bytes / capacity, summed over requests
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wa(self) -> float:
        return self.written_bytes / self.payload_bytes if self.payload_bytes else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.asked if self.asked else 0.0

    @property
    def fill(self) -> float:
        """How full of live chunks the tier was, on average over the requests."""
        return self.fill_sum / self.requests if self.requests else 0.0

    @property
    def written_per_hit(self) -> float:
        """Bytes written to the tier (records, compaction, headers) per chunk served."""
        return self.written_bytes / self.hits if self.hits else 0.0

    @property
    def read_per_hit(self) -> float:
        return (self.hit_bytes + self.compacted_bytes) / self.hits if self.hits else 0.0


def store_config(g: Geometry, policy: str, admit: str = "all") -> StoreConfig:
    """The store a run uses: one nvme tier (segments of a 16th of it, as any small tier gets)."""
    return StoreConfig(tiers={"nvme": TierConfig(capacity=g.tier_bytes, pin_budget=0.5)}, eviction=policy,
                       fsync=False, admit=admit)


def payload(g: Geometry) -> bytes:
    return random.Random(7).randbytes(g.chunk_bytes)


def run_trace(name: str, trace: Trace, cfg: StoreConfig, g: Geometry, seed: int, where: Path,
              label: str) -> Result:
    """Replay ``trace`` (seeded with ``seed``) through a fresh store with settings ``cfg`` in a
    new folder under ``where`` (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix=f"churn-{name}-{label}-", dir=where))
    res = Result(name, label, seed)
    data = payload(g)
    clock = ManualClock(1.7e9)
    pinned: list[bytes] = []
    t0 = time.perf_counter()
    try:
        store = Store(folder / "store", cfg, clock=clock)
        try:
            for req in trace(random.Random(seed), g):
                res.requests += 1
                clock.advance(1.0)
                res.asked += len(req.keys)
                found = 0
                for k in req.keys:
                    c = store.get(k)
                    if c is None:
                        break
                    found += 1
                    res.hit_bytes += len(memoryview(c.data).cast("B"))
                res.hits += found
                store.flush()  # access times reach the index: eviction sees this request
                missing = req.keys[found:]
                if req.pin and cfg.admit != "all":  # an ops script pinning a document it sends: a pin
                    store.pin("benchmark", req.keys)  # made first is always admitted (store/tiers/admission.py)
                if missing:  # an engine's save: admission decides what reaches the tier
                    store.save_many([PutItem(k, data, LAYOUT) for k in missing])
                if req.pin:
                    store.pin("benchmark", req.keys)
                    pinned.extend(req.keys)
                tier = store.stats().tiers["nvme"]
                if tier.disk_bytes > tier.capacity:
                    res.over_capacity += 1
                res.fill_sum += tier.bytes / tier.capacity
            res.pinned_lost = sum(loc is None for loc in store.locate(pinned))
            st = store.stats()
            res.payload_bytes = st.counters["payload_bytes"]
            res.written_bytes = st.counters["written_bytes"]
            res.compacted_bytes = st.counters["compacted_bytes"]
            res.evicted = st.counters["evicted"]
        finally:
            store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    res.seconds = time.perf_counter() - t0
    return res


def simulate_lru(name: str, trace: Trace, g: Geometry, seed: int, low_watermark: float = 0.9) -> Result:
    """The hit ratio an ideal exact LRU would have on the same requests: chunk by chunk, in
    memory, no segments (so no dead space to count against the tier), pinned chunks kept.
    A reference for the two real policies, not a store."""
    from collections import OrderedDict

    from store.format.record import record_len

    res = Result(name, "lru-sim", seed)
    rec = record_len(g.chunk_bytes)
    cache: OrderedDict[bytes, None] = OrderedDict()
    pins: set[bytes] = set()
    for req in trace(random.Random(seed), g):
        res.requests += 1
        res.asked += len(req.keys)
        found = 0
        for k in req.keys:
            if k not in cache:
                break
            cache.move_to_end(k)
            found += 1
        res.hits += found
        res.hit_bytes += found * g.chunk_bytes
        for k in req.keys[found:]:
            if (len(cache) + 1) * rec > g.tier_bytes:
                for old in [o for o in cache if o not in pins]:
                    if (len(cache) + 1) * rec <= low_watermark * g.tier_bytes:
                        break
                    del cache[old]
                    res.evicted += 1
            cache[k] = None
            res.payload_bytes += g.chunk_bytes
            res.written_bytes += rec
        if req.pin:
            pins.update(req.keys)
        res.fill_sum += len(cache) * rec / g.tier_bytes
    return res


# -- the report --------------------------------------------------------------------------------
def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def summary(results: list[Result]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        out.setdefault(r.trace, {}).setdefault(r.policy, {"wa": [], "hit_ratio": [], "read_per_hit": [], "fill": [],
                                                          "written_per_hit": [], "pinned_lost": 0,
                                                          "over_capacity": 0})
        cell = out[r.trace][r.policy]
        cell["fill"].append(r.fill)
        cell["wa"].append(r.wa)
        cell["hit_ratio"].append(r.hit_ratio)
        cell["read_per_hit"].append(r.read_per_hit)
        cell["written_per_hit"].append(r.written_per_hit)
        cell["pinned_lost"] += r.pinned_lost
        cell["over_capacity"] += r.over_capacity
    return out


def goals(summ: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    wa = statistics.median(summ["churn"]["segment"]["wa"]) if "churn" in summ else None
    def gap(ref: str) -> dict[str, float]:
        """Hit ratio points of ``ref`` above ``segment``, by trace (medians)."""
        return {t: 100 * (statistics.median(p[ref]["hit_ratio"]) - statistics.median(p["segment"]["hit_ratio"]))
                for t, p in summ.items() if {ref, "segment"} <= set(p)}

    gaps = gap("lru")
    safe = all(c["pinned_lost"] == 0 and c["over_capacity"] == 0 for p in summ.values() for c in p.values())
    return {"churn_wa": wa, "wa_met": wa is not None and wa <= WA_GOAL, "hit_gap_points": gaps,
            "hit_met": all(g <= HIT_POINTS for g in gaps.values()), "hit_gap_to_sim_points": gap("lru-sim"),
            "pins_and_capacity_kept": safe}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tier-mib", type=float, default=64.0)
    ap.add_argument("--chunk-kib", type=float, default=360.0)
    ap.add_argument("--traces", default=",".join(TRACES), help="comma-separated: " + ", ".join(TRACES))
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: a 16 MiB tier of 180 KiB chunks, two tiers' worth a trace, one round")
    ap.add_argument("--dir", type=Path, default=Path("."), help="where the stores are made (a disk, not tmpfs)")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false",
                    help="leave out lru-sim: an ideal exact LRU simulated in memory (hit ratio reference)")
    ap.add_argument("--admit", default="all,second-hit",
                    help="admission modes to run the segment policy with (lru runs with all), comma-separated")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    ingest = 3.0
    if a.quick:
        a.rounds, a.tier_mib, a.chunk_kib, ingest = 1, 16.0, 180.0, 2.0
    names = [t.strip() for t in a.traces.split(",") if t.strip()]
    unknown = [t for t in names if t not in TRACES]
    admits = [m.strip() for m in a.admit.split(",") if m.strip()]
    if not admits or any(m not in ("all", "second-hit") for m in admits):
        print("churn.py: --admit takes all and/or second-hit", file=sys.stderr)
        return 2
    runs = [(p, "all", p) for p in POLICIES]  # the goals compare these two
    runs += [("segment", m, f"seg+{m}") for m in admits if m != "all"]
    if unknown or a.rounds < 1 or a.tier_mib < 16 or a.chunk_kib < 4:
        print(f"churn.py: unknown trace(s) {', '.join(unknown)}" if unknown else
              "churn.py: --rounds >= 1, --tier-mib >= 16, --chunk-kib >= 4", file=sys.stderr)
        return 2
    g = Geometry(int(a.tier_mib * MiB), int(a.chunk_kib * 1024) // 4096 * 4096 or 4096, ingest)
    a.dir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for rnd in range(a.rounds):
        order = runs if rnd % 2 == 0 else runs[::-1]
        for name in names:
            for policy, admit, label in order:
                r = run_trace(name, TRACES[name], store_config(g, policy, admit), g, a.seed + rnd, a.dir, label)
                results.append(r)
                if not a.json:
                    print(f"  round {rnd + 1} {name:6s} {policy:8s} WA {r.wa:.3f}  hit {100 * r.hit_ratio:5.1f}%  "
                          f"fill {100 * r.fill:4.1f}%  {r.seconds:5.1f} s", file=sys.stderr)
    if a.simulate:
        results += [simulate_lru(name, TRACES[name], g, a.seed + rnd) for rnd in range(a.rounds) for name in names]
    summ = summary(results)
    gl = goals(summ)
    if a.json:
        print(json.dumps({"geometry": asdict(g), "rounds": a.rounds, "seed": a.seed, "goals": gl,
                          "summary": summ, "runs": [
                              {**asdict(r), "wa": r.wa, "hit_ratio": r.hit_ratio, "read_per_hit": r.read_per_hit,
                               "written_per_hit": r.written_per_hit} for r in results]}, indent=1))
        return 0
    print(f"tier {g.tier_bytes / MiB:.0f} MiB, chunks {g.chunk_bytes / 1024:.0f} KiB ({g.fit} fit), "
          f"{a.rounds} round(s), seeds {a.seed}-{a.seed + a.rounds - 1}; median [min-max] over rounds")
    print(f"{'trace':6s} {'policy':8s} {'write ampl.':>20s} {'hit ratio %':>18s} {'KiB read/hit':>16s} "
          f"{'fill %':>18s} {'KiB written/hit':>18s}")
    for trace, pol in summ.items():
        for policy, c in pol.items():
            print(f"{trace:6s} {policy:8s} {spread(c['wa'], '.3f'):>20s} "
                  f"{spread([100 * h for h in c['hit_ratio']], '.1f'):>18s} "
                  f"{spread([b / 1024 for b in c['read_per_hit']], '.0f'):>16s} "
                  f"{spread([100 * f for f in c['fill']], '.1f'):>18s} "
                  f"{spread([b / 1024 for b in c['written_per_hit']], '.0f'):>18s}")
    if gl["churn_wa"] is not None:
        print(f"goal WA <= {WA_GOAL} under churn (segment): {gl['churn_wa']:.3f}: "
              f"{'met' if gl['wa_met'] else 'NOT met'}")
    gaps = ", ".join(f"{t} {v:+.1f}" for t, v in gl["hit_gap_points"].items())
    print(f"goal hit ratio within {HIT_POINTS:g} points of lru on every trace (lru - segment: {gaps}): "
          f"{'met' if gl['hit_met'] else 'NOT met'}")
    if gl["hit_gap_to_sim_points"]:
        sim = ", ".join(f"{t} {v:+.1f}" for t, v in gl["hit_gap_to_sim_points"].items())
        print(f"for reference, lru-sim - segment: {sim} points")
    print(f"pinned chunks kept and capacity respected in every run: {'yes' if gl['pins_and_capacity_kept'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
