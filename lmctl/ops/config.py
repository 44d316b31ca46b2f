"""``config``: the store's settings shown or changed (``set``), pin budgets checked first."""

from __future__ import annotations

import os
from typing import Any

from store import Store, StoreError
from store.config import human_size as human
from store.errors import TierNotEmpty

from ..errors import Denied, UsageError
from ..selection import arg, caller_is_owner, caller_uid
from .base import Job


def check_pin_budgets(store: Store, cfg: Any) -> None:
    """Refuse settings that would leave a tier's pinned chunks over its pin budget."""
    tiers = store.stats().tiers
    for name, t in cfg.tiers.items():
        pinned = tiers[name].pinned_bytes if name in tiers else 0
        if pinned > t.pin_budget_bytes:
            raise UsageError(f"tier {name} holds {human(pinned)} of pinned chunks, over the pin budget of "
                             f"{human(t.pin_budget_bytes)} these settings give; unpin first or give a larger "
                             "capacity or pin budget")


def op_config(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Show the store's settings, or change some (``set``: {KEY: VALUE}), validated first."""
    from ..settings import apply_settings, owner_only, settings_json

    changes = arg(args, "set", dict, {})
    reserved = [] if caller_is_owner() else owner_only(changes)
    if reserved:
        uid = caller_uid()
        who = "a peer of unknown uid" if uid is None else f"uid {uid}"
        raise Denied(f"{who} may not change {', '.join(reserved)}: settings that make the daemon "
                     f"read a file or connect somewhere are for the store's owner (uid {os.geteuid()}) or root "
                     "to change; ask them, or run lmctl config set as that user")
    dry_run = arg(args, "dry_run", bool, False)
    if changes:
        try:
            cfg = apply_settings(store.config, changes)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
        check_pin_budgets(store, cfg)
        if dry_run:
            try:
                plan = store.eviction_plan(cfg)
            except StoreError as exc:
                raise UsageError(str(exc)) from None
            return {"settings": settings_json(cfg), "changed": sorted(changes), "dry_run": True,
                    "evicts": {name: {"chunks": len(victims), "bytes": sum(b for _k, b in victims), "moves_to": to,
                                      "capacity_before": store.config.tiers[name].capacity,
                                      "capacity": cfg.tiers[name].capacity}
                               for name, (victims, to) in plan.items()}}
        try:
            store.configure(cfg)
        except TierNotEmpty as exc:  # refused as a bad value is: nothing changed
            raise UsageError(str(exc)) from None
    elif dry_run:
        raise UsageError("--dry-run goes with config set KEY=VALUE...")
    # what the operator should know of the tiers just changed (a dram tier on disk, say)
    tiers = {str(k).split(".")[1] for k in changes if str(k).startswith("tiers.")}
    notes = [n for n in store.notes() if any(n.startswith(f"tier {t}'s ") for t in tiers)]
    return {"settings": settings_json(store.config), "changed": sorted(changes), "notes": notes}
