"""Durations as operators write them: ``90s``, ``30m``, ``12h``, ``7d``, ``2w``, ``1.5h`` and
compounds such as ``1h30m`` or ``1d12h`` (as systemd and Go read them).

A bare number has no unit, and the CLI refuses it as it refuses a size without one
(``unit_required``): ``--older-than 7`` is far more likely to mean seven days than seven
seconds. Kept free of heavy imports: the CLI parses ``--older-than`` and ``--since`` with
it, the daemon's settings parse ``retire_after_s`` and friends.
"""

from __future__ import annotations

import math
import re

#: seconds per unit
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_BARE = re.compile(r"\d+(?:\.\d+)?")
EXAMPLES = "90s, 30m, 12h, 7d or 1h30m"


def parse_duration(text: str, unit_required: bool = False) -> float:
    """Seconds from a duration (see the module); a bare number is seconds unless
    ``unit_required``. ValueError, with the message to show, otherwise."""
    t = text.strip().lower().replace(" ", "")
    if _BARE.fullmatch(t):
        if unit_required:
            n = t if len(t) <= 20 else t[:12] + "..."
            raise ValueError(f"{n!r} has no unit: write {n}d, {n}h, {n}m or {n}s")
        return float(t)
    parts = _PART.findall(t)
    units = [u for _n, u in parts]
    if not t or "".join(n + u for n, u in parts) != t:
        raise ValueError(f"{text!r} is not a duration like {EXAMPLES}")
    if len(set(units)) != len(units) or units != sorted(units, key=lambda u: -SECONDS[u]):
        raise ValueError(f"{text!r} is not a duration like {EXAMPLES}: give each unit once, the largest first")
    seconds = sum(float(n) * SECONDS[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"{text.strip()[:40]!r} is too long a duration")
    return seconds


def format_duration(seconds: float) -> str:
    """Seconds as an operator writes them: ``1h``, ``7d``, ``90s``, ``0.05s`` (``parse_duration``
    reads each back)."""
    for unit in ("d", "h", "m"):
        n = SECONDS[unit]
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:g}{unit}"
    return f"{seconds:g}s"
