"""A writer process for crash and concurrency tests (run as a script).

usage: proc_writer.py STORE START COUNT SIZE CAPACITY [MODE]
MODE: "loop" (default), "die-after-write" (SIGKILL itself right after writing the
payload of the 3rd chunk, before its index commit) or "die-mid-write" (after half of it).
Prints "put I" after each acknowledged put.
"""

from __future__ import annotations

import os
import signal
import sys

# run as a script: its folder (tests/) is first on the path, this checkout on PYTHONPATH
from conftest import content, key

from store import Store, StoreConfig, TierConfig
from store.format.segment import SegmentIO


def main() -> None:
    path, start, count, size, capacity = sys.argv[1], *map(int, sys.argv[2:6])
    mode = sys.argv[6] if len(sys.argv) > 6 else "loop"
    if mode.startswith("die"):
        real = SegmentIO.start_write
        calls = {"n": 0}

        def faulty(self, fd, offset, payload, make_header):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 3:
                if mode == "die-mid-write":
                    # half the payload reached the disk, the header block (written last) did not
                    half = memoryview(payload)[: len(memoryview(payload)) // 2]
                    real(self, fd, offset, half, lambda c: bytes(4096)).result()
                else:
                    real(self, fd, offset, payload, make_header).result()
                os.fsync(fd)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, fd, offset, payload, make_header)

        SegmentIO.start_write = faulty  # type: ignore[method-assign]
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=capacity)}, segment_bytes=max(64 << 10, size * 4))
    store = Store(path, cfg)
    for i in range(start, start + count):
        k = key(i)
        store.put(k, content(k, size), {"dtype": "uint8"}, tokens=256)
        print(f"put {i}", flush=True)
    store.close()


if __name__ == "__main__":
    main()
