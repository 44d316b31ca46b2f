"""The reliability suite's ``hostile-folders`` scenario: a second local user in a tier folder.

Each trial: a writer puts chunks; the tier folder is left open to another user for a while
(a careless ``chmod``), and she plants FIFOs, links to a root-only file, her own forged
segment (a chunk key anyone can compute, her KV), and swaps registered segments and the
writer's open one for links, FIFOs and files of hers; the writer is killed. An open while
the folder is open to her is refused with one line; once it is private again, the store
opens (bounded in time: no open hangs), every read is the exact bytes or a miss, her
forged chunk is never served (not by recovery, not by ``rebuild_index``), her files are left
as they are, and the root-only file is unchanged (checksummed before and after).
Needs root (to make the user); skipped with a message elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy  # noqa: F401  (imported here: her forked child cannot read the virtualenv to import it)

from store import MiB, Store, StoreConfig, TierConfig
from stress.common import Tally, key
from stress.hostile import HostileUser, plant_fifo, plant_file, plant_link

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SIZE = 64 << 10
#: the key of her forged chunk (in a real attack: a public system prompt's first chunk)
FORGED = 10**6
#: the segment ids under which she plants files of hers (the writer's stay far below)
PLANTED = 900_000

_READ_BACK = """
import json, sys
from store import Store
from stress.common import content, key
acked = json.load(open(sys.argv[2]))
s = Store(sys.argv[1])
got = {"exact": 0, "miss": 0, "wrong": 0}
for i in acked:
    c = s.get(key(i))
    got["miss" if c is None else "exact" if bytes(c.data) == content(key(i), int(sys.argv[3])) else "wrong"] += 1
got["problems"] = sorted({p.kind for p in s.check()})
got["rebuilt"] = s.rebuild_index()
got["forged_served"] = s.get(key(int(sys.argv[4]))) is not None
s.close()
print(json.dumps(got))
"""


_OPEN = """
import sys
from store import Store, StoreError
try:
    Store(sys.argv[1]).close()
except StoreError as exc:
    print(exc)
    sys.exit(3)
"""


def _her_segment(path: str) -> str:
    """(run as her) Her own store with her chunk for the key ``FORGED``: its segment, as hex."""
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
        s.put(key(FORGED), b"\x66" * SIZE, {"dtype": "uint8"})
    (name,) = [n for n in os.listdir(os.path.join(path, "nvme")) if n.endswith(".lseg")]
    with open(os.path.join(path, "nvme", name), "rb") as f:
        return f.read().hex()


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def scenario_hostile_folders(work: Path, n: int) -> Tally:
    t = Tally("hostile-folders")
    if os.geteuid() != 0:
        t.facts["skipped"] = "needs root to make a second user and act as it"
        return t
    rng = random.Random(18)
    os.chmod(work, 0o755)  # she may pass through the scenario's folder, not write in it
    secret = work / "root-only"
    secret.write_bytes(os.urandom(1 << 20))
    os.chmod(secret, 0o600)
    before = _digest(secret)
    planted = refused = hung = wrong = served = 0
    with HostileUser() as eve:
        (work / "eve").mkdir(mode=0o755)
        os.chown(work / "eve", eve.uid, eve.gid)
        forged = eve.do(_her_segment, str(work / "eve" / "store"))
        for trial in range(n):
            t.trials += 1
            path = work / f"store{trial}"
            tier = path / "nvme"
            w = subprocess.Popen([sys.executable, str(ROOT / "stress" / "worker.py"), str(path), "put",
                                  str(trial * 10_000), str(SIZE), str(256 * MiB)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env=ENV)
            assert w.stdout is not None
            acked: list[int] = []
            for line in w.stdout:
                acked.append(int(line.split()[1]))
                if len(acked) >= 80 + rng.randrange(40):
                    break
            os.chmod(path, 0o755)
            os.chmod(tier, 0o777)  # the careless chmod, while the writer runs
            segs = sorted(tier.glob("seg-*.lseg"))
            moves = [
                lambda: eve.do(plant_fifo, str(tier / f"seg-{PLANTED + trial:012d}.lseg")),
                lambda: eve.do(plant_link, str(tier / f"seg-{PLANTED + 100 + trial:012d}.lseg"), str(secret)),
                lambda: eve.do(plant_file, str(tier / f"seg-{PLANTED + 200 + trial:012d}.lseg"), forged),
                lambda: eve.do(plant_link, str(rng.choice(segs[:-1] or segs)), str(secret)),
                lambda: eve.do(plant_fifo, str(rng.choice(segs[:-1] or segs))),
                lambda: eve.do(plant_file, str(rng.choice(segs)), forged),
            ]
            for move in rng.sample(moves, len(moves)):  # each of them, in a random order
                move()
                planted += 1
            for line in w.stdout:  # the writer goes on a little (or stops: it may not make segments here)
                acked.append(int(line.split()[1]))
                if rng.random() < 0.2:
                    break
            w.kill()
            w.wait()
            writers = [p for p in tier.glob("seg-*.lseg") if int(p.name[4:-5]) < PLANTED]
            eve.do(plant_link, str(max(writers)), str(secret))  # the writer's open segment
            planted += 1
            try:  # in a child, bounded: an open that hangs on her FIFO must not hang the suite
                r = subprocess.run([sys.executable, "-c", _OPEN, str(path)], capture_output=True, text=True, env=ENV,
                                   timeout=120)
                lines = r.stdout.strip().splitlines()
                refused += r.returncode == 3
                t.check(r.returncode == 3 and len(lines) == 1 and "mode 0777" in lines[0],
                        f"trial {trial}: a store whose tier folder is 0777 was not refused with one line: {lines}")
            except subprocess.TimeoutExpired:
                hung += 1
                t.check(False, f"trial {trial}: opening the store hung")
            os.chmod(tier, 0o700)  # the operator puts it right
            os.chmod(path, 0o700)
            (work / "acked.json").write_text(json.dumps(acked))
            try:
                r = subprocess.run([sys.executable, "-c", _READ_BACK, str(path), str(work / "acked.json"), str(SIZE),
                                    str(FORGED)], capture_output=True, text=True, env=ENV, timeout=120)
            except subprocess.TimeoutExpired:
                hung += 1
                t.check(False, f"trial {trial}: the store hung opening or reading")
                continue
            if r.returncode != 0:
                t.check(False, f"trial {trial}: reopening failed: {r.stderr.strip().splitlines()[-1:]}")
                continue
            got = json.loads(r.stdout.strip().splitlines()[-1])
            wrong += got["wrong"]
            served += got["forged_served"]
            t.check(got["wrong"] == 0, f"trial {trial}: {got['wrong']} read(s) returned other bytes")
            t.check(not got["forged_served"], f"trial {trial}: her forged chunk was served")
            t.check(_digest(secret) == before, f"trial {trial}: the root-only file changed")
            t.facts["misses"] = t.facts.get("misses", 0) + got["miss"]
            t.facts["exact"] = t.facts.get("exact", 0) + got["exact"]
    t.facts.update(planted=planted, refused_opens=refused, hung=hung, wrong=wrong, forged_served=served)
    return t
