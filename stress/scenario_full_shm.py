"""The reliability suite's ``full-shm`` scenario: another user fills the tmpfs under the dram tier.

Each trial mounts a 16 MiB tmpfs (root only) as the dram tier's filesystem, with an nvme
tier on the ordinary disk and dram the default tier, stores a few chunks, then fills the
tmpfs with a file of another owner (what any local user can do to /dev/shm). Checked: every
save after that lands on nvme (none is lost or raises), the spills are counted
(``saves_spilled_total``), every stored chunk reads back exactly, and once the file is gone
dram takes saves again (after ``SPILL_RETRY_S``, shortened here).
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import time
from pathlib import Path

import store.ops.writes
from store import MiB, PutItem, Store, StoreConfig, TierConfig
from stress.common import Tally, content, key, quiet_store_log

#: the owner of the file that fills the tmpfs: not the store's (a uid no account has)
OTHER_UID = 54321


def fill(folder: Path) -> Path:
    """Fill ``folder``'s filesystem with one file owned by another uid."""
    hog = folder / "someone-elses-file"
    fd = os.open(hog, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, bytes(64 << 10)):
            pass
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    os.chown(hog, OTHER_UID, OTHER_UID)
    return hog


def scenario_full_shm(work: Path, n: int) -> Tally:
    t = Tally("full-shm")
    if os.geteuid() != 0:
        t.facts["skipped"] = "needs root to mount a small tmpfs"
        return t
    rng = random.Random(7)
    saves = spilled = on_nvme = lost = wrong = raised = back_to_dram = 0
    before = store.ops.writes.SPILL_RETRY_S
    store.ops.writes.SPILL_RETRY_S = 0.2
    try:
        for trial in range(n):
            shm = work / f"shm{trial}"
            shm.mkdir()
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(shm)], capture_output=True,
                               text=True)
            if r.returncode:
                t.facts["skipped"] = f"cannot mount a tmpfs here: {r.stderr.strip()}"
                return t
            try:
                cfg = StoreConfig(tiers={"dram": TierConfig(capacity=64 * MiB, path=str(shm / "lmctl")),
                                         "nvme": TierConfig(capacity=256 * MiB)},
                                  default_tier="dram", segment_bytes=4 * MiB)
                with Store(work / f"store{trial}", cfg) as s, quiet_store_log():
                    sizes: dict[bytes, int] = {}
                    first = [key(trial * 1000 + i) for i in range(4)]
                    for k in first:
                        sizes[k] = 256 << 10
                        s.put(k, content(k, sizes[k]), {"dtype": "uint8"}, tokens=16)
                    hog = fill(shm)
                    later = [key(trial * 1000 + 100 + i) for i in range(40)]
                    for i in range(0, len(later), 4):
                        batch = later[i:i + 4]
                        for k in batch:
                            sizes[k] = rng.choice((64 << 10, 256 << 10, 1 << 20))
                        try:
                            ok = s.put_many([PutItem(k, content(k, sizes[k]), {"dtype": "uint8"}, 16) for k in batch])
                        except Exception as exc:  # what the scenario is here to catch
                            raised += len(batch)
                            t.check(False, f"trial {trial}: a save raised {type(exc).__name__}: {exc}")
                            continue
                        saves += sum(ok)
                    t.trials += 1
                    where = s.locate(later, remote=False)
                    on_nvme += where.count("nvme")
                    lost += where.count(None)
                    for k in first + later:
                        c = s.get(k)
                        wrong += c is not None and bytes(c.data) != content(k, sizes[k])
                        lost += c is None and k in first
                    s.flush()
                    spilled += int(sum(c.value for c in s.metric_cells() if c.name == "saves_spilled_total"))
                    hog.unlink()
                    time.sleep(0.3)
                    k = key(trial * 1000 + 999)
                    s.put(k, content(k, 4096), {"dtype": "uint8"}, tokens=16)
                    back_to_dram += s.locate([k], remote=False) == ["dram"]
            finally:
                subprocess.run(["umount", "-l", str(shm)], check=False)
    finally:
        store.ops.writes.SPILL_RETRY_S = before
    t.check(lost == 0 and wrong == 0 and raised == 0,
            f"full-shm: {lost} chunks lost, {wrong} read back wrong, {raised} saves raised")
    t.check(on_nvme == saves == spilled, f"full-shm: {saves} saves, {on_nvme} on nvme, {spilled} counted as spilled")
    t.check(back_to_dram == t.trials, f"full-shm: dram took saves again in {back_to_dram} of {t.trials} trials")
    t.facts.update(saves_while_full=saves, landed_on_nvme=on_nvme, counted_spilled=spilled, lost=lost,
                   wrong_bytes=wrong, dram_again_after_freeing=back_to_dram)
    return t
