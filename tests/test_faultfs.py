"""The fault-injection file system itself (tests/faultfs.py): what a power cut keeps and drops,
EIO rules, and that it always unmounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testsupport.faultfs import FaultFS, skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def write(path: Path, data: bytes, sync: bool) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fdatasync(f.fileno())


def test_power_cut_keeps_synced_writes_and_drops_the_rest(tmp_path: Path) -> None:
    b, m = tmp_path / "b", tmp_path / "m"
    with FaultFS(b, m) as fs:
        write(m / "a", b"synced", sync=True)
        write(m / "a", b"+lost", sync=False)
        write(m / "new", b"never synced", sync=False)
        assert (m / "a").read_bytes() == b"synced+lost"  # readers see unsynced writes
        assert (b / "a").read_bytes() == b"synced"
        fs.power_cut()
    assert not os.path.ismount(m)
    assert (b / "a").read_bytes() == b"synced"
    assert not (b / "new").exists()  # made after the last sync: its creation is undone
    assert sorted(os.listdir(b)) == ["a"]


def test_namespace_changes_are_committed_by_any_sync(tmp_path: Path) -> None:
    b, m = tmp_path / "b", tmp_path / "m"
    b.mkdir()
    (b / "old").write_bytes(b"x")
    (b / "gone").write_bytes(b"y")
    with FaultFS(b, m) as fs:
        os.rename(m / "old", m / "renamed")
        write(m / "anchor", b"1", sync=True)  # a journal commit: the rename is durable
        os.unlink(m / "gone")
        os.mkdir(m / "dir")
        assert sorted(os.listdir(m)) == ["anchor", "dir", "renamed"]
        fs.power_cut()
    assert sorted(os.listdir(b)) == ["anchor", "gone", "renamed"]
    assert (b / "gone").read_bytes() == b"y"


def test_modes_and_owners_are_the_callers(tmp_path: Path) -> None:
    b, m = tmp_path / "b", tmp_path / "m"
    with FaultFS(b, m):
        old = os.umask(0o027)
        try:
            fd = os.open(m / "f", os.O_CREAT | os.O_WRONLY, 0o666)
            os.close(fd)
            os.mkdir(m / "d", 0o777)
        finally:
            os.umask(old)
        assert (m / "f").stat().st_mode & 0o777 == 0o640
        assert (b / "d").stat().st_mode & 0o777 == 0o750
        assert (b / "f").stat().st_uid == os.geteuid()


def test_truncate_is_a_write_until_synced(tmp_path: Path) -> None:
    b, m = tmp_path / "b", tmp_path / "m"
    with FaultFS(b, m) as fs:
        write(m / "f", b"0123456789", sync=True)
        os.truncate(m / "f", 4)
        write(m / "f", b"ab", sync=False)
        assert (m / "f").read_bytes() == b"0123ab"
        assert (m / "f").stat().st_size == 6
        fs.power_cut()
    assert (b / "f").read_bytes() == b"0123456789"


def test_reads_fail_with_eio_where_asked(tmp_path: Path) -> None:
    b, m = tmp_path / "b", tmp_path / "m"
    with FaultFS(b, m) as fs:
        write(m / "f", bytes(range(256)) * 64, sync=True)  # 16 KiB
        write(m / "g", b"fine", sync=True)
        fs.fail_reads("f", 8192, 12288)
        with open(m / "f", "rb") as f:
            assert f.read(4096) == bytes(range(256)) * 16
            f.seek(8192)
            with pytest.raises(OSError) as exc:
                f.read(4096)
            assert exc.value.errno == 5
        assert (m / "g").read_bytes() == b"fine"
        fs.clear_faults()
        fs.fail_reads(m / "g", times=1)  # transient: the first read only
        with pytest.raises(OSError):
            (m / "g").read_bytes()
        assert (m / "g").read_bytes() == b"fine"
        fs.clear_faults()
        fs.fail_reads()
        with pytest.raises(OSError):
            (m / "g").read_bytes()
        assert fs.read_errors() == 3


def test_a_clean_exit_syncs_and_a_failing_block_still_unmounts(tmp_path: Path) -> None:
    b, m = tmp_path / "b", tmp_path / "m"
    with FaultFS(b, m):
        write(m / "f", b"kept", sync=False)
    assert (b / "f").read_bytes() == b"kept"
    assert not os.path.ismount(m)
    with pytest.raises(ZeroDivisionError), FaultFS(b, m):
        assert os.path.ismount(m)
        _ = 1 / 0
    assert not os.path.ismount(m)
    assert not (b / ".faultfs-trash").exists()
