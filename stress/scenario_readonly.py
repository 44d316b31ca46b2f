"""The reliability suite's ``readonly`` scenario: a disk that goes read-only under a running
daemon, a writer and a reader.

Each trial loop-mounts a small ext4 with ``errors=remount-ro`` (root only), fills a store on
it, starts ``lmctl serve`` (socket off the disk) and, in this process, an engine's store with
a thread saving new chunks and one reading stored ones. Then ext4's own error trigger turns
the filesystem read-only, as a disk error would. Checked: every read before and after
returns the exact bytes (never an exception), every save after it is refused with
``ReadOnlyError`` and counted (``refused_saves``; the one write in flight as the disk
failed may fail with that disk error, EIO, instead), the daemon stays up and its status says
read-only, and a daemon restarted on the read-only disk starts (no exit 1) and serves.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

from store import MiB, ReadOnlyError, Store, StoreConfig, StoreError, TierConfig
from stress.common import Tally, content, key, quiet_store_log

SIZE = 64 << 10


def make_read_only(mnt: Path) -> None:
    """ext4's error trigger: with ``errors=remount-ro`` the filesystem refuses writes at once."""
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(mnt)], capture_output=True, text=True,
                         check=True).stdout.strip()
    Path(f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error").write_text("lmctl stress\n")


def scenario_readonly(work: Path, n: int) -> Tally:
    from stress.reliability import Daemon

    t = Tally("readonly")
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        t.facts["skipped"] = "needs root and mkfs.ext4 to loop-mount a filesystem that can go read-only"
        return t
    reads = wrong = raised = refused = other_errors = in_flight = 0
    for trial in range(n):
        img, mnt = work / f"disk{trial}.img", work / f"mnt{trial}"
        mnt.mkdir()
        subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
        r = subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(img), str(mnt)], capture_output=True,
                           text=True)
        if r.returncode:
            t.facts["skipped"] = f"cannot loop-mount here: {r.stderr.strip()}"
            return t
        d = None
        try:
            path = mnt / "s"
            cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=32 * MiB)}, segment_bytes=4 * MiB,
                              access_flush_s=0.05)
            acked = [key(trial * 10_000 + i) for i in range(20)]
            with Store(path, cfg) as s:
                for k in acked:
                    s.put(k, content(k, SIZE), {"dtype": "uint8"}, tokens=16)
            d = Daemon(path, sock=work / f"d{trial}.sock")
            engine = Store(path)
            stop = threading.Event()
            failed_at = [0.0]
            lock = threading.Lock()
            counts = {"reads": 0, "wrong": 0, "raised": 0, "refused": 0, "other": 0, "late_acks": 0, "eio": 0}

            def writer() -> None:
                i = 100
                while not stop.is_set():
                    k = key(trial * 10_000 + i)
                    i += 1
                    try:
                        engine.put(k, content(k, SIZE), {"dtype": "uint8"}, tokens=16)
                        with lock:
                            if failed_at[0] and time.monotonic() > failed_at[0] + 0.5:
                                counts["late_acks"] += 1  # acknowledged long after the disk went read-only
                            acked.append(k)
                    except ReadOnlyError:
                        with lock:
                            counts["refused"] += 1
                    except (StoreError, OSError) as exc:
                        if "Input/output error" not in str(exc):
                            raise
                        with lock:  # the disk error itself, in a write in flight as it struck
                            counts["eio"] += 1
                    except Exception as exc:  # anything else is what the scenario is here to catch
                        with lock:
                            counts["other"] += 1
                        t.failures.append(f"trial {trial}: a save raised {type(exc).__name__}: {exc}")
                    time.sleep(0.005)

            def reader() -> None:
                rng = random.Random(trial)
                while not stop.is_set():
                    with lock:
                        k = rng.choice(acked)
                    try:
                        c = engine.get(k)
                        with lock:
                            counts["reads"] += 1
                            counts["wrong"] += c is None or bytes(c.data) != content(k, SIZE)
                    except Exception as exc:
                        with lock:
                            counts["raised"] += 1
                        t.failures.append(f"trial {trial}: a read raised {type(exc).__name__}: {exc}")

            with quiet_store_log():
                threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
                for th in threads:
                    th.start()
                time.sleep(0.3)
                make_read_only(mnt)
                failed_at[0] = time.monotonic()
                time.sleep(1.0)
                stop.set()
                for th in threads:
                    th.join()
                t.trials += 1
                t.check(engine.readonly, f"trial {trial}: the engine's store did not turn read-only")
                t.check(counts["eio"] <= 1, f"trial {trial}: {counts['eio']} saves failed with EIO, not refused")
                t.check(engine.refused_saves == counts["refused"],
                        f"trial {trial}: {engine.refused_saves} refused saves counted, {counts['refused']} refused")
                t.check(counts["refused"] > 0 and counts["late_acks"] == 0,
                        f"trial {trial}: {counts['refused']} saves refused, {counts['late_acks']} acknowledged late")
                end = time.monotonic() + 15
                status = d.call("status")
                while not status["store"]["readonly"] and time.monotonic() < end:
                    time.sleep(0.1)
                    status = d.call("status")
                t.check(d.proc.poll() is None, f"trial {trial}: the daemon exited ({d.proc.returncode})")
                t.check(status["store"]["readonly"] is True, f"trial {trial}: status does not say read-only")
                gone = [k for k in acked if (c := engine.get(k)) is None or bytes(c.data) != content(k, SIZE)]
                t.check(not gone, f"trial {trial}: {len(gone)} acknowledged chunks unreadable after")
                engine.close()
                rc, _s, err = d.finish()
                t.check(rc == 0, f"trial {trial}: the daemon stopped with {rc}: {err[-300:]}")
                d = Daemon(path, sock=work / f"d{trial}.sock")  # a restart on the read-only disk
                status = d.call("status")
                t.check(status["store"]["readonly"] is True and status["store"]["tiers"]["nvme"]["chunks"] >= 20,
                        f"trial {trial}: a daemon restarted on the read-only disk does not serve it read-only")
                rc, _s, err = d.finish()
                d = None
                t.check(rc == 0, f"trial {trial}: the restarted daemon stopped with {rc}: {err[-300:]}")
            reads += counts["reads"]
            wrong += counts["wrong"]
            raised += counts["raised"]
            refused += counts["refused"]
            in_flight += counts["eio"]
            other_errors += counts["other"]
        finally:
            if d is not None:
                d.stop()
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mnt)], check=False)
    t.check(wrong == 0 and raised == 0 and other_errors == 0,
            f"readonly: {wrong} reads missed or wrong, {raised} raised; {other_errors} saves failed otherwise")
    t.facts.update(reads=reads, reads_wrong_or_missed=wrong, reads_raised=raised, saves_refused=refused,
                   saves_failed_with_the_disk_error=in_flight, saves_failed_otherwise=other_errors)
    return t
