"""The store's structure (issue 20): parts are built with their collaborators and never wired
afterwards, the evictor never calls back into the write path.

Each check is a function over source text, run on the real tree and on a planted violation
(so that a check that could never fail would fail here)."""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from store import MiB, Store, StoreConfig, TierConfig

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "store"

#: objects a part keeps for itself whose attributes it may set (not collaborators)
OWN_HELPERS = {"self._local", "self._timer", "self._stats"}
#: list methods that add a hook to a collaborator's list
ADDERS = {"append", "extend", "insert"}


def store_sources() -> Iterator[tuple[str, str]]:
    for p in sorted(STORE.glob("*.py")):
        yield p.name, p.read_text()


def wiring_after_construction(source: str) -> list[str]:
    """Where ``source`` sets an attribute of one of its collaborators (``self.part.attr = ...``,
    ``setattr(self.part, ...)``, ``self.part.hooks.append(...)``): a part wired after it was built."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            targets = [ast.Attribute(node.args[0], "?", ast.Store())] if node.args else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ADDERS:
            targets = [node.func.value]
        for t in targets:
            for sub in ast.walk(t):
                if not isinstance(sub, ast.Attribute):
                    continue
                owner = ast.unparse(sub.value)
                if owner.startswith("self.") and owner not in OWN_HELPERS and _depth(sub.value) >= 1:
                    found.append(f"line {node.lineno}: {ast.unparse(sub)}")
    return found


def _depth(e: ast.expr) -> int:
    """How many attributes deep below ``self`` ``e`` is (``self.a``: 1; -1: not under self)."""
    n = 0
    while isinstance(e, ast.Attribute):
        n += 1
        e = e.value
    return n if isinstance(e, ast.Name) and e.id == "self" else -1


def test_the_wiring_check_finds_a_hook_set_after_construction() -> None:
    planted = (
        "class Store:\n"
        "    def _open(self):\n"
        "        self._evictor.spill = self._spill\n"
        "        self._reads.before_flush.append(self._meter)\n"
        "        setattr(self._index, 'event_log', None)\n"
        "        self._own = 1\n"  # its own attribute: fine
    )
    assert [f.split(": ")[1] for f in wiring_after_construction(planted)] == [
        "self._evictor.spill", "self._reads.before_flush", "self._index.?"]


def test_no_part_of_the_store_is_wired_after_it_was_built() -> None:
    """The count of hooks set after construction is 0: every collaborator is a constructor
    argument."""
    found = {name: hits for name, src in store_sources() if (hits := wiring_after_construction(src))}
    assert found == {}


def test_the_evictor_takes_no_callback_and_never_calls_the_write_path() -> None:
    """The run-time loop Writes -> Evictor -> spill -> Writes.rewrite -> Evictor is gone: the
    evictor decides (``choose``) and drops (``finish``); the write path moves the victims."""
    from store.eviction import Evictor

    assert list(inspect.signature(Evictor.__init__).parameters) == [
        "self", "index", "space", "compactor", "namespaces", "config", "lock"]
    tree = ast.parse((STORE / "eviction.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"writes", "store", "sharing", "reads"}
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not called & {"spill", "rewrite", "put_many", "push_entries"}


# -- the same at run time: every assignment to a part's attribute comes from its own methods --
def _part_classes() -> list[type]:
    from store.compaction import Compactor
    from store.events import EventLog
    from store.eviction import Evictor
    from store.index import Index
    from store.namespaces import Namespaces
    from store.pins import Pins
    from store.reads import Reads
    from store.recovery import Recovery
    from store.sharing import Sharing
    from store.space import Space
    from store.writes import Writes

    return [Index, EventLog, Space, Namespaces, Pins, Compactor, Evictor, Recovery, Reads, Writes, Sharing]


@pytest.fixture
def outside_sets(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Assignments to a part's attributes made by code that is not one of that part's methods."""
    seen: list[str] = []
    for cls in _part_classes():
        def guarded(obj: Any, name: str, value: Any, _set: Any = object.__setattr__) -> None:
            caller: FrameType | None = sys._getframe(1)
            # a part's own method (or its dataclass/__init__ helpers) has it as ``self``
            if caller is None or caller.f_locals.get("self") is not obj:
                where = "?" if caller is None else f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                seen.append(f"{type(obj).__name__}.{name} set from {where}")
            _set(obj, name, value)

        monkeypatch.setattr(cls, "__setattr__", guarded)
    return seen


def test_the_run_time_check_finds_an_attribute_set_from_outside(outside_sets: list[str], tmp_path: Path) -> None:
    s = Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}))
    try:
        assert outside_sets == []
        s._writes.spare = 1  # type: ignore[attr-defined]
        assert outside_sets == ["Writes.spare set from test_structure.py:" + outside_sets[0].rsplit(":", 1)[1]]
    finally:
        s.close()


def test_no_part_attribute_is_set_from_outside_while_the_store_works(outside_sets: list[str],
                                                                   tmp_path: Path) -> None:
    """Open a store with dram over nvme, fill dram past its capacity (eviction demotes to
    nvme), pin, change settings, maintain, evict, reopen: no part's attribute is assigned by
    anything but its own methods."""
    from conftest import SMALL_LAYOUT, key

    from store import PutItem

    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=8 * MiB, path=str(tmp_path / "shm")),
                             "nvme": TierConfig(capacity=256 * MiB)}, default_tier="dram", segment_bytes=1 * MiB)
    with Store(tmp_path / "s", cfg) as s:
        keys = [key(i) for i in range(24)]
        for k in keys:  # 24 MiB through an 8 MiB dram tier
            s.put_many([PutItem(k, bytes(1 * MiB), SMALL_LAYOUT, 16)])
        s.flush()
        assert "nvme" in s.locate(keys)
        s.pin("doc", keys[:2])
        assert s.get(keys[0]) is not None
        cfg2 = StoreConfig.from_json(s.config.to_json())
        cfg2.tiers["dram"].capacity = 4 * MiB
        s.configure(cfg2)
        s.maintain()
        s.evict(keys[-3:])
        s.check(fix=True)
    with Store(tmp_path / "s") as s:
        assert s.get(keys[0]) is not None
    assert outside_sets == []


# -- the clock: every part reads time from the clock it was given ------------------------------
CLOCK_READS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}


def clock_reads(source: str) -> list[str]:
    """Where ``source`` reads the machine's clock itself (``time.time()``, ``time.monotonic()``,
    ``from time import monotonic``...) instead of a ``Clock``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCK_READS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "time"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [f"line {node.lineno}: from time import {a.name}" for a in node.names if a.name in CLOCK_READS]
    return found


def test_the_clock_check_finds_a_direct_read() -> None:
    planted = "import time\nfrom time import monotonic\nx = time.time()\ny = time.strftime('%Y')\n"
    assert sorted(clock_reads(planted)) == ["line 2: from time import monotonic", "line 3: time.time()"]


def test_the_store_reads_time_only_through_its_clock() -> None:
    found = {name: hits for name, src in store_sources() if name != "clock.py" and (hits := clock_reads(src))}
    assert found == {}


def test_a_manual_clock_moves_only_when_told_and_the_store_reads_it(tmp_path: Path) -> None:
    from conftest import SMALL_LAYOUT, key

    from store import PutItem
    from store.clock import ManualClock

    clock = ManualClock(start=1_700_000_000.0)
    assert (clock.time(), clock.monotonic()) == (1_700_000_000.0, 0.0)
    with pytest.raises(ValueError):
        clock.advance(-1)
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}), clock=clock) as s:
        s.put_many([PutItem(key(1), bytes(4096), SMALL_LAYOUT, 16)])
        clock.advance(3600)
        assert s.get(key(1)) is not None
        s.flush()
        s.pin("doc", [key(1)])
        info = s.info(key(1))
        assert info is not None and (info.created, info.last_access) == (1_700_000_000.0, 1_700_003_600.0)
        assert [e["time"] for e in s.events(kinds=["pin"])] == [1_700_003_600.0]
