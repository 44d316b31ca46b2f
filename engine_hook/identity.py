"""Who produced a KV chunk: adapter identities, hashed once per folder (``AdapterCache``).

Pure Python (no torch, no vllm), so the CLI and the daemon can use it too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from store import AdapterIdentity, StoreError, adapter_digest


def _signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(relative path, size, mtime) of every file in the folder: cheap to take, and it
    changes whenever a file is rewritten, added or removed."""
    out = []
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out.append((os.path.relpath(p, folder), st.st_size, st.st_mtime_ns))
    out.sort()
    return tuple(out)


class AdapterCache:
    """Adapter name + folder -> ``AdapterIdentity``, hashing each folder's files once.

    The digest is recomputed only when the folder's file listing, sizes or mtimes
    change, so a same-name adapter whose weights were replaced gets a new identity
    while an unchanged one costs a few ``stat`` calls per request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], tuple[tuple[tuple[str, int, int], ...], AdapterIdentity]] = {}

    def identity(self, name: str, folder: str | os.PathLike[str]) -> AdapterIdentity:
        path = Path(folder).resolve()
        if not path.is_dir():
            raise StoreError(f"adapter {name!r}: folder {str(path)!r} does not exist")
        sig = _signature(path)
        key = (name, str(path))
        with self._lock:
            got = self._cache.get(key)
            if got is not None and got[0] == sig:
                return got[1]
        ident = AdapterIdentity(name, adapter_digest(path))
        with self._lock:
            self._cache[key] = (sig, ident)
        return ident
