"""How records lie on the disk: a record's pieces go out in parallel, and the file system must
not scatter it (``store.format.segment.reserve``); buffers the disk reads into sit on huge pages
where the kernel gives them (``store.format.memory``)."""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

import numpy as np

from store import GiB, MiB, PutItem, Store, StoreConfig, TierConfig
from store.format.memory import HUGE_PAGE, Region, huge_region

FS_IOC_FIEMAP = 0xC020660B
_FIEMAP = struct.Struct("=QQIIII")  # start, length, flags, mapped extents, extent count, reserved
FIEMAP_FLAG_SYNC = 1


def extents(path: Path) -> int:
    """The extents the file system maps ``path`` to (FIEMAP, as filefrag counts them)."""
    with open(path, "rb") as f:
        req = bytearray(_FIEMAP.pack(0, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, 0, 0))
        fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, req)
        return _FIEMAP.unpack_from(req)[3]


def test_a_batch_of_large_records_is_not_scattered_over_the_disk(tmp_path: Path) -> None:
    size = 32 * MiB  # four 8 MiB pieces each, written in parallel
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=4 * GiB)}, segment_bytes=1 * GiB, codec="raw")
    region, bufs = huge_region(size, 4)
    for i, b in enumerate(bufs):
        np.frombuffer(b, dtype=np.uint8)[:] = i + 1
    with Store(tmp_path / "s", cfg) as st:
        for batch in range(2):
            items = [PutItem(bytes([batch, j]) * 24, bufs[j], {"dtype": "uint8", "shape": [size]}, 256)
                     for j in range(4)]
            assert all(st.put_many(items))
    segs = [p for p in (tmp_path / "s").rglob("seg-*") if p.stat().st_size > MiB]
    n = sum(extents(p) for p in segs)
    # eight records (and the segments' headers); scattered, they took 3-4 extents each
    # (about 27 in all here without reserving)
    assert n <= 8 + len(segs), f"{n} extents for 8 records of 32 MiB"
    del region


def test_a_reservation_keeps_the_size_and_holds_the_blocks(tmp_path: Path) -> None:
    from store.format.segment import reserve

    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reserve(fd, 0, 8 * MiB)
        st = os.fstat(fd)
        assert st.st_size == 0
        assert st.st_blocks * 512 >= 8 * MiB
        reserve(-1, 0, 4096)  # a hint: a bad descriptor is not an error
    finally:
        os.close(fd)


def test_regions_are_aligned_written_and_carved_without_overlap() -> None:
    r = Region(3 * HUGE_PAGE)
    base = np.frombuffer(r.view, dtype=np.uint8).ctypes.data
    assert base % HUGE_PAGE == 0 and len(r.view) == 3 * HUGE_PAGE
    views = r.slices(5000, 4)
    addrs = [np.frombuffer(v, dtype=np.uint8).ctypes.data for v in views]
    assert all(a % 4096 == 0 for a in addrs) and addrs == sorted(set(addrs))
    assert all(b - a >= 5000 for a, b in zip(addrs, addrs[1:], strict=False))
    views[1][:] = b"\x07" * 5000
    assert bytes(views[0][:1]) == b"\0" and bytes(views[2][:1]) == b"\0"
    try:
        r.slices(HUGE_PAGE, 4)
    except ValueError as exc:
        assert "do not fit" in str(exc)
    else:
        raise AssertionError("four huge pages carved from three")
