"""One ``Store`` per store folder per process, shared by everyone in that process.

LMDB must not be opened twice in one process, and an engine opens the store from
several places (vLLM's scheduler-side and worker-side connectors live in the same
process with one GPU). ``open_shared`` hands out one refcounted instance per folder.
"""

from __future__ import annotations

import os
import threading

from .config import StoreConfig
from .store import Store

_lock = threading.Lock()
_open: dict[str, tuple[Store, int]] = {}


def open_shared(path: str | os.PathLike[str], config: StoreConfig | None = None) -> Store:
    """The process's store at ``path``, opened on first use. ``config`` applies only then;
    later callers get the store as it is. On a read-only filesystem it is opened read-only
    (``Store.readonly``): an engine keeps its hits. Give it back with ``release_shared``."""
    real = os.path.realpath(os.fspath(path))
    with _lock:
        got = _open.get(real)
        if got is not None and got[0]._closed:
            got = None
        if got is None:
            store = Store(real, config, fallback_readonly=True)  # a read-only disk still serves hits
            _open[real] = (store, 1)
            return store
        _open[real] = (got[0], got[1] + 1)
        return got[0]


def release_shared(store: Store) -> None:
    """Drop one reference; the last one closes the store."""
    with _lock:
        for real, (s, refs) in list(_open.items()):
            if s is store:
                if refs <= 1:
                    del _open[real]
                    s.close()
                else:
                    _open[real] = (s, refs - 1)
                return
    store.close()
