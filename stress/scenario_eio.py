"""The reliability suite's ``eio`` scenario: a disk that returns EIO for random reads.

A store's nvme tier lives on a FUSE passthrough (tests/faultfs.py) that fails the reads of
chosen byte ranges with EIO; its index is on the ordinary disk. Each trial stores chunks,
makes a random quarter of them unreadable (a range inside the payload or the trailer), then
either reads everything (every read returns the exact bytes or a miss, never an exception;
each unreadable chunk is dropped and counted as ``io-error``), or runs the deep check (it
lists every unreadable chunk) and the fix (it drops them all, and nothing else).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from store import MiB, Store, StoreConfig, TierConfig, short_key
from stress.common import Tally, content, key, quiet_store_log

#: chunks per trial
CHUNKS = 24


def scenario_eio(work: Path, n: int) -> Tally:
    t = Tally("eio")
    from testsupport.faultfs import FaultFS, skip_reason

    reason = skip_reason()
    if reason is not None:
        t.facts["skipped"] = reason
        return t
    rng = random.Random(18)
    raised = wrong = unreadable = dropped_wrongly = 0
    listed_short = fixed_short = read_errors = 0
    with FaultFS(work / "backing", work / "mnt") as fs, quiet_store_log():
        for trial in range(n):
            tier = work / "mnt" / f"nvme{trial}"
            cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB, path=str(tier))}, segment_bytes=2 * MiB)
            with Store(work / f"store{trial}", cfg) as s:
                keys = [key(trial * 1000 + i) for i in range(CHUNKS)]
                sizes = {k: rng.choice((4096, 65536, 200_000, 1 << 20)) for k in keys}
                for k in keys:
                    s.put(k, content(k, sizes[k]), {"dtype": "uint8"}, tokens=16,
                          codec=rng.choice(("raw", "zstd")))
                bad = set(rng.sample(keys, CHUNKS // 4))
                for k in bad:
                    info = s.info(k)
                    assert info is not None
                    body = (info.stored_bytes + 4095) // 4096 * 4096
                    at = info.offset + (rng.randrange(info.stored_bytes) if rng.random() < 0.7 else body + 8)
                    fs.fail_reads(f"nvme{trial}/seg-{info.segment:012d}.lseg", at, at + 1)
                t.trials += 1
                unreadable += len(bad)
                if trial % 2 == 0:
                    out = np.zeros(1 << 20, dtype=np.uint8)
                    for k in keys * 2:  # twice: a dropped chunk stays a miss
                        try:
                            if rng.random() < 0.5:
                                got = s.get(k)
                                data = None if got is None else bytes(got.data)
                            else:
                                info_r = s.get_into(k, out)
                                data = None if info_r is None else out[: info_r.raw_bytes].tobytes()
                        except Exception as exc:  # what the scenario is here to catch
                            raised += 1
                            t.check(False, f"read raised {type(exc).__name__}: {exc}")
                            continue
                        if data is not None and data != content(k, sizes[k]):
                            wrong += 1
                        if data is None and k not in bad:
                            dropped_wrongly += 1
                    counted = s.event_counters()["corrupt_total"].get("io-error", 0)
                    t.check(counted == len(bad), f"trial {trial}: {counted} io-error drops, {len(bad)} unreadable")
                    t.check(not any(s.contains(k) for k in bad), f"trial {trial}: an unreadable chunk stayed indexed")
                else:
                    found = {p.detail.split()[1].rstrip(":") for p in s.check(deep=True) if p.kind == "read-error"}
                    listed_short += len({short_key(k) for k in bad} - found)
                    fixed = s.check(deep=True, fix=True)
                    fixed_short += len(bad) - sum(p.kind == "read-error" and p.fixed for p in fixed)
                    t.check([k for k in keys if s.contains(k)] == [k for k in keys if k not in bad],
                            f"trial {trial}: --fix dropped other chunks, or left unreadable ones")
                    fs.clear_faults()
                    left = [p.kind for p in s.check(deep=True) if p.kind not in ("orphan-file", "counter", "counts")]
                    t.check(not left, f"trial {trial}: problems after --fix: {left}")
            fs.clear_faults()
        read_errors = fs.read_errors()
    t.check(raised == 0 and wrong == 0 and dropped_wrongly == 0,
            f"eio: {raised} reads raised, {wrong} returned wrong bytes, {dropped_wrongly} readable chunks missed")
    t.check(listed_short == 0 and fixed_short == 0,
            f"eio: verify --deep missed {listed_short} unreadable chunks, --fix left {fixed_short}")
    t.facts.update(unreadable_chunks=unreadable, eio_returned=read_errors, reads_raised=raised, wrong_bytes=wrong,
                   verify_missed=listed_short, fix_missed=fixed_short)
    return t
