"""Load or recompute: how much of a stored prefix is worth loading (no torch, no vllm).

A hit is not always a win: on a slow tier and a fast accelerator, reading a prefix can
take longer than computing it again. ``LoadPolicy`` decides per request from figures it
observes while the engine runs:

* each tier's load speed: the workers report the bytes and seconds of every chunk they
  load (read, verified, scattered), kept as a moving average per tier;
* the engine's prefill speed: seconds per prompt token of the steps that computed a
  prefill, kept per context length (powers of two), since attention makes later tokens
  of a long prompt dearer than early ones.

For a prefix of ``n`` stored tokens it loads the leading chunks ``[0, m)`` and recomputes
the rest, choosing ``m`` where the predicted time is least. Until both figures exist it
loads (the cache's usual win). ``load_policy``: ``auto`` decides so, ``always`` loads
every hit, ``never`` loads nothing (saves still happen).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("lmctl.engine_hook")

POLICIES = ("auto", "always", "never")
#: weight of a new observation in the moving averages
ALPHA = 0.3
#: steps with fewer computed tokens are mostly per-step overhead, not prefill
MIN_PREFILL_TOKENS = 32
#: a tier whose speed was last observed this long ago is loaded from anyway, to observe it
#: again (a disk that was slow may be fast again; without loads nothing would tell)
REFRESH_S = 60.0


def _bucket(context: int) -> int:
    return max(0, math.ceil(math.log2(max(1, context))))


@dataclass
class Decision:
    """What the policy chose for one request: tokens to load of those the store has."""

    stored_tokens: int
    load_tokens: int
    predicted_load_s: float | None = None
    predicted_recompute_s: float | None = None
    reason: str = ""


@dataclass
class LoadPolicy:
    mode: str = "auto"
    load_bps: dict[str, float] = field(default_factory=dict)      # tier -> raw bytes per second
    prefill_spt: dict[int, float] = field(default_factory=dict)   # context bucket -> seconds per token
    decisions: dict[str, int] = field(default_factory=lambda: {"load": 0, "partial": 0, "recompute": 0})
    refresh_s: float = REFRESH_S
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, float] = field(default_factory=dict)   # tier -> when its speed was last observed

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` (chunk bytes) from ``tier`` took ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        bps = nbytes / seconds
        self._seen[tier] = self.clock()
        old = self.load_bps.get(tier)
        self.load_bps[tier] = bps if old is None else (1 - ALPHA) * old + ALPHA * bps

    def observe_prefill(self, tokens: int, seconds: float, context: int) -> None:
        """A step computed ``tokens`` prompt tokens, the longest context being ``context``."""
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        spt = seconds / tokens
        b = _bucket(context)
        old = self.prefill_spt.get(b)
        self.prefill_spt[b] = spt if old is None else (1 - ALPHA) * old + ALPHA * spt

    def _spt(self, context: int) -> float | None:
        """Seconds per token of a prefill at ``context``: the nearest bucket observed."""
        if not self.prefill_spt:
            return None
        b = _bucket(context)
        near = min(self.prefill_spt, key=lambda k: (abs(k - b), -k))
        spt = self.prefill_spt[near]
        # attention grows with context: scale a shorter context's figure up (never down)
        return spt * (2 ** (b - near)) ** 0.5 if near < b else spt

    def decide(self, start: int, stored: int, chunk_size: int, chunk_bytes: int,
               tiers: Sequence[str | None]) -> Decision:
        """How many of the tokens ``[start, stored)`` to load (a multiple of ``chunk_size``
        past ``start``'s chunk, or ``stored`` itself); ``tiers[i]`` holds chunk i."""
        n = stored - start
        if n <= 0:
            return Decision(stored, 0, reason="nothing stored")
        if self.mode == "never":
            self.decisions["recompute"] += 1
            return Decision(stored, 0, reason="load_policy never")
        spt = self._spt(stored)
        speeds = [self.load_bps.get(t or "") for t in tiers]
        if self.mode == "always" or spt is None or any(s is None for s in speeds[start // chunk_size:]):
            self.decisions["load"] += 1
            return Decision(stored, n, reason="load_policy always" if self.mode == "always" else
                            "no figures yet: load")
        first = start // chunk_size
        last = -(-stored // chunk_size)
        best_m, best_t = start, n * spt
        load_t = 0.0
        for c in range(first, last):
            s = speeds[c]
            assert s is not None
            covered = min(stored, (c + 1) * chunk_size) - max(start, c * chunk_size)
            load_t += chunk_bytes * covered / chunk_size / s
            m = min(stored, (c + 1) * chunk_size)
            t = load_t + (stored - m) * spt
            if t < best_t:
                best_m, best_t = m, t
        load = best_m - start
        full_load_t = load_t
        now = self.clock()
        stale = sorted({t or "" for t in tiers[first:last] if now - self._seen.get(t or "", now) > self.refresh_s})
        if load < n and stale:
            self._seen.update((t, now) for t in stale)  # one probe per period, not one per request
            self.decisions["load"] += 1
            return Decision(stored, n, round(full_load_t, 6), round(n * spt, 6),
                            f"load: the speed of tier {', '.join(stale)} was last seen over {self.refresh_s:.0f} s "
                            "ago; loading to observe it again")
        kind = "load" if load == n else "recompute" if load == 0 else "partial"
        self.decisions[kind] += 1
        d = Decision(stored, load, round(full_load_t, 6), round(n * spt, 6),
                     f"{kind}: loading {n} tokens predicted {full_load_t * 1e3:.1f} ms, recomputing "
                     f"{n * spt * 1e3:.1f} ms")
        if kind != "load":
            log.debug("lmctl: %s", d.reason)
        return d

    def stats(self) -> dict[str, object]:
        return {"load_policy": self.mode, "decisions": dict(self.decisions),
                "load_gbps": {t: round(b / 1e9, 3) for t, b in self.load_bps.items()},
                "prefill_ms_per_token": {2 ** k: round(v * 1e3, 4) for k, v in sorted(self.prefill_spt.items())}}
