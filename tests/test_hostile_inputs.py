"""Small hostile inputs: each gets one clear line (exit 2 from the CLI) and changes nothing;
none ends in "internal error", a traceback or a struct error. Config files and ``config set``
are also fuzzed a little."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lmdb
import pytest
from conftest import env_with_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_daemon import FMT, LAYOUT, Daemon, cj, cli, fill

from lmctl.daemon import socket_access
from lmctl.errors import Denied, LmctlError
from lmctl.metrics import parse_listen
from lmctl.ops import Job, op_config
from lmctl.selection import set_caller
from lmctl.settings import (
    DAEMON_KEYS,
    REMOTE_KEYS,
    STORE_KEYS,
    TIER_KEYS,
    apply_settings,
    check_id,
    check_values,
    maintenance_interval,
    read_config_file,
)
from store import MiB, Namespace, PutItem, Store, StoreConfig, StoreError, TierConfig
from store.format.record import SEG_VERSION


def serve_with(tmp_path: Path, *args: str, config: str | None = None) -> subprocess.CompletedProcess[str]:
    """``lmctl serve --init`` on a folder that holds no store yet, which must stay so."""
    argv = ["serve", "--store", str(tmp_path / "new-store"), "--init", "--socket", str(tmp_path / "s.sock"), *args]
    if config is not None:
        path = tmp_path / "hostile.toml"
        path.write_text(config)
        argv += ["--config", str(path)]
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", *argv], capture_output=True, text=True,
                       env=env_with_path(), timeout=60)
    assert not (tmp_path / "new-store").exists(), "a refused serve created the store"
    return r


def one_usage_line(r: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("lmctl: "), r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# -- serve --config ---------------------------------------------------------------------------------
HOSTILE_TOML = {
    "deep nesting": ("x = " + "[" * 3000 + "]" * 3000, "too deeply"),
    "a NUL in a tier path": ('[tiers.nvme]\npath = "/tmp/a\\u0000b"\n', "NUL"),
    "a NUL in the store path": ('[daemon]\nstore = "/tmp/a\\u0000b"\n', "NUL"),
    "a NUL in the socket path": ('[daemon]\nsocket = "/tmp/a\\u0000b"\n', "NUL"),
    "a huge uid": ("[daemon]\nallow_uid = [99999999999999999999]\n", "not a uid"),
    "a huge gid": ("[daemon]\nsocket_group = 99999999999999999999\n", "not a uid or gid"),
    "a huge duration": ('[store]\nretire_after_s = "' + "9" * 30 + 'd"\n', "out of range"),
    "a duration that is a bare number": ("[store]\nretire_after_s = 7\n",
                                         'has no unit: write a duration in quotes, like "30s"'),
    "an infinite flush interval": ("[store]\naccess_flush_s = inf\n", "has no unit"),
    "a remote timeout that is a bare number": ('[remote]\nurl = "redis://h:1"\nio_timeout_s = 2\n', "has no unit"),
    "a maintenance interval that is a bare number": ("[daemon]\nmaintenance_interval = 30\n", '"30s"'),
    "a garbage format version": ('[store]\nformat_version = "garbage"\n', "unknown setting"),
    "a table that is a string": ('daemon = "x"\n', "must be a table"),
    "a relative tier path": ('[tiers.dram]\ncapacity = "64MiB"\npath = "shm"\n', "absolute"),
    "a maintenance interval of a nanosecond": ('[daemon]\nmaintenance_interval = "0.000000001s"\n',
                                               "out of range: give 0.1s"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TOML))
def test_a_hostile_config_file_gets_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    text, words = HOSTILE_TOML[case]
    one_usage_line(serve_with(tmp_path, config=text), words)


def test_intervals_and_timeouts_have_bounds(tmp_path: Path) -> None:
    for value in ("1e-9", "0", "inf", "nan", "1e400"):
        one_usage_line(serve_with(tmp_path, "--maintenance-interval", value), "--maintenance-interval")
    d = Daemon(tmp_path / "store")
    fill(tmp_path / "store")
    d.start()
    try:
        before = cj(d, "config", "show")["settings"]
        for setting in ("access_flush_s=0s", "access_flush_s=2h", "remote.io_timeout_s=0.000000001s",
                        "remote.lookup_timeout_s=" + "9" * 400, "compact_dead_ratio=0", "segment_bytes=2TiB",
                        "remote.piece_bytes=1GiB", "retire_after_s=" + "9" * 400 + "d"):
            r = cli(d, "config", "set", setting)
            line = one_usage_line(r, "out of range" if "9" * 40 not in setting else "")
            assert "9" * 60 not in line  # a long number is quoted short
        assert cj(d, "config", "show")["settings"] == before  # nothing applied
    finally:
        assert d.stop() == 0


def test_a_duration_setting_without_a_unit_is_refused(tmp_path: Path) -> None:
    """``retire_after_s=7`` may well mean seven days: refused as a size without a unit is,
    from ``config set``, ``serve --set`` and the config file alike."""
    for setting in ("retire_after_s=7", "compress_cold_after_s=0", "access_flush_s=1.5", "remote.io_timeout_s=2"):
        one_usage_line(serve_with(tmp_path, "--set", setting), f"{setting.partition('=')[0]}: ", "has no unit")
    d = Daemon(tmp_path / "store")
    fill(tmp_path / "store")
    d.start()
    try:
        before = cj(d, "config", "show")["settings"]
        line = one_usage_line(cli(d, "config", "set", "retire_after_s=7"))
        assert line == "lmctl: retire_after_s: '7' has no unit: write 7d, 7h, 7m or 7s", line
        assert cj(d, "config", "show")["settings"] == before  # nothing applied
        assert cj(d, "config", "set", "retire_after_s=7d")["settings"]["retire_after_s"] == 7 * 86400
    finally:
        assert d.stop() == 0


def test_init_takes_no_folder_of_other_files_and_chmods_no_folder_it_did_not_make(tmp_path: Path) -> None:
    def serve_init(store: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lmctl.cli", "serve", "--store", str(store), "--init",
                               "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True,
                              env=env_with_path(), timeout=60)

    mine = tmp_path / "notempty"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    (mine / "readme").write_text("hi")
    os.chmod(mine / "readme", 0o644)
    line = one_usage_line(serve_init(mine), "is not empty and not an lmctl store", "'readme'")
    assert os.listdir(mine) == ["readme"], line  # nothing made there
    assert (oct(mine.stat().st_mode & 0o777), oct((mine / "readme").stat().st_mode & 0o777)) == ("0o755", "0o644")
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o755)
    one_usage_line(serve_init(empty), "mode 0755", f"chmod 0700 {empty}")
    assert os.listdir(empty) == [] and empty.stat().st_mode & 0o777 == 0o755
    os.chmod(empty, 0o700)  # made private by its owner: taken
    d = Daemon(empty, tmp_path / "s.sock", ["--init"])
    d.start()
    assert d.stop() == 0
    assert (empty / "index").is_dir() and empty.stat().st_mode & 0o777 == 0o700
    assert not (tmp_path / "s.sock").exists()


def test_an_init_refused_for_a_tier_folder_leaves_nothing_behind(tmp_path: Path) -> None:
    """A tier folder inside a folder others can write is refused at the store's first open;
    the refused --init leaves no store behind: neither the folder it made nor, in an empty
    private folder it was given, the store's files (the next --init starts afresh)."""
    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o777)  # as a /dev/shm/lmctl-UID made first by someone else would be
    tier = ["--tier-path", f"dram={shared / 'main'}", "--capacity", "dram=64MiB", "--capacity", "nvme=64MiB"]
    one_usage_line(serve_with(tmp_path, *tier), "dram folder", "mode 0777")  # serve_with: no store left
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", "serve", "--store", str(empty), "--init",
                        "--socket", str(tmp_path / "s.sock"), *tier], capture_output=True, text=True,
                       env=env_with_path(), timeout=60)
    one_usage_line(r, "dram folder", "mode 0777")
    assert os.listdir(empty) == [] and not (tmp_path / "s.sock").exists() and os.listdir(shared) == []
    # the operator's case: a capacity without a unit, in a folder made for the store
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", "serve", "--store", str(empty), "--init",
                        "--socket", str(tmp_path / "s.sock"), "--capacity", "10"], capture_output=True,
                       text=True, env=env_with_path(), timeout=60)
    one_usage_line(r, "has no unit")
    assert os.listdir(empty) == [] and not (tmp_path / "s.sock").exists()
    os.chmod(shared, 0o700)  # put right: the same command makes the store
    d = Daemon(empty, tmp_path / "s.sock", ["--init", *tier])
    d.start()
    assert d.stop() == 0
    assert (empty / "index").is_dir() and (shared / "main").is_dir()


# a little TOML writer for the fuzz (values as TOML spells them)
def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are TOML's (\u0000 too)
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


VALUES = st.recursive(
    st.none().map(lambda _: "") | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from([2**64, -(2**63), 10**400, 0, 1, 4294967295])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12) | st.sampled_from(["64MiB", "1e400GiB", "12h", "-1h", "/tmp/x\0y", "0660", "redis://h"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=2),
    max_leaves=6)
STORE_NAMES = st.sampled_from([*STORE_KEYS, *(f"{t}.{k}" for t in ("nvme", "dram", "tape") for k in TIER_KEYS)])


@st.composite
def config_files(draw: st.DrawFn) -> str:
    out = []
    daemon = draw(st.dictionaries(st.sampled_from([*DAEMON_KEYS, "bogus"]), VALUES, max_size=4))
    out.append("[daemon]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in daemon.items()))
    store = draw(st.dictionaries(st.sampled_from(STORE_KEYS), VALUES, max_size=4))
    out.append("[store]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in store.items()))
    for tier in draw(st.lists(st.sampled_from(["nvme", "dram", "tape"]), max_size=2, unique=True)):
        kv = draw(st.dictionaries(st.sampled_from(TIER_KEYS), VALUES, max_size=3))
        out.append(f"[tiers.{tier}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in kv.items()))
    remote = draw(st.dictionaries(st.sampled_from(REMOTE_KEYS), VALUES, max_size=3))
    out.append("[remote]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in remote.items()))
    return "\n".join(draw(st.permutations(out)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_files())
def test_any_config_file_is_read_or_refused_with_a_store_error(text: str) -> None:
    """What ``serve --config`` does with a file, short of starting: every way it can fail is
    a ``StoreError`` or lmctl's ``UsageError`` (one line, exit 2), never another exception."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        try:
            daemon, changes = read_config_file(f.name)
            check_values(changes)
            apply_settings(StoreConfig(tiers={"nvme": TierConfig(64 * MiB), "dram": TierConfig(64 * MiB)}),
                           changes)
            maintenance_interval(daemon.get("maintenance_interval", 30))
            for uid in daemon.get("allow_uid") or []:
                check_id(uid, "--allow-uid")
            socket_access(daemon.get("socket_mode") or "0600", daemon.get("socket_group"))
            if daemon.get("metrics") is not None:
                parse_listen(str(daemon["metrics"]))
        except (StoreError, LmctlError) as exc:
            assert "\n" not in str(exc).strip() or "not valid TOML" in str(exc)


# -- config set ------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from([10**400, 2**64]) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10) | st.sampled_from(["64MiB", "7d", "/proc/lmctl-fuzz/x", "rel", "x\0y", "redis://h:1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=5)
SET_NAMES = st.sampled_from([*STORE_KEYS, *(f"tiers.{t}.{k}" for t in ("nvme", "dram", "tape") for k in TIER_KEYS),
                             *(f"remote.{k}" for k in REMOTE_KEYS), "remote.secret_file", "nonsense", "a.b.c.d"])


@pytest.fixture(scope="module")
def fuzz_store() -> Any:
    path = tempfile.mkdtemp(prefix="lmctl-fuzz-")
    s = Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, segment_bytes=4 * MiB))
    yield s
    s.close()
    shutil.rmtree(path, ignore_errors=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(SET_NAMES, JSON_VALUES, min_size=1, max_size=3), st.booleans())
def test_config_set_applies_all_or_nothing_and_fails_only_with_a_clear_error(
        fuzz_store: Store, changes: dict[str, Any], owner: bool) -> None:
    # values as they arrive: through JSON (which, as Python reads it, has NaN and Infinity)
    changes = json.loads(json.dumps(changes))
    before = fuzz_store.config.to_json()
    set_caller(None if owner else os.geteuid() + 4242)
    try:
        op_config(fuzz_store, {"set": changes}, Job())
    except Denied as exc:
        assert not owner and "may not change" in str(exc)
        assert fuzz_store.config.to_json() == before
    except (StoreError, LmctlError) as exc:
        assert str(exc) and "\n" not in str(exc)
        assert fuzz_store.config.to_json() == before
    finally:
        set_caller(None)
        try:  # back to where it was, as far as a store goes back (a tier once added stays)
            fuzz_store.configure(StoreConfig.from_json(before))
        except StoreError:
            pass


def test_numbers_a_request_cannot_mean_are_usage_errors(daemon: Daemon) -> None:
    from lmctl.client import Client, RemoteError

    c = Client(str(daemon.sock), timeout=30)
    try:
        for cmd, args in (("events", {"since": float("nan")}), ("ls", {"older_than": float("inf")}),
                          ("evict", {"older_than": float("-inf"), "dry_run": True})):
            with pytest.raises(RemoteError) as got:
                c.call(cmd, args)
            assert got.value.code == "usage" and "finite" in str(got.value), (cmd, got.value)
    finally:
        c.close()
    r = cli(daemon, "ls", "--older-than", "9" * 400 + "d")
    one_usage_line(r, "too long a duration")
    r = cli(daemon, "ls", "--older-than", "9" * 400)  # no unit: said without echoing 400 digits back
    assert len(one_usage_line(r, "has no unit")) < 200


# -- the store's own versions ----------------------------------------------------------------------
def set_meta(root: Path, name: bytes, value: bytes) -> None:
    env = lmdb.open(str(root / "index"), max_dbs=16, map_size=1 << 30)
    try:
        meta = env.open_db(b"meta")  # before the write transaction: opening one takes a write lock too
        with env.begin(write=True) as txn:
            txn.put(name, value, db=meta)
    finally:
        env.close()


@pytest.mark.parametrize("readonly", [True, False])
def test_a_newer_or_garbage_format_version_is_refused_with_one_line(tmp_path: Path, readonly: bool) -> None:
    fill(tmp_path / "store")
    set_meta(tmp_path / "store", b"format_version", b"99")
    with pytest.raises(StoreError, match=r"is of format 99, which this lmctl \(format \d+\) does not open; use"):
        Store(tmp_path / "store", readonly=readonly)
    set_meta(tmp_path / "store", b"format_version", b"\xffgarbage")
    with pytest.raises(StoreError, match="format version .* is not a number"):
        Store(tmp_path / "store", readonly=readonly)


@pytest.mark.parametrize("version", [SEG_VERSION + 1, 0])
def test_a_segment_of_another_format_is_never_read_as_this_one(
        tmp_path: Path, version: int, caplog: pytest.LogCaptureFixture) -> None:
    keys = fill(tmp_path / "store")
    seg = sorted((tmp_path / "store" / "nvme").glob("seg-*.lseg"))
    assert len(seg) == 1
    with open(seg[0], "r+b") as f:  # the header's version field (after the 8-byte magic)
        f.seek(8)
        f.write(version.to_bytes(2, "little"))
    shutil.rmtree(tmp_path / "store" / "index")  # the next open rebuilds the index from the segments
    (tmp_path / "store" / "meta.journal").unlink(missing_ok=True)
    with Store(tmp_path / "store") as s:
        assert s.locate(keys) == [None] * len(keys)  # not taken back as records of this format
    assert any(f"segment format {version}" in r.getMessage() for r in caplog.records)


# -- odd puts -------------------------------------------------------------------------------------------
def odd_items(k: bytes) -> dict[str, PutItem]:
    data = bytes(FMT.chunk_bytes)
    return {
        "a layout over 64 KiB": PutItem(k, data, {**LAYOUT, "note": "x" * 70_000}, 16),
        "a layout over the 4 KiB trailer": PutItem(k, data, {**LAYOUT, "note": "x" * 5000}, 16),
        "negative tokens": PutItem(k, data, LAYOUT, -1),
        "tokens of 2**32": PutItem(k, data, LAYOUT, 2**32),
        "tokens that are not whole": PutItem(k, data, LAYOUT, 1.5),  # type: ignore[arg-type]
        "a non-finite number in the layout": PutItem(k, data, {**LAYOUT, "scale": float("inf")}, 16),
        "a layout that is no JSON": PutItem(k, data, {**LAYOUT, "x": {1, 2}}, 16),
        "a layout that is a list": PutItem(k, data, [1, 2], 16),  # type: ignore[arg-type]
        "a key that is text": PutItem("k" * 48, data, LAYOUT, 16),  # type: ignore[arg-type]
        "data that is no buffer": PutItem(k, [1, 2, 3], LAYOUT, 16),  # type: ignore[arg-type]
        "a short prefix id": PutItem(k, data, LAYOUT, 16, prefix=b"abc"),
    }


@pytest.mark.parametrize("case", sorted(odd_items(bytes(48))))
def test_an_odd_put_is_refused_up_front_and_writes_nothing(make_store: Any, case: str) -> None:
    s = make_store()
    ns = Namespace("m", FMT)
    good, k = ns.chunk_keys(list(range(32)))
    before = s.stats().tiers["nvme"]
    with pytest.raises(StoreError) as got:  # the whole batch: a good chunk beside it is not stored either
        s.put_many([PutItem(good, bytes(FMT.chunk_bytes), LAYOUT, 16), odd_items(k)[case]])
    assert type(got.value) is StoreError and "\n" not in str(got.value)
    after = s.stats().tiers["nvme"]
    assert (after.chunks, after.disk_bytes) == (before.chunks, before.disk_bytes) and s.locate([good]) == [None]
    assert s.check() == []
