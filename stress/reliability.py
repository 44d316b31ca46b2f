"""The reliability suite: an operator's worst day, replayed against real processes, a real
disk, a real daemon, with figures.

    .venv/bin/python stress/reliability.py [--quick] [--json] [--only NAME ...]

Scenarios (each bounded in count and time; every one ends by checking the store):

* kills: SIGKILL a writer at random moments while it puts, evicts, compacts and rewrites
  chunks; after each kill, reopen: every acknowledged chunk that was not being evicted is
  there with its exact bytes, nothing indexed is torn, and the bytes on disk equal the bytes
  the index counts.
* flips: flip one random bit of a chunk's payload, of its record trailer, or of its index
  entry; every read returns the exact bytes or a miss, never other bytes.
* index: delete the index, or damage it (one clear error, then moved aside): the next open
  rebuilds it with its chunks, pins and settings.
* full-disk: fill a loop-mounted 85 MB filesystem under a tier whose capacity is larger
  (root only: skipped with a message elsewhere); writes fail with DiskFullError, no chunk
  is evicted for it, usage equals the disk, and writes resume when space returns.
* frames: malformed frames of every kind against a real daemon, then a connection flood;
  the daemon answers or hangs up, never dies, keeps its thread count bounded, and stops
  promptly on SIGTERM.
* daemon-abuse: a second uid floods the socket with refused connections while an allowed
  third uid tries every owner-only setting (a root-only password file sent to her listener,
  tier paths, adapter folders, tokenizers); the owner's calls all succeed, hers are all
  refused, the daemon's thread count stays put and it stops cleanly (root only).
* concurrent: clients (lookup, ls, inspect, pin, unpin, compress) with a writer process and
  the daemon's maintenance running, ending with verify --deep.
* hostile-folders: a second local user plants FIFOs, links to a root-only file and a forged
  segment in a tier folder left open to her, and swaps segments (the open one too) while a
  writer runs and is killed (root only: skipped with a message elsewhere); an open is refused
  while the folder is open to her, and once it is private again no open hangs, every read is
  exact or a miss, her chunk is never served and the root-only file is unchanged.
* power-cut: a writer process puts, pins, unpins and changes settings through a store on a
  FUSE file system that drops unsynced writes (tests/faultfs.py), cut at a random moment;
  the backing folder opened directly keeps every acknowledged put (exact bytes), pin, unpin
  and setting, and verify --deep is clean (stress/scenario_power_cut.py; skipped without FUSE).
* frozen: fsfreeze a loop-mounted ext4 under a tier while a writer's put blocks on it: reads,
  status and ls answer; with the whole store on it, everything waits and catches up after the
  thaw (stress/scenario_frozen.py; root only).
* eio: a FUSE passthrough under the nvme tier fails the reads of random chunks with EIO;
  every read returns the exact bytes or a miss, never an exception; each unreadable chunk
  is dropped and counted (io-error); verify --deep lists them all and --fix drops them all
  (stress/scenario_eio.py; skipped without FUSE).
* readonly: a loop-mounted ext4 goes read-only (ext4's error trigger, errors=remount-ro)
  under a running daemon, a writer and a reader; reads go on, saves are refused and counted,
  the daemon stays up and says read-only, and restarts on the read-only disk (root only;
  stress/scenario_readonly.py).
* full-shm: another uid's file fills the 16 MiB tmpfs under the dram tier; saves land on
  nvme, counted as spilled, read back exactly, and dram takes saves again once it has room
  (root only; stress/scenario_full_shm.py).
* forged (stress/scenario_forged.py): two stores of one deployment on a real redis-server, and
  a Redis client without the secret rewriting, swapping, truncating and forging (valid
  checksums) values at random; every read is the exact bytes or a miss, every forged value is
  counted forged and never promoted, untouched values are hits; ends with verify --deep.
* big-records (stress/scenario_big_records.py): Llama-8B chunks (32 MiB of bf16 KV each) saved
  raw, compressed (an unaligned length over the 8 MiB write piece), half evicted so that
  compaction moves the compressed rest, moved to dram and back (or spilled back by a full dram
  tier); every step read back byte for byte, and verify --deep clean.

Exit status 0 when every check held; the table lists trials and failures per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store import DiskFullError, MiB, Store, StoreConfig, StoreError, TierConfig  # noqa: E402
from store.errors import IndexWriteError  # noqa: E402
from stress.common import Tally, content, key  # noqa: E402
from testsupport.lmctl import Daemon as HarnessDaemon  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def on_disk(store: Store, tier: str = "nvme") -> int:
    return sum(p.stat().st_size for p in (Path(store.path) / tier).glob("seg-*.lseg"))


# -- kills ---------------------------------------------------------------------------------
def scenario_kills(work: Path, n: int) -> Tally:
    t = Tally("kills")
    rng = random.Random(7)
    size = 64 << 10  # every chunk a run puts fits the tier: only the workers' own evictions remove any
    checked = lost = wrong = 0
    for mode in ("put", "churn"):
        path = work / f"kills-{mode}"
        acked: set[int] = set()
        evicting: set[int] = set()
        nxt = 0
        for _ in range(n // 2):
            p = subprocess.Popen([sys.executable, str(ROOT / "stress" / "worker.py"), str(path), mode, str(nxt),
                                  str(size), str(4096 * MiB)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=ENV)
            assert p.stdout is not None
            seen = 0
            while seen < 2:
                line = p.stdout.readline()
                if not line:
                    break
                seen += 1
                _record(line, acked, evicting)
            time.sleep(rng.uniform(0.0, 0.15))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
            # read through the same buffered file readline used (communicate() would read the
            # raw pipe and miss lines readline had already buffered)
            rest, err = p.stdout.read(), p.stderr.read() if p.stderr else ""
            t.check(p.returncode == -signal.SIGKILL, f"{mode}: the worker died on its own: {err.strip()[-300:]}")
            for line in rest.splitlines():
                _record(line, acked, evicting)
            t.trials += 1
            if seen < 2:
                t.check(False, f"{mode}: the worker did not start: {err.strip()[-200:]}")
                break
            nxt = max(acked | evicting | {nxt}) + 1
            with Store(path) as s:
                problems = [p.kind for p in s.check(deep=True) if not p.fixed]
                t.check(not problems, f"{mode}: problems after reopening: {problems}")
                for i in acked - evicting:
                    checked += 1
                    c = s.get(key(i))
                    if c is None:
                        lost += 1
                        t.check(False, f"{mode}: acknowledged chunk {i} lost")
                    elif bytes(c.data) != content(key(i), size):
                        wrong += 1
                        t.check(False, f"{mode}: chunk {i} has wrong bytes")
                st = s.stats().tiers["nvme"]
                t.check(st.disk_bytes == on_disk(s), f"{mode}: index counts {st.disk_bytes} bytes, "
                                                          f"the disk holds {on_disk(s)}")
    t.facts.update(acknowledged_chunks_checked=checked, lost=lost, wrong_bytes=wrong)
    return t


def _record(line: str, acked: set[int], evicting: set[int]) -> None:
    word, _, num = line.partition(" ")
    if word == "put":
        acked.add(int(num))
    elif word == "evicting":
        evicting.add(int(num))


# -- bit flips -------------------------------------------------------------------------------
def scenario_flips(work: Path, n: int) -> Tally:
    from store.index import Entry

    t = Tally("flips")
    rng = random.Random(11)
    size = 64 << 10
    path = work / "flips"
    s = Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=1 << 30)}, segment_bytes=8 * MiB))
    keys = [key(i) for i in range(64)]
    for j, k in enumerate(keys):
        s.put(k, content(k, size), {"dtype": "uint16" if j % 2 else "uint8"}, tokens=16,
              codec="zstd-shuffle" if j % 3 == 0 else None)
    wrong = detected = harmless = 0
    for trial in range(n):
        k = rng.choice(keys)
        info = s.info(k)
        if info is None:
            s.put(k, content(k, size), {"dtype": "uint8"}, tokens=16)
            info = s.info(k)
        assert info is not None
        where = ("payload", "trailer", "index")[trial % 3]
        if where == "index":
            with s._index.env.begin(write=True) as txn:
                raw = bytearray(txn.get(k, db=s._index.chunks) or b"")
                bit = rng.randrange(len(raw) * 8)
                raw[bit // 8] ^= 1 << (bit % 8)
                txn.put(k, bytes(raw), db=s._index.chunks)
            try:
                Entry.unpack(bytes(raw))
            except Exception:
                pass
        else:
            seg = Path(s.path) / "nvme" / f"seg-{info.segment:012d}.lseg"
            body = (info.stored_bytes + 4095) // 4096 * 4096
            pos = info.offset + (rng.randrange(info.stored_bytes) if where == "payload" else body + rng.randrange(512))
            with open(seg, "r+b") as f:
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            s._tiers["nvme"].io.forget(info.segment)  # no cached fd hides the change
        t.trials += 1
        try:
            c = s.get(k)
        except Exception as exc:  # an exception is a failure too: a read is a hit or a miss
            t.check(False, f"{where}: read raised {type(exc).__name__}: {exc}")
            c = None
        if c is None:
            detected += 1
        elif bytes(c.data) != content(k, size):
            wrong += 1
            t.check(False, f"{where}: wrong bytes served for a chunk")
        else:
            harmless += 1  # e.g. a flip in the trailer's padding, or in the entry's hit count
        if c is None:  # put it back (a new record; the damaged one is dead space)
            s.evict([k], force=True)
            s.put(k, content(k, size), {"dtype": "uint8"}, tokens=16)
    s.check(fix=True, deep=True)
    problems = [p.kind for p in s.check(deep=True) if not p.fixed]
    t.check(not problems, f"problems left after verify --fix: {problems}")
    s.close()
    t.facts.update(wrong_bytes=wrong, detected_as_corrupt=detected, harmless_flips=harmless)
    return t


# -- a lost or damaged index ----------------------------------------------------------------------
def scenario_index(work: Path, n: int) -> Tally:
    t = Tally("index")
    rng = random.Random(3)
    size = 32 << 10
    lost_chunks = lost_pins = 0
    for trial in range(n):
        path = work / f"index{trial}"
        keys = [key(trial * 1000 + i) for i in range(40)]
        with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB, pin_budget=0.4)},
                                     segment_bytes=1 * MiB, codec="zstd-shuffle")) as s:
            for k in keys:
                s.put(k, content(k, size), {"dtype": "uint8"})
            s.pin("docs", keys[:10])
            s.evict(keys[30:])
        if trial % 2:  # damaged: one clear error, then moved aside
            data = path / "index" / "data.mdb"
            with open(data, "r+b") as f:
                f.seek(rng.randrange(0, 8192))
                f.write(os.urandom(4096))
            try:
                Store(path).close()
            except Exception as exc:
                t.check(isinstance(exc, StoreError), f"a damaged index raised {type(exc).__name__}: {exc}")
            shutil.move(str(path / "index"), str(work / f"index{trial}.damaged"))
        else:
            shutil.rmtree(path / "index")
        t.trials += 1
        with Store(path) as s:
            back = s.locate(keys[:30])
            lost_chunks += back.count(None)
            lost_pins += sum(1 for k in keys[:10] if s.pin_refs(k) != 1)
            t.check(s.config.codec == "zstd-shuffle" and s.config.tiers["nvme"].pin_budget == 0.4,
                    "settings were not restored")
            t.check(all(bytes(c.data) == content(k, size) for k in keys[:30] if (c := s.get(k)) is not None),
                    "wrong bytes after a rebuild")
            t.check(not [p for p in s.check(deep=True) if not p.fixed], "problems after a rebuild")
            t.check(on_disk(s) == s.stats().tiers["nvme"].disk_bytes, "usage differs from the disk")
    t.check(lost_chunks == 0 and lost_pins == 0, f"{lost_chunks} chunks and {lost_pins} pins lost in rebuilds")
    t.facts.update(chunks_lost=lost_chunks, pins_lost=lost_pins)
    return t


# -- a full disk -----------------------------------------------------------------------------
def scenario_full_disk(work: Path, n: int) -> Tally:
    t = Tally("full-disk")
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        t.facts["skipped"] = "needs root and mkfs.ext4 to loop-mount a small filesystem"
        return t
    lost = evicted = mismatched = 0
    for run in range(n):
        img, mnt = work / f"disk{run}.img", work / f"mnt{run}"
        mnt.mkdir()
        subprocess.run(["truncate", "-s", "85M", str(img)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
        r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
        if r.returncode:
            t.facts["skipped"] = f"cannot loop-mount here: {r.stderr.strip()}"
            return t
        try:
            size = (1 << 20) * (1 + run % 4)
            filler = mnt / "someone-elses-file"  # what fills the disk besides the store
            filler.write_bytes(os.urandom(12 << 20))
            s = Store(mnt / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=320 * MiB)}, segment_bytes=16 * MiB))
            acked, fulls, i = [], 0, 0
            while fulls < 10 and i < 400:
                k = key(run * 1000 + i)
                i += 1
                try:
                    s.put(k, content(k, size), {"dtype": "uint8"})
                    acked.append(k)
                except (DiskFullError, IndexWriteError):  # the index shares the full disk
                    fulls += 1
            t.trials += 1
            st = s.stats()
            evicted += st.counters["evicted"]
            lost += sum(1 for x in s.locate(acked) if x is None)
            mismatched += st.tiers["nvme"].disk_bytes != on_disk(s)
            filler.unlink()  # the operator frees space; the store's own eviction works again
            s.evict(acked[: len(acked) // 2])
            s.compact(min_dead_ratio=0.0)
            k = key(run * 1000 + 999)
            t.check(bool(s.put(k, content(k, size), {"dtype": "uint8"})), "writes did not resume with space")
            t.check(not [p for p in s.check(deep=True) if not p.fixed], "problems after a full disk")
            s.close()
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mnt)], check=False)
    t.check(lost == 0 and evicted == 0 and mismatched == 0,
            f"full disk: {lost} acknowledged chunks lost, {evicted} evicted, {mismatched} usage mismatches")
    t.facts.update(acknowledged_lost=lost, evicted_by_phantom_usage=evicted, usage_mismatches=mismatched)
    return t


# -- a real daemon ------------------------------------------------------------------------------
class Daemon(HarnessDaemon):
    """``lmctl serve --init`` on ``store`` (testsupport's daemon), started."""

    def __init__(self, store: Path, extra: list[str] | None = None, sock: Path | None = None) -> None:
        super().__init__(store, sock, ["--init", *(extra or [])], env=ENV)
        self.start()


def _frames(rng: random.Random) -> list[bytes]:
    from lmctl import protocol

    head = struct.Struct(">2sBxI")
    good = json.dumps({"id": 1, "cmd": "status", "args": {}}).encode()
    return [
        rng.randbytes(rng.randrange(1, 64)),                                       # noise
        head.pack(b"XX", 1, len(good)) + good,                                     # bad magic
        head.pack(b"LM", 9, len(good)) + good,                                     # unknown version
        head.pack(b"LM", protocol.VERSION, protocol.MAX_FRAME + 1),                # oversized
        head.pack(b"LM", protocol.VERSION, 100) + b"{" * 10,                       # truncated, then hang up
        head.pack(b"LM", protocol.VERSION, 7) + b"not-js!",                        # not JSON
        head.pack(b"LM", protocol.VERSION, 2) + b"[]",                             # not an object
        protocol.encode({"id": 1, "cmd": "frobnicate", "args": {}}),               # unknown command
        protocol.encode({"id": 1, "cmd": "ls", "args": {"limit": "many"}}),        # wrong types
        protocol.encode({"id": 1, "cmd": "lookup", "args": {"keys": ["zz"]}}),     # bad key
        head.pack(b"LM", protocol.VERSION, 60_000) + b"[" * 30_000 + b"]" * 30_000,  # nesting
    ]


def scenario_frames(work: Path, n: int) -> Tally:
    from lmctl.daemon import MAX_CLIENTS

    t = Tally("frames")
    rng = random.Random(5)
    d = Daemon(work / "frames-store")
    answered = hung_up = 0
    try:
        kinds = _frames(rng)
        for i in range(n):
            frame = kinds[i % len(kinds)] if i % 4 else rng.randbytes(rng.randrange(1, 256))
            with socket.socket(socket.AF_UNIX) as c:
                c.settimeout(10)
                c.connect(str(d.sock))
                try:
                    c.sendall(frame)
                    c.shutdown(socket.SHUT_WR)
                    got = c.recv(1 << 16)
                except OSError:
                    got = b""
            t.trials += 1
            if got:
                answered += 1
            else:
                hung_up += 1
        t.check(d.proc is not None and d.call("status")["daemon"]["pid"] == d.proc.pid,
                "the daemon did not survive the frames")
        held = []
        for _ in range(MAX_CLIENTS * 2):  # a connection flood: the cap holds, threads stay bounded
            c = socket.socket(socket.AF_UNIX)
            c.connect(str(d.sock))
            held.append(c)
        time.sleep(0.5)
        threads = d.threads()
        t.check(threads <= MAX_CLIENTS + 8, f"{threads} threads with {len(held)} connections held")
        for c in held[: MAX_CLIENTS // 2]:
            c.close()
        time.sleep(0.3)
        t.check(d.call("status")["store"]["path"] == str(d.store), "the daemon did not serve after the flood")
        t.facts.update(connections_held=len(held), daemon_threads=threads)
    finally:
        rc, took, err = d.finish()
        for c in locals().get("held", []):
            c.close()
    t.check(rc == 0 and "Traceback" not in err, f"the daemon exited {rc} or logged a traceback")
    t.check(took < 5, f"SIGTERM with {MAX_CLIENTS // 2} idle clients took {took:.1f} s")
    t.facts.update(frames=n, answered=answered, hung_up=hung_up, sigterm_s=round(took, 2))
    return t


def scenario_concurrent(work: Path, seconds: float) -> Tally:
    from stress.common import key as skey

    t = Tally("concurrent")
    path = work / "concurrent"
    Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=96 * MiB)}, segment_bytes=4 * MiB)).close()
    d = Daemon(path)
    writer = subprocess.Popen([sys.executable, str(ROOT / "stress" / "worker.py"), str(path), "churn", "0",
                               str(128 << 10), str(96 * MiB)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=ENV)
    errors: list[str] = []
    calls = [0]
    stop = time.monotonic() + seconds

    def client(n: int) -> None:
        rng = random.Random(n)
        while time.monotonic() < stop:
            k = skey(rng.randrange(200)).hex()
            op: list[Callable[[], Any]] = [
                lambda: d.call("lookup", {"keys": [k]}), lambda: d.call("ls", {"limit": 20}),
                lambda: d.call("inspect"), lambda: d.call("pin", {"label": f"l{n}", "keys": [k]}),
                lambda: d.call("unpin", {"label": f"l{n}"}), lambda: d.call("compress", {"keys": [k], "level": 1}),
                lambda: d.call("status")]
            try:
                rng.choice(op)()
            except Exception as exc:
                msg = str(exc)
                # usage errors, as they should be: an unpin before any pin of that label, a pin by
                # --key of a chunk that is not stored (never put, or evicted by the churn)
                if "no label" not in msg and "is not stored" not in msg:
                    errors.append(f"{type(exc).__name__}: {msg}")
            calls[0] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    v = d.call("verify", {"deep": True, "fix": True})
    v2 = d.call("verify", {"deep": True})
    rc, _took, err = d.finish()
    t.trials = calls[0]
    t.check(not errors, f"{len(errors)} client calls failed: {errors[:3]}")
    t.check(v2["ok"], f"verify --deep after the run: {v2['problems'][:3]}")
    t.check(rc == 0 and "Traceback" not in err, "the daemon exited badly or logged a traceback")
    t.facts.update(client_calls=calls[0], seconds=seconds, fixed_after_writer_kill=len(v["problems"]))
    return t


def topic(name: str) -> Callable[..., Tally]:
    """The scenario ``scenario_<name>`` of the module ``stress/scenario_<name>.py`` (scenarios
    of a topic of their own live in a module of their own, imported only when they run)."""
    import importlib

    module = importlib.import_module(f"stress.scenario_{name}")
    fn: Callable[..., Tally] = getattr(module, f"scenario_{name}")
    return fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer trials (what CI runs, a few minutes)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    q = args.quick
    plan: list[tuple[str, Callable[[Path], Tally]]] = [
        ("kills", lambda w: scenario_kills(w, 40 if q else 200)),
        ("flips", lambda w: scenario_flips(w, 300 if q else 1500)),
        ("full-disk", lambda w: scenario_full_disk(w, 2 if q else 8)),
        ("index", lambda w: scenario_index(w, 6 if q else 30)),
        ("frames", lambda w: scenario_frames(w, 1000 if q else 10000)),
        ("daemon-abuse", lambda w: topic("daemon_abuse")(w, 2 if q else 20)),
        ("concurrent", lambda w: scenario_concurrent(w, 15 if q else 60)),
        ("hostile-folders", lambda w: topic("hostile_folders")(w, 2 if q else 20)),
        ("power-cut", lambda w: topic("power_cut")(w, 2 if q else 30)),
        ("frozen", lambda w: topic("frozen")(w, 1 if q else 10)),
        ("eio", lambda w: topic("eio")(w, 2 if q else 40)),
        ("readonly", lambda w: topic("readonly")(w, 1 if q else 6)),
        ("full-shm", lambda w: topic("full_shm")(w, 1 if q else 10)),
        ("forged", lambda w: topic("forged")(w, 60 if q else 600)),
        ("big-records", lambda w: topic("big_records")(w, 3 if q else 12)),
    ]
    rows = []
    for name, run in plan:
        if args.only and name not in args.only:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"lmctl-stress-{name}-"))
        t0 = time.monotonic()
        try:
            tally = run(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        row = tally.row()
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        if not args.json:
            extra = {k: v for k, v in row.items() if k not in ("scenario", "trials", "failures", "first_failures")}
            print(f"{name:11} trials {row['trials']:6}  failures {row['failures']}  {json.dumps(extra)}", flush=True)
            for f in row["first_failures"]:
                print(f"    {f}")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
