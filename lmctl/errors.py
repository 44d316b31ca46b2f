"""Errors of the daemon's operations, shared by ops, documents and the daemon.

The daemon turns them into error replies: ``UsageError`` -> code ``usage`` (exit 2),
``Cancelled`` -> ``cancelled`` (exit 1), ``Denied`` -> ``denied`` (exit 1), any other
``StoreError`` -> ``failed`` (exit 1).
"""

from __future__ import annotations

from store import StoreError


class UsageError(StoreError):
    """The request is malformed: wrong argument types, unknown names, missing or conflicting
    selectors, a document that is not what its option says."""


class Cancelled(StoreError):
    """The job was cancelled: its client went away (Ctrl-C) or the daemon is stopping."""


class Denied(StoreError):
    """The caller may not do this: a peer of another uid asked for what only the store's owner
    (the daemon's user) or root may do."""
