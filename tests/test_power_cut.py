"""Power cuts (a FUSE file system that drops what was not synced, tests/faultfs.py): what a
store acknowledged survives, the index opens and ``verify --deep`` finds nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import MiB, Store
from stress.common import content, key
from stress.scenario_power_cut import SIZE, WINDOW_S, Promises, Writer, cut_trial
from testsupport.faultfs import FaultFS, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture
def cut_after(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Writer, Path, FaultFS]]:
    """A writer on a store under a FaultFS mount (``access_flush_s``: the test's parameter, if
    any); the test sends it commands and cuts the power (``run_then_cut``)."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    with FaultFS(backing, mnt) as fs:
        w = Writer(mnt / "store", getattr(request, "param", 1.0))
        try:
            w.expect("ready")
            yield w, backing / "store", fs
        finally:
            w.kill()


def run_then_cut(w: Writer, fs: FaultFS, *cmds: str) -> Promises:
    """Send ``cmds`` one by one, each acknowledged before the next; then kill and cut."""
    for c in cmds:
        w.send(c)
        w.expect("idle")
    w.kill()
    fs.power_cut()
    return w.promises


@pytest.mark.parametrize("cut_after", [60.0], indirect=True)
def test_an_acknowledged_put_survives_once_the_window_passed(cut_after: tuple[Writer, Path, FaultFS]) -> None:
    """Nothing else commits after the puts (the access log waits a minute): the background
    sync alone makes them durable within the window."""
    w, store, fs = cut_after
    for c in ("put 1", "put 2"):
        w.send(c)
        w.expect("idle")
    time.sleep(2 * WINDOW_S)  # past the stated window: a put is durable this long after its ack
    run_then_cut(w, fs)
    with Store(store) as s:
        for i in (1, 2):
            got = s.get(key(i), touch=False)
            assert got is not None, f"acknowledged put {i} was lost"
            assert bytes(got.data) == content(key(i), SIZE)
        assert not s.check(deep=True)


def test_an_acknowledged_pin_survives(cut_after: tuple[Writer, Path, FaultFS]) -> None:
    w, store, fs = cut_after
    run_then_cut(w, fs, "put 1", "pin docs 1")
    with Store(store) as s:
        assert s.key_labels(key(1)) == ["docs"]
        assert not s.check(deep=True)


def test_an_acknowledged_unpin_survives(cut_after: tuple[Writer, Path, FaultFS]) -> None:
    w, store, fs = cut_after
    run_then_cut(w, fs, "put 1", "pin docs 1", "pin other 1", "unpin docs 1")
    with Store(store) as s:
        assert s.key_labels(key(1)) == ["other"]
        assert not s.check(deep=True)


def test_a_pin_of_a_chunk_not_stored_yet_survives(cut_after: tuple[Writer, Path, FaultFS]) -> None:
    w, store, fs = cut_after
    run_then_cut(w, fs, "pin later 7")
    with Store(store) as s:
        assert s.labels() == {"later": [key(7)]}
        assert not s.check(deep=True)


def test_an_acknowledged_setting_survives(cut_after: tuple[Writer, Path, FaultFS]) -> None:
    w, store, fs = cut_after
    run_then_cut(w, fs, "put 1", "config 1280")
    with Store(store) as s:
        assert s.config.tiers["nvme"].capacity == 1280 * MiB
        assert not s.check(deep=True)


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_random_cuts_lose_nothing_acknowledged(tmp_path: Path, keep: float) -> None:
    """Cuts at random moments of a run of puts, pins, unpins and settings; with ``keep`` 0.5
    each unsynced write reaches the disk with probability 1/2 (a disk that wrote part of its
    cache, in any order)."""
    for seed in (1, 2):
        promises, lost = cut_trial(tmp_path / str(seed), seed, 200, keep)
        assert promises.puts, "the writer acknowledged nothing before the cut"
        lost.pop("puts_lost_in_window")
        lost.pop("oldest_lost_age_s")
        assert lost == {"puts_lost": 0, "wrong_bytes": 0, "pins_lost": 0, "unpins_lost": 0, "settings_lost": 0,
                        "problems": 0}, f"seed {seed}: {lost}"
