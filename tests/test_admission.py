"""Admission (``admit = all | second-hit``) and the nvme tier's write budget (issue 22, item 3):
real stores on disk, a dram tier over an nvme tier where spills are concerned, and a
``ManualClock`` moved instead of sleeping."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL_LAYOUT, key

from store import MiB, PutItem, Store, StoreConfig, StoreError, TierConfig
from store.clock import ManualClock
from store.config import parse_write_budget

CHUNK = 64 << 10


def nvme(tmp_path: Path, **kw: object) -> StoreConfig:
    budget = kw.pop("write_budget", None)
    return StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB, write_budget=budget)},  # type: ignore[arg-type]
                       segment_bytes=1 * MiB, **kw)  # type: ignore[arg-type]


def item(i: int, n: int = CHUNK) -> PutItem:
    return PutItem(key(i), bytes([i % 251]) * n, SMALL_LAYOUT, 16)


def test_second_hit_keeps_a_first_put_off_nvme_and_admits_the_second(tmp_path: Path) -> None:
    with Store(tmp_path / "s", nvme(tmp_path, admit="second-hit")) as s:
        assert s.save_many([item(1), item(2)]) == ["not-admitted", "not-admitted"]
        assert s.put_many([item(3)]) == [False]  # put_many: not stored (and no error)
        st = s.stats()
        assert st.tiers["nvme"].chunks == 0 and st.counters["payload_bytes"] == 0
        assert s.write_rates()["nvme"].written_bytes == 0  # nothing reached the disk
        assert s.locate([key(1), key(2), key(3)]) == [None, None, None]
        # the second save of a key is admitted; a third finds it stored
        assert s.save_many([item(1), item(4)]) == ["stored", "not-admitted"]
        assert s.save_many([item(1)]) == ["present"]
        got = s.get(key(1))
        assert got is not None and bytes(got.data) == bytes([1]) * CHUNK
        adm = s.admission_stats()
        assert adm["admit"] == "second-hit" and adm["ghosts"] == 4
        assert adm["not_admitted"] == {"put": 4, "spill": 0} and adm["not_admitted_bytes"]["put"] == 4 * CHUNK


def test_admit_all_writes_every_first_put_and_keeps_no_ghosts(tmp_path: Path) -> None:
    with Store(tmp_path / "s", nvme(tmp_path)) as s:
        assert s.config.admit == "all"
        assert s.save_many([item(1), item(2)]) == ["stored", "stored"]
        assert s.admission_stats()["ghosts"] == 0 and s.admission_stats()["not_admitted"]["put"] == 0


def test_a_caller_naming_the_tier_is_never_asked(tmp_path: Path) -> None:
    """``put_many(tier=...)`` (lmctl warm, moves) is the caller's decision, not an engine's save."""
    with Store(tmp_path / "s", nvme(tmp_path, admit="second-hit")) as s:
        assert s.save_many([item(1)], tier="nvme") == ["stored"]
        assert s.admission_stats()["ghosts"] == 0


def test_the_ghost_list_is_bounded_fifo_and_survives_a_reopen(tmp_path: Path) -> None:
    with Store(tmp_path / "s", nvme(tmp_path, admit="second-hit", admit_ghosts=4)) as s:
        assert s.save_many([item(i) for i in range(6)]) == ["not-admitted"] * 6
        assert s.admission_stats()["ghosts"] == 4
        slots = [s._admission.slot_of(key(i)) for i in range(6)]
        # the two oldest keys gave their slots to the two newest
        assert slots == [None, None, 2, 3, 0, 1]
    with Store(tmp_path / "s") as s:  # reopened: the list is the index's
        assert s.admission_stats()["ghosts"] == 4
        assert s.save_many([item(5), item(2), item(0)]) == ["stored", "stored", "not-admitted"]
        # a smaller list forgets what its ring lost, at once
        cfg = StoreConfig.from_json(s.config.to_json())
        cfg.admit_ghosts = 2
        s.configure(cfg)
        assert s.admission_stats()["ghosts"] == 2
        # key 0 had taken slot 2 (the ring's next), which a ring of two has not
        assert [s._admission.slot_of(key(i)) for i in (0, 4, 5)] == [None, 0, 1]
        assert s.save_many([item(6), item(7), item(8)]) == ["not-admitted"] * 3
        assert s.admission_stats()["ghosts"] == 2


def test_pinned_documents_are_always_admitted(tmp_path: Path) -> None:
    with Store(tmp_path / "s", nvme(tmp_path, admit="second-hit")) as s:
        s.pin("doc", [key(1), key(2)], expected_bytes=CHUNK)  # pinned before it is first served
        assert s.save_many([item(1), item(2), item(3)]) == ["stored", "stored", "not-admitted"]
        assert s.admission_stats()["not_admitted"]["put"] == 1


def dram_over_nvme(tmp_path: Path, admit: str) -> StoreConfig:
    return StoreConfig(tiers={"dram": TierConfig(capacity=16 * MiB, path=str(tmp_path / "shm")),
                              "nvme": TierConfig(capacity=256 * MiB)}, default_tier="dram", segment_bytes=1 * MiB,
                       admit=admit)


@pytest.mark.parametrize("admit", ["all", "second-hit"])
def test_dram_spills_to_nvme_only_what_earned_it(tmp_path: Path, admit: str) -> None:
    """Saves land in dram whatever ``admit`` says. As eviction takes chunks out of dram, ``all``
    moves every one to nvme; ``second-hit`` moves those read while in dram, those saved twice
    and pinned ones, and drops the rest (counted, path ``spill``)."""
    with Store(tmp_path / "s", dram_over_nvme(tmp_path, admit)) as s:
        first = [PutItem(key(i), bytes([i]) * MiB, SMALL_LAYOUT, 16) for i in range(8)]
        assert s.save_many(first) == ["stored"] * 8  # dram: no gate
        assert s.get(key(0)) is not None and s.get(key(1)) is not None  # read while in dram
        s.flush()
        s.pin("doc", [key(2)])
        # key 3 leaves dram, is saved again (its second sighting) and leaves dram once more
        s.evict([key(3)])
        assert s.save_many([first[3]]) == ["stored"]
        # 24 MiB more of one-off chunks push all of these out of the 16 MiB dram tier
        for i in range(100, 124):
            assert s.save_many([PutItem(key(i), bytes([i % 251]) * MiB, SMALL_LAYOUT, 16)]) == ["stored"]
        where = s.locate([key(i) for i in range(8)])
        assert where[:4] == ["nvme"] * 4  # read, read, pinned, saved twice
        if admit == "all":
            assert where[4:] == ["nvme"] * 4
            assert s.admission_stats()["not_admitted"]["spill"] == 0
        else:
            assert where[4:] == [None] * 4  # never read, never seen again: dropped, not written
            adm = s.admission_stats()
            assert adm["not_admitted"]["spill"] >= 4 and adm["not_admitted_bytes"]["spill"] >= 4 * MiB
            got = s.get(key(3))
            assert got is not None and bytes(got.data) == bytes([3]) * MiB
        ev = s.event_counters()["evictions_total"]
        assert (ev.get("lru", 0) > 0) == (admit == "second-hit")  # dram's dropped chunks are evictions


def test_nvme_writes_are_counted_with_spills_and_compaction_and_survive_a_reopen(tmp_path: Path) -> None:
    clock = ManualClock(start=1_700_000_000.0)
    cfg = dram_over_nvme(tmp_path, "all")
    with Store(tmp_path / "s", cfg, clock=clock) as s:
        s.save_many([PutItem(key(i), bytes([i]) * (300 << 10), SMALL_LAYOUT, 16) for i in range(8)])
        assert s.write_rates()["nvme"].written_bytes == 0  # dram only, so far
        s.rewrite([key(i) for i in range(8)], tier="nvme")  # three records a segment
        moved = s.write_rates()["nvme"].written_bytes
        assert moved >= 8 * (300 << 10)
        s.flush()
        nvme_disk = s.stats().tiers["nvme"].disk_bytes
        assert moved == nvme_disk  # every byte the tier's files hold was counted
        s.evict([key(0)])
        before = s.stats().counters["compacted_bytes"]
        s.compact("nvme", min_dead_ratio=0.0)
        compacted = s.stats().counters["compacted_bytes"] - before
        assert compacted >= 2 * (300 << 10)
        r = s.write_rates()["nvme"]
        assert r.written_bytes >= moved + compacted and r.written_24h_bytes == r.written_bytes
    clock.advance(1800)
    with Store(tmp_path / "s", clock=clock) as s:  # a restart keeps the day
        r2 = s.write_rates()["nvme"]
        assert (r2.written_bytes, r2.written_24h_bytes) == (r.written_bytes, r.written_24h_bytes)
        clock.advance(25 * 3600)  # a day later: the last day wrote nothing; the total stays
        r3 = s.write_rates()["nvme"]
        assert (r3.written_bytes, r3.written_24h_bytes, r3.per_day_bytes) == (r.written_bytes, 0, 0.0)


def test_the_rate_per_day_and_the_warning_when_on_course_to_exceed_the_budget(tmp_path: Path) -> None:
    clock = ManualClock(start=1_700_000_000.0)
    # 64 MiB tier, 0.25 DWPD: 16 MiB a day
    with Store(tmp_path / "s", nvme(tmp_path, write_budget="0.25 DWPD"), clock=clock) as s:
        s.save_many([item(i, MiB - 8192) for i in range(4)])  # about 4 MiB written
        r = s.write_rates()["nvme"]
        assert r.budget_bytes_per_day == 16 * MiB and r.budget == "0.25 DWPD"
        # in the first hour the rate is projected from a whole hour: 4 MiB x 24 = 96 MiB a day
        assert 90 * MiB < r.per_day_bytes < 100 * MiB and r.over_budget
        [line] = s.warnings()
        assert line.startswith("tier nvme is on course to write 9") and "over its write budget of 16.0 MiB/day" \
            in line and "(projected from the last 0 s, counted as an hour)" in line
        assert line.endswith(": set admit=second-hit, give it a dram tier in front or raise tiers.nvme.write_budget")
        clock.advance(12 * 3600)  # the same 4 MiB over 12 h: 8 MiB a day, within the budget
        r = s.write_rates()["nvme"]
        assert 7.5 * MiB < r.per_day_bytes < 8.5 * MiB and not r.over_budget and s.warnings() == []
        assert 11.9 * 3600 < r.window_s <= 12 * 3600 + 1
        clock.advance(6 * 3600)
        s.save_many([item(i, MiB - 8192) for i in range(10, 22)])  # 12 MiB more: 16 MiB in 18 h
        r = s.write_rates()["nvme"]
        assert r.per_day_bytes > 16 * MiB and r.over_budget and len(s.warnings()) == 1


@pytest.mark.parametrize(("text", "bytes_per_day"), [
    ("1DWPD", 64 * MiB), ("0.5 dwpd", 32 * MiB), (" 2 DWPD ", 128 * MiB), ("500GiB/day", 500 << 30),
    ("1TB/d", 10**12), ("1.5 TiB / day", int(1.5 * (1 << 40))), ("none", None), ("", None), (None, None)])
def test_write_budgets_parse(text: str | None, bytes_per_day: int | None) -> None:
    assert parse_write_budget(text, 64 * MiB) == bytes_per_day


@pytest.mark.parametrize("text", ["1", "DWPD", "0DWPD", "-1DWPD", "5000DWPD", "500GiB", "500/day", "1 TB/week",
                                  "nanDWPD", "1e400GiB/day", "0GiB/day"])
def test_bad_write_budgets_say_how_to_write_one(text: str) -> None:
    with pytest.raises(StoreError, match="write budget"):
        parse_write_budget(text, 64 * MiB)


def test_settings_are_validated(tmp_path: Path) -> None:
    for bad, match in ((dict(admit="sometimes"), "admit must be one of all, second-hit"),
                       (dict(admit_ghosts=0), "admit_ghosts must be a whole number"),
                       (dict(write_budget="lots"), "write budget 'lots' is not a budget")):
        with pytest.raises(StoreError, match=match):
            Store(tmp_path / "s", nvme(tmp_path, **bad))
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=16 * MiB, path=str(tmp_path / "shm"), write_budget="1DWPD"),
                             "nvme": TierConfig(capacity=64 * MiB)})
    with pytest.raises(StoreError, match="tier dram takes no write budget"):
        cfg.validate()


def test_a_store_of_an_older_lmctl_gets_the_admission_table_at_its_first_writable_open(tmp_path: Path) -> None:
    """Settings written without the new fields read as the defaults; the index gains its
    ``admission`` sub-database where it is opened for writing."""
    import json

    with Store(tmp_path / "s", nvme(tmp_path)) as s:
        doc = json.loads(s.config.to_json())
    for gone in ("admit", "admit_ghosts"):
        doc.pop(gone)
    doc["tiers"]["nvme"].pop("write_budget")
    doc["tiers"]["nvme"]["from_a_later_lmctl"] = 1  # a field this version does not know is ignored
    cfg = StoreConfig.from_json(json.dumps(doc))
    assert (cfg.admit, cfg.tiers["nvme"].write_budget) == ("all", None)


# -- through the daemon and the CLI ----------------------------------------------------------------
def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_cli_sets_admission_and_the_budget_and_refuses_bad_values_in_one_line(tmp_path: Path) -> None:
    """``config set`` and ``serve --set`` take ``admit``, ``admit_ghosts`` and
    ``tiers.nvme.write_budget``; a bad value is one line on stderr and exit 2, nothing applied.
    Then ``status`` (JSON and human) and the metrics report the writes against the budget,
    with the warning, and what admission kept off NVMe."""
    from redis_server import free_port
    from test_daemon import Daemon, cj, cli, fill

    bad = {"admit=sometimes": "admit 'sometimes' is not a mode: give all or second-hit",
           "admit_ghosts=0": "admit_ghosts must be between 1 and",
           "tiers.nvme.write_budget=lots": "write budget 'lots' is not a budget: write it as drive writes per day",
           "tiers.nvme.write_budget=500GiB": "write budget '500GiB' is not a budget",
           "tiers.dram.write_budget=1DWPD": "only the nvme tier takes a write budget"}
    r = cli(None, "serve", "--store", str(tmp_path / "never"), "--set", "admit=sometimes")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "admit 'sometimes' is not a mode" in r.stderr, r.stderr
    assert not (tmp_path / "never").exists()
    fill(tmp_path / "store")
    port = free_port()
    d = Daemon(tmp_path / "store", extra=["--metrics", f"127.0.0.1:{port}"])
    d.start()
    try:
        before = cj(d, "config", "show")["settings"]
        assert (before["admit"], before["admit_ghosts"], before["tiers"]["nvme"]["write_budget"]) == (
            "all", 262144, None)
        for pair, message in bad.items():
            r = cli(d, "config", "set", pair)
            assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, (pair, r.stderr)
            assert "Traceback" not in r.stderr and r.stdout == ""
        assert cj(d, "config", "show")["settings"] == before
        cj(d, "config", "set", "admit=second-hit", "tiers.nvme.write_budget=1MiB/day")
        # fill() wrote about 80 KiB to the nvme tier a moment ago: 24 x that a day is over 1 MiB
        st = cj(d, "status")["store"]
        w = st["writes"]["nvme"]
        assert w["budget"] == "1MiB/day" and w["budget_bytes_per_day"] == MiB and w["over_budget"] is True
        assert w["written_bytes"] == w["written_24h_bytes"] >= 6 * 8192 and w["per_day_bytes"] > MiB
        assert st["admission"]["admit"] == "second-hit" and st["admission"]["not_admitted"] == {"put": 0, "spill": 0}
        [warning] = st["warnings"]
        assert warning.startswith("tier nvme is on course to write") and "over its write budget of 1.0 MiB/day" \
            in warning and ", counted as an hour)" in warning
        # admit=second-hit already: the advice is the other two
        assert warning.endswith(": give it a dram tier in front or raise tiers.nvme.write_budget"), warning
        # an engine's save of a new prefix (another process on the store): kept off NVMe, counted
        with Store(tmp_path / "store") as s:
            assert s.save_many([PutItem(key(999), bytes(8192), SMALL_LAYOUT, 16)]) == ["not-admitted"]
        r = cli(d, "status")
        assert r.returncode == 0, r.stderr
        assert "admission: second-hit (ghost list 1 of 262144 keys); kept off nvme: 1 first saves (8.0 KiB), 0 " \
            "chunks leaving dram (0 B)" in r.stdout
        assert "; budget 1.0 MiB/day (1MiB/day), OVER" in r.stdout and "warning: tier nvme is on course" in r.stdout
        got = scrape(port)
        assert got[("lmctl_tier_written_bytes_total", (("tier", "nvme"),))] == w["written_bytes"]
        assert got[("lmctl_tier_write_budget_bytes_per_day", (("tier", "nvme"),))] == MiB
        assert got[("lmctl_tier_write_budget_exceeded", (("tier", "nvme"),))] == 1
        assert got[("lmctl_tier_write_rate_bytes_per_day", (("tier", "nvme"),))] > MiB
        assert got[("lmctl_not_admitted_total", (("path", "put"),))] == 1
        assert got[("lmctl_not_admitted_bytes_total", (("path", "put"),))] == 8192
        assert got[("lmctl_admission_ghosts", ())] == 1
        # within the budget: no warning, the gauge at 0
        cj(d, "config", "set", "tiers.nvme.write_budget=1DWPD")
        st = cj(d, "status")["store"]
        assert st["warnings"] == [] and st["writes"]["nvme"]["budget_bytes_per_day"] == 256 * MiB
        assert scrape(port)[("lmctl_tier_write_budget_exceeded", (("tier", "nvme"),))] == 0
    finally:
        assert d.stop() == 0
