"""A disk that stalls (a frozen file system, a writer stuck on its disk) never stalls a read, a
lookup, ``stats`` or ``status``: the access log and metrics are written by a background timer,
and statistics read only what is committed. Every process that touches the store while its
index may stall runs as a worker process (stress/scenario_frozen.py), so the test itself never
waits on the disk; a frozen file system is always thawed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from store import Store
from stress.common import Worker
from stress.scenario_frozen import DEADLINE_S, make_store, skip_reason, trial

SCRIPT = Path(__file__).resolve().parent.parent / "stress" / "scenario_frozen.py"


def test_a_stuck_index_writer_never_stalls_reads_lookups_or_stats(tmp_path: Path) -> None:
    """A writer that holds the index's write transaction (as one stuck creating a segment on a
    frozen tier does) while another process reads: the reads, an engine's lookup counts,
    ``stats`` (with this process's pending hits) and the metrics all answer at once."""
    store = tmp_path / "store"
    make_store(store, None)  # access_flush_s 0.05: every read finds the access log due
    holder, reader = Worker(SCRIPT, "worker", str(store)), Worker(SCRIPT, "worker", str(store))
    try:
        reader.send("get 0")
        reader.expect("got 0")
        holder.send("hold")
        holder.expect("held")
        time.sleep(0.2)  # past access_flush_s: the access log is due at the next read
        for i in (1, 2, 3):
            reader.send(f"get {i}")
            assert reader.wait_for(f"got {i}", DEADLINE_S) == f"got {i} hit", "a read waited for the writer"
        reader.send("count")
        assert reader.wait_for("counted", DEADLINE_S), "an engine's lookup count waited for the writer"
        reader.send("stats")
        line = reader.wait_for("stats", DEADLINE_S)
        assert line is not None, "stats waited for the writer"
        assert int(line.split()[1]) >= 3  # the hits not written yet are counted
        reader.send("metrics")
        assert reader.wait_for("metrics", DEADLINE_S), "the metrics waited for the writer"
        holder.send("release")
        holder.expect("released")
        reader.send("close")
        reader.expect("closed")
    finally:
        for w in (holder, reader):
            w.kill()
    with Store(store) as s:
        assert s.stats().counters["hits"] == 4
        assert {c.name for c in s.metric_cells()} >= {"lookups_total", "lookup_hit_tokens_total"}


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_a_frozen_tier_never_stalls_reads_status_or_ls(tmp_path: Path) -> None:
    """The nvme tier on a loop-mounted ext4 that is frozen while a writer's put blocks on it
    (inside a write transaction: it must create a segment file): another process's reads hit,
    the daemon answers ``status`` and ``ls``, and after the thaw the put lands, the hits reach
    the index and ``verify --deep`` is clean."""
    r = trial(tmp_path, "tier")
    assert r["put_blocked"], "the scenario did not stall the writer"
    assert r["reads_answered"] == 3, f"reads while frozen: {r}"
    assert r["status_answered"] and r["ls_answered"], f"status/ls while frozen: {r}"
    assert r["put_after_thaw"] and r["stored_after_thaw"], r
    assert r["reads_after_thaw"] == 4 and r["status_after_thaw"], r
    assert r["hits_after_thaw"] >= 8, r
    assert not r["problems"], r
