"""Durations as operators write them (``90s``, ``30m``, ``12h``, ``7d``, ``2w``).

Kept free of heavy imports: the CLI parses ``--older-than`` with it, the daemon's settings
parse ``retire_after_s`` and friends.
"""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"`` or ``"2w"``; ValueError otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration like 90s, 30m, 12h or 7d")
    secs = float(m.group(1)) * _SECONDS[m.group(2)]
    if secs == float("inf"):  # 400 digits make a float that is no duration
        raise ValueError(f"{text.strip()[:40]!r} is too long a duration")
    return secs
