"""A frozen disk (``fsfreeze -f`` on a loop-mounted ext4; root only): reads and ``status`` are
answered while it is frozen, and everything catches up after the thaw.

Two layouts, alternating by trial:

* ``tier``: the nvme tier's folder is on the frozen disk, the index is not. A writer process
  whose next put must create a segment file blocks inside the index's write transaction (it
  holds LMDB's writer lock until the thaw). Meanwhile a reader process's ``get`` of stored
  chunks (hits, which used to flush the access log with a synced write inline), its lookups,
  and the daemon's ``status`` and ``ls`` must all answer within ``DEADLINE_S``.
* ``index``: the whole store, index included, is on the frozen disk. Then every process that
  uses the store waits for the thaw, reads and ``status`` too: each LMDB read transaction
  writes the reader's slot in the index's lock file (``index/lock.mdb``, mapped), a write
  fault on a frozen file system waits for the thaw, and py-lmdb holds Python's interpreter
  lock meanwhile. This layout checks only that everything catches up after the thaw.

After the thaw: the blocked put is acknowledged and stored, the reader's hits reach the index,
reads hit, and ``verify --deep`` is clean.

The worker (``python stress/scenario_frozen.py worker STORE``) takes commands on stdin: ``put I``
(prints ``put I``), ``get I`` (``got I hit|miss``), ``count`` (an engine's lookup count:
``counted``), ``stats`` (``stats HITS``), ``metrics`` (``metrics CELLS``), ``hold`` (a write
transaction left open, as by a writer stuck on its disk: ``held``), ``release`` and ``close``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig  # noqa: E402
from store.format.record import ALIGN, record_len  # noqa: E402
from stress.common import Tally, Worker, content, key  # noqa: E402
from stress.reliability import ENV, Daemon  # noqa: E402

#: reads, lookups and status answer within this while the disk is frozen
DEADLINE_S = 5.0
SIZE = 64 << 10
#: records per segment: a writer's fourth put must create a segment file (a write transaction
#: that blocks on a frozen tier)
PER_SEGMENT = 3


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (loop mounts and fsfreeze)"
    missing = [c for c in ("mkfs.ext4", "fsfreeze", "mount", "umount") if shutil.which(c) is None]
    return f"needs {', '.join(missing)}" if missing else None


@contextmanager
def loop_ext4(work: Path, size_mib: int = 64) -> Iterator[Path]:
    """An ext4 file system in a file, loop-mounted; unmounted (lazily if busy) at the end."""
    img, mnt = work / "disk.img", work / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["truncate", "-s", f"{size_mib}M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"cannot loop-mount a file system here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "-u", str(mnt)], capture_output=True)  # whatever happened: thawed
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        img.unlink(missing_ok=True)


@contextmanager
def frozen(mnt: Path) -> Iterator[None]:
    """``mnt`` frozen for the block; always thawed."""
    subprocess.run(["fsfreeze", "-f", str(mnt)], check=True)
    try:
        yield
    finally:
        subprocess.run(["fsfreeze", "-u", str(mnt)], check=True)


def make_store(path: Path, tier_dir: Path | None) -> None:
    """The store, with chunks 0..3 stored (read as hits while frozen)."""
    seg = ALIGN + PER_SEGMENT * record_len(SIZE)  # the segment's header block, then PER_SEGMENT records
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB, path=None if tier_dir is None else str(tier_dir))},
                      segment_bytes=seg, access_flush_s=0.05)
    with Store(path, cfg) as s:
        for i in range(4):
            s.put(key(i), content(key(i), SIZE), {"dtype": "uint8"}, tokens=16)


def cli(daemon: Daemon, *args: str, timeout: float) -> tuple[float, Any]:
    """Run ``lmctl --json ARGS`` against ``daemon``: the seconds it took and its JSON reply (an
    ``error`` on failure); (inf, None) when it did not answer within ``timeout``."""
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(daemon.sock), "--json", *args],
                           capture_output=True, text=True, env=ENV, timeout=timeout)
    except subprocess.TimeoutExpired:
        return float("inf"), None
    return time.monotonic() - t0, json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr.strip()}


def _timed(w: Worker, cmd: str, answer: str) -> tuple[float, str | None]:
    t0 = time.monotonic()
    w.send(cmd)
    line = w.wait_for(answer, DEADLINE_S)
    return time.monotonic() - t0, line


def trial(work: Path, layout: str) -> dict[str, Any]:
    """One freeze in ``layout`` (``tier`` or ``index``); what answered, how fast, and whether
    everything caught up after the thaw."""
    out: dict[str, Any] = {"layout": layout}
    script = Path(__file__).resolve()
    with loop_ext4(work) as mnt:
        store = work / "store" if layout == "tier" else mnt / "store"
        make_store(store, mnt / "tier" if layout == "tier" else None)
        daemon = Daemon(store)
        workers: list[Worker] = []
        try:
            writer, reader = Worker(script, "worker", str(store)), Worker(script, "worker", str(store))
            workers += [writer, reader]
            for i in range(PER_SEGMENT):  # the writer's own segment is full after these
                writer.send(f"put {100 + i}")
                writer.expect(f"put {100 + i}")
            reader.send("get 0")
            reader.expect("got 0")
            cli(daemon, "status", timeout=60)  # the daemon has read its statistics once
            with frozen(mnt):
                time.sleep(0.2)
                writer.send("put 200")  # must create a segment: blocks (in a write transaction, for "tier")
                out["put_blocked"] = writer.wait_for("put 200", 1.0) is None
                if layout == "tier":
                    reads = [_timed(reader, f"get {i}", f"got {i}") for i in range(1, 4)]
                    out["reads_answered"] = sum(line is not None and line.endswith("hit") for _t, line in reads)
                    took, st = cli(daemon, "status", timeout=DEADLINE_S)
                    out["status_answered"] = st is not None and "error" not in st
                    took_ls, ls = cli(daemon, "ls", "--limit", "5", timeout=DEADLINE_S)
                    out["ls_answered"] = ls is not None and "error" not in ls
                    out["slowest_s"] = round(max([took, took_ls, *(t for t, _line in reads)]), 3)
            # thawed: the put lands, the hits reach the index
            out["put_after_thaw"] = writer.wait_for("put 200", 60) is not None
            time.sleep(0.5)
            reads = [_timed(reader, f"get {i}", f"got {i}") for i in range(4)]
            out["reads_after_thaw"] = sum(line is not None and line.endswith("hit") for _t, line in reads)
            _took, st = cli(daemon, "status", timeout=DEADLINE_S)
            out["status_after_thaw"] = st is not None and "error" not in st
            for w in workers:
                w.send("close")
                w.wait_for("closed", 60)
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.kill()
            daemon.stop()
        with Store(store) as s:
            out["stored_after_thaw"] = s.contains(key(200))
            out["hits_after_thaw"] = s.stats().counters["hits"]
            out["problems"] = [p.kind for p in s.check(deep=True) if not p.fixed]
    return out


def worker(path: str) -> None:
    store = Store(path)
    ns = Namespace("frozen-test", KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=16, chunk_size=16))
    held = None
    print("ready", flush=True)
    for line in sys.stdin:
        op, _, arg = line.strip().partition(" ")
        if op == "hold":
            held = store._index.env.begin(write=True)
            print("held", flush=True)
        elif op == "release" and held is not None:
            held.abort()
            print("released", flush=True)
        elif op == "count":
            store.count_lookup(ns, 16, 32)
            print("counted", flush=True)
        elif op == "stats":
            print(f"stats {store.stats().counters['hits']}", flush=True)
        elif op == "metrics":
            print(f"metrics {len(store.metric_cells())}", flush=True)
        elif op == "put":
            k = key(int(arg))
            store.put(k, content(k, SIZE), {"dtype": "uint8"}, tokens=16)
            print(f"put {arg}", flush=True)
        elif op == "get":
            c = store.get(key(int(arg)))
            ok = c is not None and bytes(c.data) == content(key(int(arg)), SIZE)
            print(f"got {arg} {'hit' if ok else 'miss'}", flush=True)
        elif op == "close":
            store.close()
            print("closed", flush=True)
            return


def scenario_frozen(work: Path, n: int) -> Tally:
    t = Tally("frozen")
    why = skip_reason()
    if why is not None:
        t.facts["skipped"] = why
        return t
    slowest = 0.0
    reads = 0
    for i in range(n):
        layout = ("tier", "index")[i % 2]
        r = trial(work / f"t{i}", layout)
        t.trials += 1
        t.check(r["put_blocked"], f"trial {i} ({layout}): the put did not block on the frozen disk")
        if layout == "tier":
            reads += r["reads_answered"]
            t.check(r["reads_answered"] == 3, f"trial {i}: reads answered {r['reads_answered']} of 3 within "
                                              f"{DEADLINE_S} s while frozen")
            t.check(r["status_answered"], f"trial {i}: status did not answer within {DEADLINE_S} s while frozen")
            t.check(r["ls_answered"], f"trial {i}: ls did not answer within {DEADLINE_S} s while frozen")
            slowest = max(slowest, r["slowest_s"])
        t.check(r["put_after_thaw"] and r["stored_after_thaw"], f"trial {i} ({layout}): the put did not land")
        t.check(r["reads_after_thaw"] == 4 and r["status_after_thaw"], f"trial {i} ({layout}): after the thaw, "
                f"reads hit {r['reads_after_thaw']} of 4, status answered: {r['status_after_thaw']}")
        hits = 1 + 4 + (3 if layout == "tier" else 0)  # the reader's gets: before, during and after the freeze
        t.check(r["hits_after_thaw"] >= hits, f"trial {i} ({layout}): {r['hits_after_thaw']} of the reader's "
                                              f"{hits} hits reached the index")
        t.check(not r["problems"], f"trial {i} ({layout}): verify --deep: {r['problems']}")
        shutil.rmtree(work / f"t{i}", ignore_errors=True)
    t.facts.update(reads_while_frozen=reads, slowest_answer_while_frozen_s=slowest, deadline_s=DEADLINE_S)
    return t


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        sys.exit("usage: scenario_frozen.py worker STORE")
