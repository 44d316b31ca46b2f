"""Exceptions of the store library. Every error says what failed and how to fix it."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class DiskFullError(StoreError):
    """The disk under a tier is full (ENOSPC): the chunks of that write were not stored and
    the space they had reserved was given back."""


class PinBudgetError(StoreError):
    """A pin would take a tier's pinned bytes over its pin budget."""


class IndexWriteError(StoreError):
    """A write transaction of the index failed (nothing of it was committed)."""


class CorruptEntry(StoreError):
    """An index entry that cannot be decoded (LMDB keeps no checksums of its own)."""
