"""Exceptions of the store library. Every error says what failed and how to fix it."""

from __future__ import annotations

import errno
import os


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class DiskFullError(StoreError):
    """The disk under a tier is full (ENOSPC): the chunks of that write were not stored and
    the space they had reserved was given back."""


class ReadOnlyError(StoreError):
    """Nothing can be written: the store was opened read-only, or the filesystem under its
    index (or under one tier) refuses writes (EROFS: mounted ``ro``, or remounted read-only
    after an error). Reads still work."""


def is_read_only(exc: BaseException) -> bool:
    """Whether ``exc`` says the filesystem refused a write because it is read-only: an OSError
    with EROFS, or an LMDB error (which carries only the system's message)."""
    if isinstance(exc, ReadOnlyError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.EROFS
    return os.strerror(errno.EROFS) in str(exc)


class PinBudgetError(StoreError):
    """A pin would take a tier's pinned bytes over its pin budget."""


class TierNotEmpty(StoreError):
    """A tier that still holds chunks cannot be removed from the settings."""


class IndexWriteError(StoreError):
    """A write transaction of the index failed (nothing of it was committed)."""


class IndexReopened(StoreError):
    """A read transaction was cut short: the index's environment was opened again (read-only,
    after its filesystem went read-only) while it ran. Reading again works."""


class CorruptEntry(StoreError):
    """An index entry that cannot be decoded (LMDB keeps no checksums of its own)."""
