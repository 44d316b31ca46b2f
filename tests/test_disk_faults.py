"""Disk faults on real file systems: EIO on reads (a FUSE passthrough that fails chosen
reads, tests/faultfs.py), a file system that goes read-only (a loop-mounted ext4), and a
dram tier whose tmpfs is full. Each is misses and counted refusals, never an exception into
an engine and never an exit of the daemon."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import content, key
from faultfs import FaultFS, skip_reason

from store import MiB, Store, StoreConfig, TierConfig

CHUNK = 64 << 10


def segment_of(store: Store, k: bytes) -> tuple[str, int, int]:
    """(segment file name, first byte, end) of ``k``'s record payload."""
    info = store.info(k)
    assert info is not None
    return f"seg-{info.segment:012d}.lseg", info.offset, info.offset + info.stored_bytes


# -- EIO on reads -------------------------------------------------------------------------------
@pytest.fixture
def eio(tmp_path: Path) -> Iterator[tuple[FaultFS, Store]]:
    """A store whose nvme tier lives on a FUSE mount that can fail chosen reads; its index is
    on the ordinary disk."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB, path=str(tmp_path / "mnt" / "nvme"))},
                          segment_bytes=4 * MiB)
        s = Store(tmp_path / "store", cfg)
        try:
            yield fs, s
        finally:
            s.close()


def test_eio_on_a_read_is_a_miss_counted_and_the_chunk_dropped(eio: tuple[FaultFS, Store]) -> None:
    """Today an OSError comes out of ``get`` and ``get_into``."""
    fs, s = eio
    keys = [key(i) for i in range(6)]
    for k in keys:
        assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    bad = {keys[1], keys[4]}
    for k in bad:
        name, a, b = segment_of(s, k)
        fs.fail_reads(f"nvme/{name}", a, b)
    out = np.zeros(CHUNK, dtype=np.uint8)
    for i, k in enumerate(keys):
        got = s.get_into(k, out) if i % 2 else s.get(k)
        if k in bad:
            assert got is None
        else:
            assert got is not None
            data = out.tobytes() if i % 2 else bytes(got.data)  # type: ignore[union-attr]
            assert data == content(k, CHUNK)
    assert fs.read_errors() >= 2
    assert not any(s.contains(k) for k in bad) and all(s.contains(k) for k in set(keys) - bad)
    assert s.event_counters()["corrupt_total"] == {"io-error": 2}
    ev = [e for e in s.events(kinds=["corrupt"])]
    assert [e["reason"] for e in ev] == ["io-error", "io-error"] and "Input/output error" in ev[0]["detail"]
    s.flush()
    cells = {c.labels["reason"]: c.value for c in s.metric_cells() if c.name == "read_failures_total"}
    assert cells == {"io-error": 2}


def test_verify_deep_lists_every_unreadable_chunk_and_fix_drops_them_all(eio: tuple[FaultFS, Store]) -> None:
    """Today the deep pass stops at the first EIO (the OSError comes out of ``check``)."""
    fs, s = eio
    keys = [key(i) for i in range(8)]
    for k in keys:
        assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    bad = {keys[0], keys[3], keys[7]}
    for k in bad:
        name, a, b = segment_of(s, k)
        fs.fail_reads(f"nvme/{name}", a, b)
    found = s.check(deep=True)
    errors = [p for p in found if p.kind == "read-error"]
    assert len(errors) == 3 and all("Input/output error" in p.detail for p in errors)
    assert all(s.contains(k) for k in keys)  # only listed
    fixed = s.check(deep=True, fix=True)
    assert sum(p.kind == "read-error" and p.fixed for p in fixed) == 3
    assert [k for k in keys if s.contains(k)] == [k for k in keys if k not in bad]
    fs.clear_faults()
    assert [p.kind for p in s.check(deep=True) if p.kind != "orphan-file"] == []
    for k in keys:
        c = s.get(k)
        assert (c is None) == (k in bad)


def test_a_transient_eio_of_one_chunk_leaves_the_others_readable(eio: tuple[FaultFS, Store]) -> None:
    fs, s = eio
    keys = [key(i) for i in range(3)]
    for k in keys:
        assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    name, a, b = segment_of(s, keys[1])
    fs.fail_reads(f"nvme/{name}", a, b, times=1)
    assert s.get(keys[1]) is None
    assert [bytes(c.data) for c in map(s.get, (keys[0], keys[2])) if c is not None] == [
        content(keys[0], CHUNK), content(keys[2], CHUNK)]
    # dropped: an engine saves it again, and it reads back
    assert s.put(keys[1], content(keys[1], CHUNK), {"dtype": "uint8"}, tokens=16)
    c = s.get(keys[1])
    assert c is not None and bytes(c.data) == content(keys[1], CHUNK)
    assert os.path.isdir(fs.mountpoint / "nvme")
