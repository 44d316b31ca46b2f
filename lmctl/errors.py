"""Errors of the daemon and its operations, shared by ops, documents and the daemon.

They are lmctl's, not the store's: ``LmctlError`` is their base, beside ``store.StoreError``
(what the store raises). The daemon turns them into error replies: ``UsageError`` -> code
``usage`` (exit 2), ``Cancelled`` -> ``cancelled`` (exit 1), ``Denied`` -> ``denied`` (exit 1);
a ``StoreError`` -> ``failed`` (exit 1).
"""

from __future__ import annotations


class LmctlError(Exception):
    """A request the daemon refuses or stops, or a daemon that cannot start: the error's class
    says which, and each has its reply code."""


class UsageError(LmctlError):
    """The request is malformed: wrong argument types, unknown names, missing or conflicting
    selectors, a document that is not what its option says."""


class Cancelled(LmctlError):
    """The job was cancelled: its client went away (Ctrl-C) or the daemon is stopping."""


class Denied(LmctlError):
    """The caller may not do this: a peer of another uid asked for what only the store's owner
    (the daemon's user) or root may do."""
