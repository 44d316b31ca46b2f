"""Crash safety and several processes on one store (real processes, real SIGKILL)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, assert_counts_match, content, env_with_path, key

from store import GiB, MiB, Store, StoreConfig, TierConfig

WRITER = str(ROOT / "tests" / "proc_writer.py")


def spawn(path: Path, start: int, count: int, size: int, capacity: int, mode: str = "loop") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WRITER, str(path), str(start), str(count), str(size), str(capacity), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with_path(),
    )


def assert_store_sound(path: Path, acked: set[int], size: int) -> Store:
    store = Store(path)  # reopening runs recovery
    problems = [p for p in store.check(deep=True) if not p.fixed]
    assert problems == [], problems
    stored = 0
    for info in store.iter_chunks():
        c = store.get(info.key)
        assert c is not None, "an indexed chunk failed to read"
        assert bytes(c.data) == content(info.key, size), "wrong bytes served"
        stored += 1
    for i in acked:  # every acknowledged put survived the crash
        assert store.contains(key(i)), f"acknowledged chunk {i} was lost"
    assert stored >= len(acked), "fewer chunks are listed than were acknowledged"
    assert stored == store.stats().tiers["nvme"].chunks, "the chunk counter differs from the index"
    assert_counts_match(store)  # the per-namespace counts too, after the crash and recovery
    return store


def disk_usage(store: Store) -> int:
    d = Path(store.path) / "nvme"
    return sum(p.stat().st_size for p in d.iterdir() if p.name.endswith(".lseg"))


@pytest.mark.parametrize("mode", ["die-after-write", "die-mid-write"])
def test_kill_between_payload_and_index_commit(tmp_path: Path, mode: str) -> None:
    size = 256 << 10
    p = spawn(tmp_path / "s", 0, 10, size, 1 * GiB, mode)
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, err
    acked = {int(line.split()[1]) for line in out.splitlines()}
    assert acked == {0, 1}
    store = assert_store_sound(tmp_path / "s", acked, size)
    assert not store.contains(key(2))  # written but never indexed: invisible
    st = store.stats().tiers["nvme"]
    # recovery cut the unindexed tail: the disk holds exactly what the index counts
    assert disk_usage(store) == st.disk_bytes == st.bytes + 4096
    # and the store keeps working where the writer left off
    assert store.put(key(2), content(key(2), size), {"dtype": "uint8"})
    store.close()
    store = assert_store_sound(tmp_path / "s", acked | {2}, size)
    store.close()


def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    size = 2 << 20
    rng = random.Random(1234)
    acked: set[int] = set()
    nxt = 0
    for _round in range(4):
        p = spawn(tmp_path / "s", nxt, 10_000, size, 64 * MiB)
        assert p.stdout is not None
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 3 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            acked.add(int(line.split()[1]))
            seen += 1
        time.sleep(rng.uniform(0.0, 0.05))
        p.send_signal(signal.SIGKILL)
        rest, _ = p.communicate(timeout=60)
        acked |= {int(x.split()[1]) for x in rest.splitlines()}
        assert seen == 3, "writer did not start"
        nxt = max(acked) + 1
        store = Store(tmp_path / "s")
        # the writer evicts (capacity 64 MiB): only the still-stored acked chunks must be intact
        present = {i for i in acked if store.contains(key(i))}
        assert present, "nothing survived"
        store.close()
        store = assert_store_sound(tmp_path / "s", present, size)
        store.compact(min_dead_ratio=0.0)
        st = store.stats().tiers["nvme"]
        assert disk_usage(store) == st.disk_bytes <= 64 * MiB
        assert st.dead_bytes == 0  # all space of torn writes reclaimed
        store.close()


def test_writer_and_reader_processes_at_once(tmp_path: Path) -> None:
    size = 512 << 10
    path = tmp_path / "s"
    Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=48 * MiB)}, segment_bytes=2 * MiB)).close()
    p = spawn(path, 0, 400, size, 48 * MiB)  # evicts and compacts as it goes
    assert p.stdout is not None
    acked: list[int] = []
    lock = threading.Lock()

    def pump() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            with lock:
                acked.append(int(line.split()[1]))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    reader = Store(path)
    reads = wrong = 0
    rng = random.Random(7)
    deadline = time.monotonic() + 90
    while p.poll() is None and time.monotonic() < deadline:
        with lock:
            pool = acked[-40:]
        if not pool:
            time.sleep(0.01)
            continue
        k = key(rng.choice(pool))
        c = reader.get(k)
        if c is not None:
            reads += 1
            wrong += bytes(c.data) != content(k, size)
        if reads % 25 == 0:
            reader.compact()  # a third party compacting while the writer writes
    p.wait(timeout=60)
    t.join(timeout=10)
    assert p.returncode == 0, p.stderr.read() if p.stderr else ""
    assert wrong == 0
    assert reads > 20
    assert reader.stats().counters["corrupt"] == 0
    reader.close()
    store = assert_store_sound(path, set(), size)
    assert store.stats().tiers["nvme"].disk_bytes <= 48 * MiB
    store.close()
