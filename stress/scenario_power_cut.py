"""Power cuts: a writer process puts, pins, unpins and changes settings through a store on a
FUSE file system that keeps unsynced writes in memory (tests/faultfs.py); the power is cut at a
random moment, and the backing folder, as a disk would be after the cut, is opened directly.
Checks: every acknowledged pin, unpin and setting holds; every put acknowledged more than
the stated window before the cut (``store.index.SYNC_SOON_S``; a put's commit is synced in the
background) is there with its exact bytes, and the age of the newest put lost is recorded (the
measured window); the index opens, and ``verify --deep`` finds nothing. Half the cuts drop
every unsynced write; the other half let each one reach the disk with probability 1/2 (a
disk that wrote part of its cache in any order). Then probes of the window: one put on an
idle writer, the cut a set time after its acknowledgement; a put older than the window must
survive.

The writer (``python stress/scenario_power_cut.py writer STORE ACCESS_FLUSH_S``) reads commands on stdin and
prints ``start CMD`` before and ``ack CMD`` after each one; commands are ``put I``, ``pin LABEL
I``, ``unpin LABEL I``, ``config CAPACITY_MIB``, and ``loop SEED COUNT`` (random ones of those,
COUNT of them, then it waits).
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import MiB, Store, StoreConfig, TierConfig  # noqa: E402
from store.index import SYNC_SOON_S  # noqa: E402
from stress.common import Tally, Worker, content, key  # noqa: E402

#: chunk payload size (the writer's and the checks')
SIZE = 64 << 10
#: a put may be lost if it was acknowledged this long before the cut, at most: the background
#: sync's delay, plus the time the sync itself and the writer's printing of the ack take
WINDOW_S = SYNC_SOON_S + 0.25


def config(capacity_mib: int = 1024, access_flush_s: float = 1.0) -> StoreConfig:
    return StoreConfig(tiers={"nvme": TierConfig(capacity=capacity_mib * MiB, pin_budget=0.9)},
                       segment_bytes=2 * MiB, access_flush_s=access_flush_s)


# -- the writer process --------------------------------------------------------------------------
def _do(store: Store, cmd: list[str], access_flush_s: float) -> None:
    op = cmd[0]
    if op == "put":
        k = key(int(cmd[1]))
        store.put(k, content(k, SIZE), {"dtype": "uint8"}, tokens=16)
    elif op == "pin":
        store.pin(cmd[1], [key(int(cmd[2]))])
    elif op == "unpin":
        store.unpin(cmd[1], [key(int(cmd[2]))])
    elif op == "config":
        store.configure(config(int(cmd[1]), access_flush_s))
    else:
        raise ValueError(f"unknown command {cmd!r}")


def _random_ops(seed: int, count: int) -> list[list[str]]:
    rng = random.Random(seed)
    out: list[list[str]] = []
    put = 0
    for _ in range(count):
        r = rng.random()
        if r < 0.55 or put == 0:
            out.append(["put", str(seed * 100000 + put)])
            put += 1
        elif r < 0.8:
            out.append(["pin", f"L{rng.randrange(4)}", str(seed * 100000 + rng.randrange(put))])
        elif r < 0.95:
            out.append(["unpin", f"L{rng.randrange(4)}", str(seed * 100000 + rng.randrange(put))])
        else:
            out.append(["config", str(rng.choice((768, 1024, 1280)))])
    return out


def writer(path: str, access_flush_s: float) -> None:
    store = Store(path, config(access_flush_s=access_flush_s))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        todo = _random_ops(int(cmd[1]), int(cmd[2])) if cmd and cmd[0] == "loop" else [cmd]
        for c in todo:
            print("start", *c, flush=True)
            _do(store, c, access_flush_s)
            print("ack", *c, flush=True)
        print("idle", flush=True)


# -- what the acknowledgements promise ---------------------------------------------------------------
@dataclass
class Promises:
    """What the writer acknowledged (and what it had started but not acknowledged at the cut)."""

    puts: dict[int, float] = field(default_factory=dict)  # put -> when its ack was read (monotonic)
    acks: Counter[str] = field(default_factory=Counter)  # acknowledged commands by kind
    pins: dict[tuple[str, int], bool] = field(default_factory=dict)  # (label, i): pinned after the last ack
    config: int | None = None
    unsure_pins: set[tuple[str, int]] = field(default_factory=set)
    unsure_config: set[int] = field(default_factory=set)

    def read(self, line: str) -> None:
        word, *cmd = line.split()
        if word not in ("start", "ack") or not cmd:
            return
        op = cmd[0]
        if word == "start":
            if op in ("pin", "unpin"):
                self.unsure_pins.add((cmd[1], int(cmd[2])))
            elif op == "config":
                self.unsure_config.add(int(cmd[1]))
            return
        self.acks[op] += 1
        if op == "put":
            self.puts[int(cmd[1])] = time.monotonic()
        elif op in ("pin", "unpin"):
            self.pins[(cmd[1], int(cmd[2]))] = op == "pin"
            self.unsure_pins.discard((cmd[1], int(cmd[2])))
        elif op == "config":
            self.config = int(cmd[1])
            self.unsure_config.clear()

    def check(self, path: Path, cut_at: float) -> dict[str, float]:
        """Open the store at ``path`` (as it is after a cut at ``cut_at``, monotonic) and count
        what it lost: ``puts_lost`` counts puts acknowledged more than ``WINDOW_S`` before the
        cut, ``puts_lost_in_window`` the others; ``oldest_lost_age_s`` is how long before the cut
        the oldest put that was lost had been acknowledged (0: none was)."""
        out: dict[str, float] = {"puts_lost": 0, "puts_lost_in_window": 0, "oldest_lost_age_s": 0.0,
                                 "wrong_bytes": 0, "pins_lost": 0, "unpins_lost": 0, "settings_lost": 0,
                                 "problems": 0}
        with Store(path) as s:
            for i, acked in self.puts.items():
                c = s.get(key(i), touch=False)
                if c is None:
                    age = cut_at - acked
                    out["puts_lost" if age > WINDOW_S else "puts_lost_in_window"] += 1
                    out["oldest_lost_age_s"] = max(out["oldest_lost_age_s"], round(age, 3))
                elif bytes(c.data) != content(key(i), SIZE):
                    out["wrong_bytes"] += 1
            labels = {name: set(keys) for name, keys in s.labels().items()}
            for (label, i), pinned in self.pins.items():
                if (label, i) in self.unsure_pins:
                    continue
                if (key(i) in labels.get(label, set())) != pinned:
                    out["pins_lost" if pinned else "unpins_lost"] += 1
            have = s.config.tiers["nvme"].capacity // MiB
            if self.config is not None and have != self.config and have not in self.unsure_config:
                out["settings_lost"] += 1
            out["problems"] = sum(not p.fixed for p in s.check(deep=True))
        return out


# -- one cut ------------------------------------------------------------------------------------------
class Writer(Worker):
    """The writer process on ``store`` (a path under a FaultFS mount); its acknowledgements
    are read into ``promises`` as they come."""

    def __init__(self, store: Path, access_flush_s: float = 1.0) -> None:
        self.promises = Promises()
        super().__init__(Path(__file__).resolve(), "writer", str(store), str(access_flush_s),
                         on_line=self.promises.read)


def cut_trial(work: Path, seed: int, ops: int, keep: float) -> tuple[Promises, dict[str, float]]:
    """One writer on a fresh store under a FaultFS mount running ``ops`` random operations, cut
    at a moment drawn from ``seed``; returns the promises and what the reopened store lost."""
    from testsupport.faultfs import FaultFS

    backing, mnt = work / f"backing{seed}", work / f"mnt{seed}"
    rng = random.Random(seed)
    with FaultFS(backing, mnt) as fs:
        w = Writer(mnt / "store")
        try:
            w.expect("ready")
            w.send(f"loop {seed} {ops}")
            time.sleep(rng.uniform(0.2, 1.5))  # the cut lands anywhere in the run (or after it)
            cut_at = w.kill()
        finally:
            if w.proc.poll() is None:
                w.kill()
        fs.power_cut(keep=keep, seed=seed)
    return w.promises, w.promises.check(backing / "store", cut_at)


def window_probe(work: Path, age: float, seed: int) -> bool:
    """One put on an idle writer, the power cut ``age`` seconds after its acknowledgement,
    nothing else committed meanwhile (the access log waits a minute): whether it survived
    (the window of the background sync alone, measured)."""
    from testsupport.faultfs import FaultFS

    backing, mnt = work / f"probe{seed}", work / f"probe-mnt{seed}"
    with FaultFS(backing, mnt) as fs:
        w = Writer(mnt / "store", access_flush_s=60.0)
        try:
            w.expect("ready")
            time.sleep(SYNC_SOON_S + 0.5)  # what the open left to the background sync is synced
            w.send(f"put {seed}")
            w.expect(f"ack put {seed}")
            time.sleep(age)
        finally:
            w.kill()
        fs.power_cut(seed=seed)
    with Store(backing / "store") as s:
        survived = s.get(key(seed), touch=False) is not None
    shutil.rmtree(backing, ignore_errors=True)
    return survived


def scenario_power_cut(work: Path, n: int) -> Tally:
    from testsupport.faultfs import skip_reason

    t = Tally("power-cut")
    why = skip_reason()
    if why is not None:
        t.facts["skipped"] = why
        return t
    totals: dict[str, float] = {"puts_acked": 0, "pins_acked": 0, "unpins_acked": 0, "settings_acked": 0,
                                "puts_lost": 0, "puts_lost_in_window": 0, "wrong_bytes": 0, "pins_lost": 0,
                                "unpins_lost": 0, "settings_lost": 0, "problems": 0}
    oldest = 0.0
    for trial in range(n):
        keep = 0.0 if trial % 2 == 0 else 0.5
        promises, lost = cut_trial(work, 1000 + trial, 400, keep)
        t.trials += 1
        for what, op in (("puts", "put"), ("pins", "pin"), ("unpins", "unpin"), ("settings", "config")):
            totals[f"{what}_acked"] += promises.acks[op]
        oldest = max(oldest, lost.pop("oldest_lost_age_s"))
        for k, v in lost.items():
            totals[k] += v
            t.check(v == 0 or k == "puts_lost_in_window", f"trial {trial} (keep {keep}): {k} = {v}")
        shutil.rmtree(work / f"backing{1000 + trial}", ignore_errors=True)
    t.facts.update({k: int(v) for k, v in totals.items()})
    t.facts["window_s"] = WINDOW_S
    t.facts["oldest_lost_put_age_s"] = oldest
    # the window itself: one put, then nothing, then the cut this long after its ack
    probes = {age: window_probe(work, age, 5000 + i) for i, age in enumerate((1.5,) if n < 10 else
                                                                              (0.1, 0.5, 0.9, 1.3, 1.7, 2.5))}
    for age, survived in probes.items():
        t.check(survived or age <= WINDOW_S, f"a put acknowledged {age} s before the cut was lost")
    t.facts["probe_lost_at_s"] = [a for a, ok in probes.items() if not ok]
    t.facts["probe_survived_at_s"] = [a for a, ok in probes.items() if ok]
    return t


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "writer":
        writer(sys.argv[2], float(sys.argv[3]))
    else:
        sys.exit("usage: scenario_power_cut.py writer STORE ACCESS_FLUSH_S")
