"""What the operations share: the ``Job`` an operation tells its client through while it runs, the
scope of a selection by filters, a chunk's names in a manifest."""

from __future__ import annotations

from typing import Any

from store import Namespace, Store

from ..selection import Scope, check_conflicts, filters_of, scope_of, select


class Job:
    """What an operation may tell its client while it runs. The daemon's job raises
    ``Cancelled`` from ``progress`` when the client went away or the daemon is stopping, so
    a long operation stops between two chunks (each chunk's change is atomic)."""

    def progress(self, done: int, total: int, what: str) -> None:
        return

    def emit(self, rows: list[dict[str, Any]], into: str = "chunks") -> None:
        """Stream part of a listing (``ls``, ``evict --dry-run``); the client appends it to the
        result's list ``into``."""
        raise NotImplementedError


#: the largest --limit a listing takes (0 means all)
MAX_LIMIT = 1 << 40


def filter_scope(store: Store, args: dict[str, Any]) -> Scope | None:
    """The scope of an evict or ls by filters (None: a document or explicit keys alone, which
    are resolved to their keys as given)."""
    check_conflicts(args)
    if args.get("doc") is not None or (args.get("keys") and not filters_of(args)):
        return None
    only = select(store, {"keys": args["keys"]}).keys if args.get("keys") else None
    return scope_of(store, args, only)


def names_of(ns: Namespace | None, label: str | None) -> dict[str, Any]:
    """The ``label``, ``model`` and ``adapter`` fields of a keys entry of manifest."""
    entry: dict[str, Any] = {} if label is None else {"label": label}
    if ns is not None:
        entry["model"] = ns.model
        if ns.adapter is not None:
            entry["adapter"] = str(ns.adapter)
    return entry
