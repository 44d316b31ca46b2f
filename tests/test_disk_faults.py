"""Disk faults on real file systems: EIO on reads (a FUSE passthrough that fails chosen
reads, tests/faultfs.py), a file system that goes read-only (a loop-mounted ext4), and a
dram tier whose tmpfs is full. Each is misses and counted refusals, never an exception into
an engine and never an exit of the daemon."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import content, key, loop_ext4

from store import (
    DiskFullError,
    KVFormat,
    MiB,
    Namespace,
    PutItem,
    ReadOnlyError,
    Store,
    StoreConfig,
    TierConfig,
    open_shared,
    release_shared,
)
from store.clock import ManualClock
from stress.scenario_full_shm import fill
from testsupport.faultfs import FaultFS, skip_reason

CHUNK = 64 << 10


def segment_of(store: Store, k: bytes) -> tuple[str, int, int]:
    """(segment file name, first byte, end) of ``k``'s record payload."""
    info = store.info(k)
    assert info is not None
    return f"seg-{info.segment:012d}.lseg", info.offset, info.offset + info.stored_bytes


# -- EIO on reads -------------------------------------------------------------------------------
@pytest.fixture
def eio(tmp_path: Path) -> Iterator[tuple[FaultFS, Store]]:
    """A store whose nvme tier lives on a FUSE mount that can fail chosen reads; its index is
    on the ordinary disk."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB, path=str(tmp_path / "mnt" / "nvme"))},
                          segment_bytes=4 * MiB)
        s = Store(tmp_path / "store", cfg)
        try:
            yield fs, s
        finally:
            s.close()


def test_eio_on_a_read_is_a_miss_counted_and_the_chunk_dropped(eio: tuple[FaultFS, Store]) -> None:
    """Today an OSError comes out of ``get`` and ``get_into``."""
    fs, s = eio
    keys = [key(i) for i in range(6)]
    for k in keys:
        assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    bad = {keys[1], keys[4]}
    for k in bad:
        name, a, b = segment_of(s, k)
        fs.fail_reads(f"nvme/{name}", a, b)
    out = np.zeros(CHUNK, dtype=np.uint8)  # numpy's stubs make ndarray a Buffer only on 3.12+: the ignore
    for i, k in enumerate(keys):
        got = s.get_into(k, out) if i % 2 else s.get(k)  # type: ignore[arg-type]
        if k in bad:
            assert got is None
        else:
            assert got is not None
            data = out.tobytes() if i % 2 else bytes(got.data)  # type: ignore[union-attr]
            assert data == content(k, CHUNK)
    assert fs.read_errors() >= 2
    assert not any(s.contains(k) for k in bad) and all(s.contains(k) for k in set(keys) - bad)
    assert s.event_counters()["corrupt_total"] == {"io-error": 2}
    ev = [e for e in s.events(kinds=["corrupt"])]
    assert [e["reason"] for e in ev] == ["io-error", "io-error"] and "Input/output error" in ev[0]["detail"]
    s.flush()
    cells = {c.labels["reason"]: c.value for c in s.metric_cells() if c.name == "read_failures_total"}
    assert cells == {"io-error": 2}


def test_verify_deep_lists_every_unreadable_chunk_and_fix_drops_them_all(eio: tuple[FaultFS, Store]) -> None:
    """Today the deep pass stops at the first EIO (the OSError comes out of ``check``)."""
    fs, s = eio
    keys = [key(i) for i in range(8)]
    for k in keys:
        assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    bad = {keys[0], keys[3], keys[7]}
    for k in bad:
        name, a, b = segment_of(s, k)
        fs.fail_reads(f"nvme/{name}", a, b)
    found = s.check(deep=True)
    errors = [p for p in found if p.kind == "read-error"]
    assert len(errors) == 3 and all("Input/output error" in p.detail for p in errors)
    assert all(s.contains(k) for k in keys)  # only listed
    fixed = s.check(deep=True, fix=True)
    assert sum(p.kind == "read-error" and p.fixed for p in fixed) == 3
    assert [k for k in keys if s.contains(k)] == [k for k in keys if k not in bad]
    fs.clear_faults()
    assert [p.kind for p in s.check(deep=True) if p.kind != "orphan-file"] == []
    for k in keys:
        c = s.get(k)
        assert (c is None) == (k in bad)


def test_a_transient_eio_of_one_chunk_leaves_the_others_readable(eio: tuple[FaultFS, Store]) -> None:
    fs, s = eio
    keys = [key(i) for i in range(3)]
    for k in keys:
        assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    name, a, b = segment_of(s, keys[1])
    fs.fail_reads(f"nvme/{name}", a, b, times=1)
    assert s.get(keys[1]) is None
    assert [bytes(c.data) for c in map(s.get, (keys[0], keys[2])) if c is not None] == [
        content(keys[0], CHUNK), content(keys[2], CHUNK)]
    # dropped: an engine saves it again, and it reads back
    assert s.put(keys[1], content(keys[1], CHUNK), {"dtype": "uint8"}, tokens=16)
    c = s.get(keys[1])
    assert c is not None and bytes(c.data) == content(keys[1], CHUNK)
    assert os.path.isdir(fs.mountpoint / "nvme")


# -- a read-only file system ----------------------------------------------------------------------
class Ext4:
    """A small loop-mounted ext4 (``errors=remount-ro``) that a test can make read-only: at
    once (``remount_ro``, when nothing has a file open for writing) or under running writers,
    as after a disk error (``fail``: ext4's own error trigger)."""

    def __init__(self, mnt: Path) -> None:
        self.mnt = mnt

    def remount_ro(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.mnt)], check=True)

    def fail(self) -> None:
        dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(self.mnt)], capture_output=True, text=True,
                             check=True).stdout.strip()
        Path(f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error").write_text("lmctl test\n")
        with pytest.raises(OSError) as err:
            (self.mnt / "probe").write_bytes(b"x")
        assert err.value.errno == errno.EROFS


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Ext4]:
    with loop_ext4(tmp_path, "64M", "loop,errors=remount-ro") as mnt:
        yield Ext4(mnt)


def filled(path: Path, n: int = 6) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=32 * MiB)}, segment_bytes=4 * MiB)) as s:
        for k in keys:
            assert s.put(k, content(k, CHUNK), {"dtype": "uint8"}, tokens=16)
    return keys


def test_a_store_whose_disk_goes_read_only_serves_hits_and_refuses_saves(ext4: Ext4) -> None:
    """The filesystem goes read-only under an open store (an ext4 error, errors=remount-ro).
    Today the first access-log flush raises IndexWriteError out of ``get`` and every save fails
    as an unknown error; now reads go on, saves raise ReadOnlyError and are counted."""
    keys = filled(ext4.mnt / "s")
    s = open_shared(ext4.mnt / "s", StoreConfig(access_flush_s=0.0))  # flush at every hit
    try:
        assert not s.readonly and s.get(keys[0]) is not None
        ext4.fail()
        for k in keys:
            c = s.get(k)
            assert c is not None and bytes(c.data) == content(k, CHUNK)
        with pytest.raises(ReadOnlyError, match="read-only"):
            s.put(key(99), content(key(99), CHUNK), {"dtype": "uint8"}, tokens=16)
        assert s.readonly and "read-only" in (s.readonly_reason or "")
        with pytest.raises(ReadOnlyError):
            s.put_many([PutItem(key(i), content(key(i), CHUNK), {"dtype": "uint8"}, 16) for i in (100, 101)])
        assert s.refused_saves == 3
        assert s.maintain().evicted == 0  # nothing to do, and no error
        assert s.get_into(keys[1], bytearray(CHUNK), expect=CHUNK) is not None
    finally:
        release_shared(s)


def test_an_engine_opens_a_store_on_a_read_only_disk_read_only(ext4: Ext4, tmp_path: Path) -> None:
    """Today the engine's open fails and advises moving the index aside (nothing is damaged).
    Now it opens read-only: loads are served, saves dropped and counted as read_only."""
    import torch

    from engine_hook.config import ConnectorSettings
    from engine_hook.context import ConnectorContext
    from engine_hook.ops import LoadOp, SaveOp
    from engine_hook.worker import LMCtlConnectorWorker

    fmt = KVFormat("float32", num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=32)
    layers = [f"l{i}" for i in range(fmt.num_layers)]
    settings = ConnectorSettings.parse({"store_path": str(ext4.mnt / "s"), "chunk_size": 32,
                                        "model_fingerprint": "off", "save_queue": 2})
    ctx = ConnectorContext(settings, "m", fmt, layers, 16, None, None, {"engine": "test"})
    first, second = Namespace("m", fmt).chunk_keys(list(range(64)))
    g = torch.Generator().manual_seed(0)
    caches = {n: torch.randn(8, 2, 16, 16, generator=g) for n in layers}
    w = LMCtlConnectorWorker(ctx)
    w.register_kv_caches(caches)
    w.save([SaveOp("r1", first, [0, 1])])
    assert w.flush(10)
    w.close()
    ext4.remount_ro()
    with pytest.raises(ReadOnlyError, match="read-only filesystem") as err:
        Store(ext4.mnt / "s")  # a plain open says what is wrong
    assert "move" not in str(err.value)
    w = LMCtlConnectorWorker(ctx)
    try:
        assert w.store.readonly
        w.register_kv_caches(caches)
        w.load([LoadOp("r2", [first], [[2, 3]])])
        assert w.wait_loads(30) and w.take_finished() == {"r2"} and w.take_load_errors() == set()
        assert all(torch.equal(t[[2, 3]], t[[0, 1]]) for t in caches.values())
        w.save([SaveOp("r2", second, [4, 5])])
        assert w.flush(10)
        assert w.stats()["writer"]["read_only"] == 1 and w.stats()["writer"]["failed"] == 0
        counts = (w.take_stats() or {})["counters"]
        assert counts["dropped_saves"] == {"read_only": 1}
    finally:
        w.close()


def test_the_daemon_serves_a_store_on_a_read_only_disk_read_only(ext4: Ext4, tmp_path: Path) -> None:
    """Today ``serve`` exits 1 (a crash loop under Restart=on-failure). Now it serves: hits,
    a status that says read-only, and writes refused with one line."""
    from test_daemon import Daemon, cj, cli

    keys = filled(ext4.mnt / "s")
    ext4.remount_ro()
    (tmp_path / "run").mkdir(mode=0o700)  # serve refuses a socket folder that does not exist
    d = Daemon(ext4.mnt / "s", tmp_path / "run" / "lmctl.sock")
    d.start()
    try:
        st = cj(d, "status")
        assert st["store"]["readonly"] is True and "read-only" in st["store"]["readonly_reason"]
        assert st["store"]["tiers"]["nvme"]["chunks"] == len(keys)
        r = cli(d, "status")
        assert r.returncode == 0 and "read-only" in r.stdout and "saves refused" in r.stdout
        assert cj(d, "inspect", "--key", keys[0].hex())["chunk"]["tokens"] == 16
        r = cli(d, "evict", "--key", keys[0].hex())
        assert r.returncode == 1 and "read-only" in r.stderr and r.stderr.count("\n") == 1
        assert cj(d, "verify", "--deep")["ok"] is True
    finally:
        assert d.stop() == 0


def test_the_daemon_keeps_serving_when_its_disk_goes_read_only_under_a_writer(ext4: Ext4, tmp_path: Path) -> None:
    from test_daemon import Daemon, cj

    keys = filled(ext4.mnt / "s")
    (tmp_path / "run").mkdir(mode=0o700)  # serve refuses a socket folder that does not exist
    d = Daemon(ext4.mnt / "s", tmp_path / "run" / "lmctl.sock")
    d.start()
    s = open_shared(ext4.mnt / "s")
    try:
        assert cj(d, "status")["store"]["readonly"] is False
        ext4.fail()
        with pytest.raises(ReadOnlyError):  # the engine's next save
            s.put(key(50), content(key(50), CHUNK), {"dtype": "uint8"}, tokens=16)
        assert s.readonly and s.get(keys[2]) is not None and s.refused_saves == 1
        # the daemon's next maintenance pass (every 0.5 s here) finds its store read-only
        end = time.monotonic() + 20
        while not (st := cj(d, "status"))["store"]["readonly"] and time.monotonic() < end:
            time.sleep(0.1)
        assert st["store"]["readonly"] is True and "went read-only" in st["store"]["readonly_reason"]
        assert st["store"]["tiers"]["nvme"]["chunks"] == len(keys)
        assert d.proc is not None and d.proc.poll() is None
        assert s.get(keys[0]) is not None  # nothing was evicted or lost
    finally:
        release_shared(s)
        assert d.stop() == 0


# -- a full dram tier ---------------------------------------------------------------------------------
@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs, as a /dev/shm that another local user can fill (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_dram_tier_spills_saves_to_nvme_and_is_tried_again_later(
        small_shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Today every save to a dram tier whose tmpfs another user filled raises DiskFullError,
    though nvme has room. Now the batch goes to nvme (counted), and dram is tried again after
    ``SPILL_RETRY_S``."""
    import store.ops.writes

    clock = ManualClock()
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=64 * MiB, path=str(small_shm / "lmctl")),
                             "nvme": TierConfig(capacity=64 * MiB)}, default_tier="dram", segment_bytes=4 * MiB)
    s = Store(tmp_path / "store", cfg, clock=clock)
    try:
        assert s.put(key(0), content(key(0), CHUNK), {"dtype": "uint8"}, tokens=16)
        hog = fill(small_shm)
        keys = [key(i) for i in range(1, 41)]  # 2.5 MiB: more than any room left in dram's tmpfs
        for i in range(0, 40, 4):
            items = [PutItem(k, content(k, CHUNK), {"dtype": "uint8"}, 16) for k in keys[i:i + 4]]
            assert all(s.put_many(items))
        assert s.locate(keys, remote=False) == ["nvme"] * 40
        s.flush()
        spilled = [c for c in s.metric_cells() if c.name == "saves_spilled_total"]
        assert [(c.labels, c.value) for c in spilled] == [({"from": "dram", "to": "nvme"}, 40)]
        assert all(bytes(c.data) == content(k, CHUNK) for k in keys if (c := s.get(k)) is not None)
        hog.unlink()  # room again: after the retry time, saves go to dram
        assert s.put(key(98), content(key(98), CHUNK), {"dtype": "uint8"}, tokens=16)
        assert s.locate([key(98)], remote=False) == ["nvme"]  # not before it
        clock.advance(store.ops.writes.SPILL_RETRY_S)
        assert s.put(key(99), content(key(99), CHUNK), {"dtype": "uint8"}, tokens=16)
        assert s.locate([key(0), key(99)], remote=False) == ["dram", "dram"]
    finally:
        s.close()


def test_a_tier_named_by_the_caller_never_spills(small_shm: Path, tmp_path: Path) -> None:
    cfg = StoreConfig(tiers={"dram": TierConfig(capacity=64 * MiB, path=str(small_shm / "lmctl")),
                             "nvme": TierConfig(capacity=64 * MiB)}, default_tier="dram")
    with Store(tmp_path / "store", cfg) as s:
        fill(small_shm)
        with pytest.raises(DiskFullError, match="dram"):
            s.put_many([PutItem(key(1), content(key(1), CHUNK), {"dtype": "uint8"}, 16)], tier="dram")
        assert not s.contains(key(1))
