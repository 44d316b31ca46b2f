"""Keeping a store private: owner-only folders and files, and salts kept only as keyed digests.

A store's folder is 0700 and every file in it 0600, whatever the process umask: the index
names models, adapters and labels, and payloads are the prompts' KV. Cache salts (vLLM's
per-request ``cache_salt``, which isolates tenants) are secrets: the index keeps only an
HMAC of each salt under a random key that lives in the index itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Iterable

log = logging.getLogger("lmctl.store")

DIR_MODE = 0o700
FILE_MODE = 0o600
SALT_KEY_BYTES = 32
SALT_DIGEST_BYTES = 16


def salt_digest(key: bytes, salt: str) -> str:
    """Keyed digest (HMAC-SHA256, 128 bits, hex) of a cache salt under a store's salt key."""
    mac = hmac.new(key, b"lmctl/salt/v1\0" + salt.encode(), hashlib.sha256)
    return mac.digest()[:SALT_DIGEST_BYTES].hex()


def make_private_dir(path: str) -> bool:
    """Create ``path`` (and missing parents) with the folder itself 0700; True if it was created.

    The folder is born with at most 0700 (``mkdir`` masks the mode with the umask, which
    can only remove bits) and then set to exactly 0700, so it is never open to others.
    Parents are created like ``mkdir -p`` does. An existing folder is left as it is.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return False
    os.chmod(path, DIR_MODE)
    return True


def _want(st: os.stat_result) -> int | None:
    if stat.S_ISDIR(st.st_mode):
        return DIR_MODE
    if stat.S_ISREG(st.st_mode):
        return FILE_MODE
    return None  # sockets (the daemon's), symlinks and the like are not the store's to change


def _fix(path: str, st: os.stat_result, uid: int, fixed: list[tuple[str, int]]) -> None:
    want = _want(st)
    if want is None or st.st_uid != uid or stat.S_IMODE(st.st_mode) == want:
        return
    try:
        os.chmod(path, want)
    except FileNotFoundError:
        return  # removed meanwhile (another process compacted a segment away)
    except OSError as exc:
        log.warning("cannot make %s private (mode %o): %s", path, stat.S_IMODE(st.st_mode), exc)
        return
    fixed.append((path, stat.S_IMODE(st.st_mode)))


def tighten(root: str, tier_dirs: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Make the store at ``root`` private: every folder in it 0700, every file 0600.

    Only what this process's user owns is changed (root opening another user's store
    changes nothing). Tier folders outside the store get the same treatment for the folder
    itself and its segment files only, never for other files, and never for a shared
    folder (sticky bit, as in /tmp or /dev/shm). Returns the paths changed, with their old
    modes; the caller logs them once.
    """
    uid = os.geteuid()
    fixed: list[tuple[str, int]] = []
    top = os.lstat(root)
    if top.st_uid != uid:
        return fixed
    _fix(root, top, uid, fixed)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            _fix(p, st, uid, fixed)
    real_root = os.path.realpath(root)
    for d in tier_dirs:
        real = os.path.realpath(d)
        if real == real_root or real.startswith(real_root + os.sep):
            continue
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        if not st.st_mode & stat.S_ISVTX:
            _fix(real, st, uid, fixed)
        for name in os.listdir(real):
            if name.startswith("seg-") and name.endswith(".lseg"):
                p = os.path.join(real, name)
                try:
                    _fix(p, os.lstat(p), uid, fixed)
                except FileNotFoundError:
                    continue
    return fixed
