"""Pins: labelled promises that chunks are never evicted, within each tier's pin budget.

A key may be pinned before it is stored (an operator pins a document, an engine saves
it later): until it arrives it reserves its expected size against the budget of the
default tier. Pins are kept in the index and in the metadata journal; a pin or unpin is
synced to the index's disk (and then to the journal's) before it returns, so an
acknowledged one survives a power cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config import StoreConfig, human_size
from ..errors import PinBudgetError, StoreError
from ..format.keys import KEY_BYTES
from ..index import Index, Txn
from ..index.schema import label_key
from ..tiers.space import TierState


class _RolledBack(Exception):
    """Raised inside a write transaction to abort it (a dry run) and carry its result out."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class Pins:
    """The ``pins`` (per key) and ``labels`` (per label and key) sub-databases."""

    def __init__(self, index: Index, tiers: dict[str, TierState], config: Callable[[], StoreConfig],
                 journal_add: Callable[..., None]) -> None:
        self.index = index
        self.tiers = tiers
        self._config = config
        self._journal_add = journal_add

    def pin(self, label: str, keys: Sequence[bytes], expected_bytes: int = 0, dry_run: bool = False,
            journal: bool = True, uid: int | None = None) -> int:
        """See ``Store.pin``."""
        if not label or "\0" in label:
            raise StoreError("a pin label must be a non-empty string without NUL")
        lb = label.encode()
        budget_tier = self._config().default_tier

        def fn(t: Txn) -> int:
            added = 0
            for key in keys:
                if len(key) != KEY_BYTES:
                    raise StoreError(f"chunk key must be {KEY_BYTES} bytes")
                added += t.pin_label(lb, key, expected_bytes)
            for tname, st in self.tiers.items():
                pinned = t.counter(f"pinned:{tname}")
                if tname == budget_tier:
                    pinned += t.counter("pin_reserved")
                if pinned > st.cfg.pin_budget_bytes:
                    raise PinBudgetError(
                        f"pin {label!r} would put {human_size(pinned)} pinned in tier {tname}, over its pin "
                        f"budget of {human_size(st.cfg.pin_budget_bytes)}; unpin something or raise the budget")
            if dry_run:
                raise _RolledBack(added)
            if added and journal:  # not when restored from the journal: that pin was logged when made
                t.event("pin", "operator", chunks=added, label=label, uid=uid)
            return added

        try:
            added = self.index.write(fn, durable=True)
        except _RolledBack as rb:
            return rb.value
        if added and journal:
            self._journal_add("pin", label=label, keys=[k.hex() for k in keys], expected=int(expected_bytes))
        return added

    def unpin(self, label: str, keys: Sequence[bytes] | None = None, uid: int | None = None) -> int:
        """See ``Store.unpin``."""
        lb = label_key(label.encode())

        def fn(t: Txn) -> int:
            if keys is None:
                targets = [k[len(lb):] for k in t.keys("labels", lb)]
            else:
                targets = list(keys)
            removed = 0
            for key in targets:
                removed += t.unpin_label(label.encode(), key)
            if removed:
                t.event("unpin", "operator", chunks=removed, label=label, uid=uid)
            return removed

        removed = self.index.write(fn, durable=True)
        if removed:
            self._journal_add("unpin", label=label, keys=None if keys is None else [k.hex() for k in keys])
        return removed

    def refs(self, key: bytes) -> int:
        with self.index.read() as t:
            return t.pin(key)[0]

    def label_page(self, label: str, after: bytes = b"", limit: int = 512) -> list[bytes]:
        """Up to ``limit`` keys pinned under ``label`` after ``after``, in key order (one short
        read transaction: a listing pages through a label without holding a snapshot)."""
        lb = label_key(label.encode())
        out: list[bytes] = []
        with self.index.read() as t:
            for k in t.keys("labels", lb, start=lb + after):
                if len(out) >= limit:
                    break
                key = k[len(lb):]
                if key != after:
                    out.append(key)
        return out

    def labels_of(self, key: bytes) -> list[str]:
        """The labels that pin ``key``, sorted (through ``keylabels``; a store of format 1
        opened read-only has none, and its labels are searched instead)."""
        if not self.index.has_counts:
            return sorted(label for label, keys in self.labels().items() if key in set(keys))
        with self.index.read() as t:
            return sorted(b.decode(errors="replace") for b in t.labels_of(key))

    def labels(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        with self.index.read() as t:
            for k in t.keys("labels"):
                label, _, key = k.partition(b"\0")
                out.setdefault(label.decode(), []).append(key)
        return out
