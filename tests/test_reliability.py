"""Reliability on an operator's bad day: a disk that fills up under the store."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import content

from store import DiskFullError, KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 85 MB ext4 filesystem, loop-mounted (needs root and loop devices)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to mount a small filesystem")
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "85M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount a filesystem here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def on_disk(store: Store) -> int:
    d = Path(store.path) / "nvme"
    return sum(p.stat().st_size for p in d.glob("seg-*.lseg"))


def test_a_full_disk_costs_misses_never_the_cached_chunks(small_disk: Path) -> None:
    """The tier's capacity (320 MiB) is larger than its disk (85 MB). Before, each failed
    batch kept its reserved space in the index; that phantom usage then evicted every real
    chunk. Now a failed write gives its space back, raises DiskFullError, and evicts nothing."""
    fmt = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=1, chunk_size=16)
    ns = Namespace("m", fmt)
    size = 2 << 20
    keys = ns.chunk_keys(list(range(16 * 200)))
    store = Store(small_disk / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=320 * MiB)},
                                                 segment_bytes=16 * MiB))
    acked: list[bytes] = []
    fulls = 0
    fds: list[int] = []
    for k in keys:
        try:
            assert store.put(k, content(k, size), {"dtype": "uint8"}, tokens=16)
            acked.append(k)
        except DiskFullError as exc:
            assert "is full" in str(exc) and "nvme" in str(exc)
            fulls += 1
            fds.append(len(os.listdir("/proc/self/fd")))
            if fulls >= 20:
                break
    assert fulls == 20 and len(acked) > 20
    assert fds[-1] <= fds[1]  # failed writes and segment creations leak no file descriptors
    st = store.stats()
    assert st["counters"]["evicted"] == 0  # no phantom usage drove eviction
    assert st["tiers"]["nvme"]["disk_bytes"] == on_disk(store)  # the index counts what is on disk
    assert store.locate(acked) == ["nvme"] * len(acked)
    for k in acked[:: max(1, len(acked) // 8)]:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, size)
    # space comes back: saving resumes
    store.evict(acked[: len(acked) // 2])
    store.compact(min_dead_ratio=0.0)
    assert store.put(keys[-1], content(keys[-1], size), {"dtype": "uint8"}, tokens=16)
    assert [p for p in store.check(deep=True) if not p.fixed] == []
    assert store.stats()["tiers"]["nvme"]["disk_bytes"] == on_disk(store)
    store.close()
    # and a reopened store agrees
    with Store(small_disk / "s") as again:
        assert [p for p in again.check(deep=True) if not p.fixed] == []
        assert again.stats()["tiers"]["nvme"]["disk_bytes"] == on_disk(again)
