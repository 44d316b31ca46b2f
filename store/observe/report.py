"""What the store reports about itself to operators: usage per tier and its counters
(``stats``), the nvme tier's writes against its budget, what admission kept off it, and the
warnings and notes ``lmctl status`` shows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..clock import Clock
from ..config import StoreConfig, human_size
from ..format.private import MEMORY_FILESYSTEMS, filesystem_type
from ..index import Index
from ..ops.reads import Reads
from ..tiers.admission import Admission, WriteRate, write_rate
from ..tiers.sharing import Sharing
from ..tiers.space import TierState
from ..types import StoreStats, TierStats


class Report:
    """The store's figures and advice, read from the index and the parts that count."""

    def __init__(self, index: Index, tiers: Mapping[str, TierState], reads: Reads, admission: Admission,
                 config: Callable[[], StoreConfig], sharing: Callable[[], Sharing | None],
                 remote_refused: Callable[[], str | None], clock: Clock) -> None:
        self.index = index
        self.tiers = tiers
        self.reads = reads
        self.admission = admission
        self.config = config
        self.sharing = sharing
        self.remote_refused = remote_refused
        self.clock = clock

    def stats(self) -> StoreStats:
        """Usage per tier and the store's counters, as committed (this process's pending hit
        and miss counts added; other processes' arrive within their ``access_flush_s``). Reads
        only: a stalled disk under the index's writers never makes this wait."""
        pending = self.reads.pending_counts()
        with self.index.read() as t:
            counters = {k: t.counter(k) + pending.get(k, 0) for k in (
                "puts", "payload_bytes", "written_bytes", "hits", "misses", "corrupt", "evicted",
                "rejected_full", "compacted_bytes", "pin_reserved", "evicted_retired")}
            segs = t.segments()
            tiers = {}
            counted = self.reads.counts(t)
            for name, st in self.tiers.items():
                mine = [s for _sid, s in segs if s.tier == st.tid]
                tiers[name] = TierStats(
                    chunks=t.counter(f"count:{name}"), bytes=t.counter(f"live:{name}"),
                    disk_bytes=t.counter(f"used:{name}"), dead_bytes=sum(s.dead_bytes for s in mine),
                    segments=len(mine), capacity=st.cfg.capacity, pinned_bytes=t.counter(f"pinned:{name}"),
                    pin_budget=st.cfg.pin_budget_bytes, direct_io=st.io.direct, path=st.io.dir,
                    pinned_chunks=counted.total(tier=name).pinned_chunks)
        sharing = self.sharing()
        wa = counters["written_bytes"] / counters["payload_bytes"] if counters["payload_bytes"] else 0.0
        return StoreStats(tiers, counters, wa, None if sharing is None else sharing.stats(),
                          self.remote_refused())

    def write_rates(self) -> dict[str, WriteRate]:
        """Bytes written to the nvme tier (all time, the last 24 h, the rate per day projected
        from them) and its write budget (``tiers.nvme.write_budget``), kept in the index so that
        every process's writes count and a restart keeps the day (store/tiers/admission.py). Empty
        for a store without an nvme tier."""
        st = self.tiers.get("nvme")
        if st is None:
            return {}
        with self.index.read() as t:
            return {"nvme": write_rate(t, "nvme", self.clock.time(), st.cfg.write_budget, st.cfg.write_budget_bytes)}

    def admission_stats(self) -> dict[str, Any]:
        """The ``admit`` setting and what it did: keys the ghost list remembers (and may), and
        the chunks (and their bytes) kept off the nvme tier, by path (``put``: an engine's
        save to nvme; ``spill``: a chunk dropped as it left dram), every process's."""
        out: dict[str, Any] = {"admit": self.config().admit, "ghosts": self.admission.ghosts(),
                               "ghosts_max": self.config().admit_ghosts,
                               "not_admitted": {"put": 0, "spill": 0}, "not_admitted_bytes": {"put": 0, "spill": 0}}
        for c in self.reads.metric_cells():
            if c.name in ("not_admitted_total", "not_admitted_bytes_total"):
                field = "not_admitted" if c.name == "not_admitted_total" else "not_admitted_bytes"
                path = c.labels.get("path", "put")
                out[field][path] = out[field].get(path, 0) + int(c.value)
        return out

    def warnings(self, rates: Mapping[str, WriteRate] | None = None) -> list[str]:
        """What the operator should act on soon, a line each: a tier on course to write more
        per day than its write budget (``rates``: ``write_rates()`` already read)."""
        out = []
        for name, r in (self.write_rates() if rates is None else rates).items():
            if r.over_budget and r.budget_bytes_per_day:
                span = r.window_s
                seen = f"{span / 3600:.1f} h" if span >= 3600 else f"{span / 60:.0f} min" if span >= 60 else \
                    f"{span:.0f} s"
                fixes = ([] if self.config().admit == "second-hit" else ["set admit=second-hit"]) + (
                    [] if "dram" in self.tiers else ["give it a dram tier in front"]) + [
                    f"raise tiers.{name}.write_budget"]
                out.append(f"tier {name} is on course to write {human_size(r.per_day_bytes)}/day (projected from "
                           f"the last {seen}{', counted as an hour' if span < 3600 else ''}), over its write budget "
                           f"of {human_size(r.budget_bytes_per_day)}/day ({r.budget}): "
                           f"{', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}")
        return out

    def notes(self) -> list[str]:
        """What an operator should know about how the store is set up, a line each: a tier
        called dram whose folder is not in memory (on the store's disk, say)."""
        out = []
        st = self.tiers.get("dram")
        kind = filesystem_type(st.io.dir) if st is not None else None
        if st is not None and kind is not None and kind not in MEMORY_FILESYSTEMS:
            out.append(f"tier dram's folder {st.io.dir} is on {kind}, not tmpfs: its chunks are on disk, not in "
                       "memory; give the dram tier a folder under /dev/shm (while it is empty: "
                       "tiers.dram=none, then tiers.dram.path=/dev/shm/... and tiers.dram.capacity)")
        return out
