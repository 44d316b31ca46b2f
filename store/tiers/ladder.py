"""The tier ladder: the tiers a store has, top (fastest) to bottom, as one ordered list.

The local tiers come in ``TIER_ORDER`` (dram, then nvme), the shared remote tier last (the
tier list is declared once, in store/config.py). Moves follow the ladder: a chunk evicted from
a local tier spills one rung down (dram to nvme; from the last local tier to the remote tier
when its write policy is ``evict``), and a chunk read from a lower rung is promoted to the top
one. The ladder reads the store's tiers as they are now, so a ``configure`` that adds or
removes a tier changes it at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..config import TIER_ORDER

if TYPE_CHECKING:
    from .sharing import Sharing
    from .space import TierState


class Ladder:
    """The store's tiers in order: its local tiers (``local``, by name) and its remote tier
    (``remote()``: None when it has none, or it did not start)."""

    def __init__(self, local: Mapping[str, TierState], remote: Callable[[], Sharing | None]) -> None:
        self._local = local
        self.remote = remote

    def local(self) -> list[str]:
        """The local tiers the store has, top to bottom."""
        return [n for n in TIER_ORDER if n in self._local]

    def top(self) -> str | None:
        """The highest local tier: where a promoted chunk goes (None: no local tier)."""
        local = self.local()
        return local[0] if local else None

    def local_below(self, name: str) -> str | None:
        """The next local tier under ``name``: where its evicted chunks spill (None: it is the
        last local tier, or not one of the store's)."""
        under = self.from_(name)[1:]
        return under[0] if under else None

    def from_(self, first: str) -> list[str]:
        """``first`` and the local tiers under it, top to bottom (``[first]`` if it is not one)."""
        local = self.local()
        return local[local.index(first):] if first in local else [first]

    def spills(self) -> bool:
        """Whether an evicted chunk goes somewhere first: to a local tier below its own, or to
        the remote tier when its write policy is ``evict``."""
        remote = self.remote()
        return (remote is not None and remote.cfg.write == "evict") or len(self.local()) > 1
