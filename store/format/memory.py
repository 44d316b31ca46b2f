"""Host memory that the disk reads into and writes from at its best.

An O_DIRECT request is a scatter list of the destination's physical pages, and a block
device takes a bounded number of segments per request (``max_segments``; 254 on the disk
these figures come from). With 4 KiB pages that caps a request near 1 MiB, so a 32 MiB
chunk goes out as dozens of requests; with 2 MiB pages, as a few requests of the device's
largest size. Measured on one disk, one process, interleaved (docs/performance.md): cold
O_DIRECT reads of 32 MiB chunks into huge pages ran at 1.05-1.15x the speed of a region
of small pages written in order, and up to 1.9x that of buffers mapped one by one.

``huge_region`` asks the kernel for transparent huge pages (``MADV_HUGEPAGE``: honoured
when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``, the
usual default); where it is not honoured the region is ordinary memory, written in order,
which is the next best thing. Nothing here is on a hot path: regions are made once and
reused.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


class Region:
    """One anonymous mapping, its usable part aligned to a huge page, every page written
    once (so that the first request into it pays no page faults). ``view`` is the usable
    part; keep the ``Region`` alive as long as any view of it is used."""

    def __init__(self, nbytes: int, huge: bool = True) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0))
        self.huge = False
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:  # not offered by this kernel: small pages, written in order
                pass
        base = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        skip = (-base) % HUGE_PAGE if huge else 0
        self.view = memoryview(self._map)[skip : skip + nbytes]
        np.frombuffer(self.view, dtype=np.uint8)[:] = 0  # every page faulted in, in order

    def slices(self, size: int, count: int, align: int = 4096) -> list[memoryview]:
        """``count`` buffers of ``size`` bytes, each starting on an ``align`` boundary."""
        stride = (size + align - 1) // align * align
        if stride * count > self.nbytes:
            raise ValueError(f"{count} buffers of {size} bytes do not fit a region of {self.nbytes}")
        return [self.view[i * stride : i * stride + size] for i in range(count)]


def huge_region(size: int, count: int, align: int = 4096) -> tuple[Region, list[memoryview]]:
    """A region for ``count`` buffers of ``size`` bytes and the buffers carved from it."""
    stride = (size + align - 1) // align * align
    region = Region(stride * count)
    return region, region.slices(size, count, align)
