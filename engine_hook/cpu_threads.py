"""Keep the connector's own threads out of the engine's OpenMP thread count.

A CPU engine runs its forward pass on an OpenMP team as wide as the cores it was given, and
that team's threads spin between parallel regions instead of sleeping: that is much of its
speed. GNU OpenMP spins only while the threads it manages are no more than the CPUs; once
there are more, every team falls back to a short spin and sleeps on a futex between
regions. A torch CPU op on any other thread that runs in parallel (a scatter of a chunk
into the paged cache is one) gives that thread a team of its own, for as long as it lives:
one load on a loader thread was enough to slow every later forward pass of a 2-core engine
by 10-20% (issue 23, the steady state).

``serial_torch`` makes the calling thread run its torch CPU ops on itself alone, without
touching the engine's threads: OpenMP's thread count is a per-thread setting, set here
through the OpenMP runtimes loaded in the process (torch's ``set_num_threads`` would also
change a process-wide default that threads started later take). The connector's
threads call it first thing; with no OpenMP runtime loaded (a CUDA-only path, another
platform) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("lmctl.engine_hook")

#: the file names of the OpenMP runtimes torch builds use (GNU, LLVM, Intel)
_RUNTIMES = ("libgomp", "libomp", "libiomp5")
_libs: list[ctypes.CDLL] | None = None


def _runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes mapped into this process (each once), found by name."""
    global _libs
    if _libs is None:
        paths: set[str] = set()
        try:
            with open(f"/proc/{os.getpid()}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith("/") and os.path.basename(path).startswith(_RUNTIMES):
                        paths.add(path)
        except OSError:
            pass
        libs = []
        for path in sorted(paths):
            try:  # the library is already loaded: this opens the same copy, loads nothing new
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                libs.append(lib)
            except (OSError, AttributeError):
                continue
        _libs = libs
    return _libs


def serial_torch() -> None:
    """Run the calling thread's torch CPU ops on this thread alone (see the module's doc);
    other threads keep their own setting."""
    try:
        import torch

        # torch sets each thread's OpenMP count from its process-wide default the first
        # time the thread asks: ask first, so that the setting below is not undone
        torch.get_num_threads()
        for lib in _runtimes():
            lib.omp_set_num_threads(1)
    except Exception:  # a figure of speed, never a reason to fail a load or a save
        log.debug("lmctl: could not keep a thread's torch ops serial", exc_info=True)
