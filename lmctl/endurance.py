"""Admission and the nvme tier's write budget in ``lmctl status``: what the daemon puts in its
reply (``store.tiers.admission``, ``store.ops.writes``, ``store.warnings``) and the lines the CLI shows
of it. Kept free of heavy imports (the CLI starts without the store library)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .terminal import human

if TYPE_CHECKING:
    from store import Store


def endurance(store: Store) -> dict[str, Any]:
    """The status reply's part: the ``admit`` setting and what it kept off NVMe, the bytes each
    counted tier (nvme) wrote against its budget, and the warnings (on course to exceed it)."""
    rates = store.write_rates()
    return {"admission": store.admission_stats(), "writes": {t: r.to_dict() for t, r in rates.items()},
            "warnings": store.warnings(rates)}


def endurance_lines(s: dict[str, Any]) -> list[str]:
    """``lmctl status``'s lines for the store part ``s`` of a status reply (nothing from a daemon
    of an older lmctl, which sends none of it)."""
    out = []
    adm = s.get("admission")
    if adm and (adm.get("admit") != "all" or any((adm.get("not_admitted") or {}).values())):
        n, b = adm.get("not_admitted") or {}, adm.get("not_admitted_bytes") or {}
        out.append(f"admission: {adm['admit']} (ghost list {adm['ghosts']} of {adm['ghosts_max']} keys); kept off "
                   f"nvme: {n.get('put', 0)} first saves ({human(b.get('put', 0))}), {n.get('spill', 0)} chunks "
                   f"leaving dram ({human(b.get('spill', 0))})")
    for tier, w in sorted((s.get("writes") or {}).items()):
        span = w["window_s"]
        seen = f"{span / 3600:.1f} h" if span >= 3600 else f"{span / 60:.0f} min" if span >= 60 else f"{span:.0f} s"
        line = (f"{tier} writes: {human(w['written_24h_bytes'])} in the last {seen}, "
                f"{human(w['per_day_bytes'])}/day projected, {human(w['written_bytes'])} in all")
        if w.get("budget_bytes_per_day") is not None:
            line += f"; budget {human(w['budget_bytes_per_day'])}/day ({w['budget']})"
            line += ", OVER" if w.get("over_budget") else ""
        out.append(line)
    out += [f"warning: {w}" for w in s.get("warnings") or []]
    return out
