"""Private folders, checked at every open, and a CLI that checks who serves its socket: what a
second local user can do where a store lives (a real user, real symlinks, FIFOs, sockets),
and what an index moved in from another store can do. The attacks need root (to make the
user and act as it); CI runs as root."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import env_with_path
from test_daemon import LAYOUT, TOKENS, Daemon, fill, tokens_file

from store import MiB, PutItem, Store, StoreConfig, StoreError, TierConfig
from stress.common import content, key
from stress.hostile import HostileUser, fake_daemon, make_open_folder, plant_fifo, plant_file, plant_link, wait_for

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a second user and act as it")


@pytest.fixture(scope="module")
def eve() -> Iterator[HostileUser]:
    """Another local user of the machine (made for this module, removed after it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a second user and act as it")
    with HostileUser() as u:
        yield u


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder of root's that every user may pass through (0755), as /srv or /var/lib are."""
    d = Path(tempfile.mkdtemp(prefix="lmctl-private-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A folder of root's where a second user may create folders (1777, as /dev/shm), in /dev/shm."""
    d = Path(tempfile.mkdtemp(prefix="lmctl-private-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg, msg
    return msg


def serve(*args: str, timeout: float = 30) -> tuple[int, str]:
    """``lmctl serve ARGS``: its exit status and stderr (one that keeps serving fails the test)."""
    p = subprocess.Popen([sys.executable, "-m", "lmctl.cli", "serve", "--maintenance-interval", "0.5", *args],
                         env=env_with_path(), stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        raise AssertionError(f"serve {' '.join(args)} did not refuse to start: it serves") from None
    return p.returncode, err


def digest(path: Path) -> tuple[str, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), stat.S_IMODE(st.st_mode)


def secret_file(tmp_path: Path, name: str = "secret", size: int = 1 << 20) -> Path:
    """A root-only file (0640 in a 0700 folder) that no attack may change."""
    p = tmp_path / name
    p.write_bytes(os.urandom(size))
    os.chmod(p, 0o640)
    return p


def in_child(code: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    """Run ``code`` (its last line prints a JSON result) in a fresh interpreter, bounded in
    time: an open that hangs (a planted FIFO) fails the test instead of hanging it."""
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           env=env_with_path(), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the store hung (a planted FIFO?): no result in {timeout} s") from None
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def dram_config(path: str | Path) -> StoreConfig:
    return StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB), "dram": TierConfig(capacity=64 * MiB,
                                                                                        path=str(path))},
                       default_tier="dram", segment_bytes=4 * MiB)


# -- folders another user made first -----------------------------------------------------------
@root_only
def test_a_dram_folder_another_user_made_first_is_refused_with_one_line(
        tmp_path: Path, eve: HostileUser, shm: Path) -> None:
    hers = shm / "lmctl"  # as the docs' example path once was: /dev/shm/lmctl
    eve.do(make_open_folder, str(hers))
    want = f"dram folder {hers} is owned by uid {eve.uid} and mode 0777; remove it or choose another path"
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "s", dram_config(hers))
    assert one_line(e) == want
    # the connector, pointed there: refused before anything of the store's settings changes
    from engine_hook.config import ConnectorSettings

    st = ConnectorSettings.parse({"store_path": str(tmp_path / "s2"), "dram_capacity": "64MiB",
                                  "dram_path": str(hers)})
    with Store(tmp_path / "s2") as s:
        with pytest.raises(StoreError) as e:
            st.apply(s)
        assert one_line(e) == want
        assert "dram" not in s.config.tiers
    with Store(tmp_path / "s2") as s:  # and the next start is not broken by half-applied settings
        assert "dram" not in s.config.tiers
    # the daemon: a bad setting (exit 2), or, for a store that has that tier already, a failure
    rc, err = serve("--store", str(tmp_path / "s3"), "--init", "--capacity", "dram=64MiB",
                    "--tier-path", f"dram={hers}")
    assert rc == 2 and err.strip().splitlines() == [f"lmctl: bad store setting: {want}"], err
    taken = shm / "taken"
    put_chunks(tmp_path / "s4", dram_config(taken), 1)  # a store whose dram folder, after a reboot, is hers
    shutil.rmtree(taken)
    eve.do(make_open_folder, str(taken))
    rc, err = serve("--store", str(tmp_path / "s4"))
    assert rc == 1 and err.strip().splitlines() == [
        f"lmctl: dram folder {taken} is owned by uid {eve.uid} and mode 0777; remove it or choose another path"], err
    assert os.listdir(hers) == []  # nothing of the store's went into her folder


@root_only
def test_the_connector_checks_the_dram_folder_at_every_start(tmp_path: Path, eve: HostileUser, shm: Path) -> None:
    from engine_hook.config import ConnectorSettings

    dram = shm / "lmctl"
    st = ConnectorSettings.parse({"store_path": str(tmp_path / "s"), "dram_capacity": "64MiB",
                                  "dram_path": str(dram)})
    with Store(tmp_path / "s") as s:  # the first start makes the folder, private
        st.apply(s)
        k = key(1)
        assert s.put(k, content(k, 8192), {"dtype": "uint8"})
    assert stat.S_IMODE(dram.stat().st_mode) == 0o700
    shutil.rmtree(dram)  # a reboot empties /dev/shm; she is quicker than the engine
    eve.do(make_open_folder, str(dram))
    with pytest.raises(StoreError) as e:
        with Store(tmp_path / "s") as s:
            st.apply(s)
    assert one_line(e) == (f"dram folder {dram} is owned by uid {eve.uid} and mode 0777; remove it or choose "
                           "another path")
    assert os.listdir(dram) == []
    with pytest.raises(StoreError, match="dram folder"):  # read-only opens check too
        Store(tmp_path / "s", readonly=True)


@root_only
def test_the_default_dram_folder_lives_under_a_private_per_user_parent(
        tmp_path: Path, eve: HostileUser, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_hook import config

    monkeypatch.setattr(config, "DRAM_ROOT", str(shm))
    st = config.ConnectorSettings.parse({"store_path": str(tmp_path / "s"), "dram_capacity": "64MiB"})
    with Store(tmp_path / "s") as s:
        st.apply(s)
        path = Path(str(s.config.tiers["dram"].path))
        assert path == shm / f"lmctl-{os.geteuid()}" / str(s.store_id)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o700
    # after a reboot, another user makes the per-user parent first
    shutil.rmtree(path.parent)
    eve.do(make_open_folder, str(path.parent))
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "s")
    assert one_line(e) == (f"dram folder {path} is inside {path.parent}, which is owned by uid {eve.uid} and mode "
                           "0777; remove it or choose another path")
    assert os.listdir(path.parent) == []
    st2 = config.ConnectorSettings.parse({"store_path": str(tmp_path / "t"), "dram_capacity": "64MiB"})
    with Store(tmp_path / "t") as t:  # a new store's engine: the same refusal
        with pytest.raises(StoreError, match=f"is inside {path.parent}, which is owned by uid {eve.uid}"):
            st2.apply(t)


@root_only
def test_a_store_folder_another_user_made_first_is_refused(tmp_path: Path, eve: HostileUser, shared: Path) -> None:
    hers = shared / "open"
    os.chmod(shared, 0o777)  # a shared folder, as /tmp without its sticky bit
    eve.do(make_open_folder, str(hers))
    os.chmod(shared, 0o755)
    with pytest.raises(StoreError) as e:
        Store(hers)
    assert one_line(e) == (f"store folder {hers} is owned by uid {eve.uid} and mode 0777; remove it or choose "
                           "another path")
    rc, err = serve("--store", str(hers), "--init")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and f"owned by uid {eve.uid}" in err, err
    # inside a folder of hers that no one else may write in: hers all the same
    os.chmod(hers, 0o755)
    with pytest.raises(StoreError) as e:
        Store(hers / "store")
    assert one_line(e) == (f"store folder {hers / 'store'} is inside {hers}, which is owned by uid {eve.uid} and "
                           "mode 0755; remove it or choose another path")
    assert sorted(os.listdir(hers)) == []


@root_only
def test_a_socket_folder_another_user_made_first_is_refused(tmp_path: Path, eve: HostileUser, shared: Path) -> None:
    fill(tmp_path / "store")
    os.chmod(shared, 0o777)
    run = shared / "run"
    eve.do(make_open_folder, str(run))
    os.chmod(shared, 0o755)
    rc, err = serve("--store", str(tmp_path / "store"), "--socket", str(run / "lmctl.sock"))
    assert rc == 1, err
    assert err.strip().splitlines() == [f"lmctl: socket folder {run} is owned by uid {eve.uid} and mode 0777; "
                                        "remove it or choose another --socket"], err
    assert os.listdir(run) == []


@root_only
def test_lock_file_links_another_user_plants_change_no_file(tmp_path: Path, eve: HostileUser, shared: Path) -> None:
    """She plants the daemon's lock files as links to root-only files: in a store folder she
    made, and in one of root's while it was open to her. No file is chmod'ed or written."""
    a, b = secret_file(tmp_path, "a", 4096), secret_file(tmp_path, "b", 4096)
    before = digest(a), digest(b)
    os.chmod(shared, 0o777)
    hers = shared / "hers"
    eve.do(make_open_folder, str(hers))
    os.chmod(shared, 0o755)
    eve.do(plant_link, str(hers / "lmctl.sock.lock"), str(a))
    eve.do(plant_link, str(hers / "daemon.lock"), str(b))
    rc, err = serve("--store", str(hers), "--init")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and f"store folder {hers} is owned by uid" in err, err
    assert (digest(a), digest(b)) == before
    # a store of root's, left open to others for a while: the links are refused, not followed
    mine = shared / "mine"
    fill(mine)
    os.chmod(mine, 0o777)
    eve.do(plant_link, str(mine / "lmctl.sock.lock"), str(a))
    eve.do(plant_link, str(mine / "daemon.lock"), str(b))
    os.chmod(mine, 0o700)
    rc, err = serve("--store", str(mine))
    assert rc == 1 and err.strip().splitlines() == [
        f"lmctl: lock file {mine / 'lmctl.sock.lock'} is a symbolic link; remove it"], err
    os.unlink(mine / "lmctl.sock.lock")
    rc, err = serve("--store", str(mine))
    assert rc == 1 and err.strip().splitlines() == [f"lmctl: lock file {mine / 'daemon.lock'} is a symbolic link; "
                                                    "remove it"], err
    assert (digest(a), digest(b)) == before


# -- what she plants in a tier folder --------------------------------------------------------
_OPEN_AND_READ = """
import json, sys
from store import Store
from stress.common import content, key
s = Store(sys.argv[1])
n = int(sys.argv[2])
got = {"exact": 0, "miss": 0, "wrong": 0}
for i in range(n):
    c = s.get(key(i))
    got["miss" if c is None else "exact" if bytes(c.data) == content(key(i), 65536) else "wrong"] += 1
got["problems"] = sorted({p.kind for p in s.check()})
got["rebuilt"] = s.rebuild_index()
c = s.get(key(999))
got["planted"] = None if c is None else bytes(c.data).hex()
s.close()
print(json.dumps(got))
"""


def put_chunks(path: Path, cfg: StoreConfig, n: int, start: int = 0) -> None:
    with Store(path, cfg) as s:
        for i in range(start, start + n):
            assert s.put(key(i), content(key(i), 65536), {"dtype": "uint8"})


@root_only
def test_links_and_fifos_planted_in_a_tier_folder_are_never_followed_and_never_hang(
        tmp_path: Path, eve: HostileUser, shared: Path) -> None:
    store = shared / "store"
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, segment_bytes=256 << 10)
    put_chunks(store, cfg, 12)
    secret = secret_file(tmp_path)
    before = digest(secret)
    tier = store / "nvme"
    segs = sorted(tier.glob("seg-*.lseg"))
    assert len(segs) >= 3
    os.chmod(store, 0o755)
    os.chmod(tier, 0o777)  # a careless chmod: for a while, anyone may write in the tier folder
    with pytest.raises(StoreError) as e:
        Store(store)
    assert one_line(e) == (f"nvme folder {tier} is owned by uid 0 and mode 0777; if no one else wrote in it, make it "
                           f"private (chmod 0700 {tier}); else remove it or choose another path")
    eve.do(plant_fifo, str(tier / "seg-000000000500.lseg"))  # unknown to the index
    eve.do(plant_link, str(tier / "seg-000000000501.lseg"), str(secret))
    eve.do(plant_fifo, str(segs[0]))  # a segment the index knows, swapped for a FIFO
    eve.do(plant_link, str(segs[1]), str(secret))  # and one for a link to a root-only file
    os.chmod(tier, 0o700)  # put right again: the store opens, and what she planted stays inert
    got = in_child(_OPEN_AND_READ, str(store), "12", timeout=60)
    assert got["wrong"] == 0 and got["miss"] >= 2 and got["exact"] >= 1, got
    assert "foreign-file" in got["problems"] and got["rebuilt"] == 0, got
    assert digest(secret) == before
    assert stat.S_ISFIFO((tier / "seg-000000000500.lseg").lstat().st_mode)  # hers: left alone
    assert (tier / "seg-000000000501.lseg").is_symlink()


@root_only
def test_a_segment_another_user_planted_is_never_indexed_or_served(
        tmp_path: Path, eve: HostileUser, shared: Path, shm: Path) -> None:
    """A public prompt's chunk key can be computed by anyone: she writes its chunk with her own
    KV into a store of hers and plants the segment where the victim's store will look."""
    os.chmod(shared, 0o777)
    eve.do(make_open_folder, str(shared / "eve"))
    os.chmod(shared, 0o755)
    forged = b"\x66" * 65536

    def her_store(path: str) -> str:
        os.makedirs(path, mode=0o755, exist_ok=True)
        os.chmod(os.path.dirname(path), 0o755)
        with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
            s.put(key(999), forged, {"dtype": "uint8"})
        (seg,) = [n for n in os.listdir(os.path.join(path, "nvme")) if n.endswith(".lseg")]
        return open(os.path.join(path, "nvme", seg), "rb").read().hex()

    seg = eve.do(her_store, str(shared / "eve" / "store"))
    name = "seg-000000000001.lseg"
    # before the victim's first start, in the dram folder its settings name (hers)
    dram = shm / "lmctl"
    eve.do(make_open_folder, str(dram))
    eve.do(plant_file, str(dram / name), seg)
    with pytest.raises(StoreError, match=f"dram folder {dram} is owned by uid {eve.uid}"):
        with Store(tmp_path / "s", dram_config(dram)) as s:
            assert s.get(key(999)) is None
    # in a tier folder of the victim's, while it was open to her: never indexed, never served
    store = shared / "store"
    put_chunks(store, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}), 4)
    os.chmod(store, 0o755)
    os.chmod(store / "nvme", 0o777)
    eve.do(plant_file, str(store / "nvme" / "seg-000000000777.lseg"), seg)
    os.chmod(store / "nvme", 0o700)
    got = in_child(_OPEN_AND_READ, str(store), "4")
    assert got["planted"] is None and got["rebuilt"] == 0 and got["exact"] == 4, got
    assert "foreign-file" in got["problems"]
    # a new store whose folder holds her segment before its first start: refused
    fresh = shared / "fresh"
    (fresh / "nvme").mkdir(parents=True, mode=0o700)
    os.chmod(fresh / "nvme", 0o777)
    eve.do(plant_file, str(fresh / "nvme" / name), seg)
    os.chmod(fresh / "nvme", 0o700)
    with pytest.raises(StoreError) as e:
        Store(fresh)
    assert one_line(e) == (f"nvme folder {fresh / 'nvme'} holds segment files but no marker of this store: this "
                           "store did not make them; move them away or choose an empty folder")


_CRASHING_WRITER = """
import os, signal, sys
from store import MiB, Store, StoreConfig, TierConfig
from stress.common import content, key
cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB), "dram": TierConfig(capacity=64 * MiB,
                  path=sys.argv[2])}, default_tier="dram")
s = Store(sys.argv[1], cfg)
for i in range(3):
    assert s.put(key(i), content(key(i), 65536), {"dtype": "uint8"})
os.kill(os.getpid(), signal.SIGKILL)  # a crash: the segment stays open, its tail never cut
"""


@root_only
def test_recovery_never_cuts_a_file_swapped_in_after_a_writer_crash(
        tmp_path: Path, eve: HostileUser, shared: Path) -> None:
    secret = secret_file(tmp_path)
    before = digest(secret)
    dram = shared / "dram"
    r = subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(tmp_path / "s"), str(dram)],
                       env=env_with_path(), capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    (seg,) = dram.glob("seg-*.lseg")
    os.chmod(dram, 0o777)  # open to her for a while, after the crash
    eve.do(plant_link, str(seg), str(secret))
    os.chmod(dram, 0o700)
    got = in_child(_OPEN_AND_READ, str(tmp_path / "s"), "3")
    assert got["wrong"] == 0 and got["miss"] == 3, got
    assert digest(secret) == before  # not cut to the writer's last record
    assert seg.is_symlink()


# -- the CLI checks who serves its socket ------------------------------------------------------
@root_only
def test_the_cli_refuses_a_socket_another_user_serves_and_sends_nothing(
        tmp_path: Path, eve: HostileUser, shared: Path) -> None:
    os.chmod(shared, 0o777)
    run = shared / "run"  # where the victim's CLI looks for its daemon (e.g. $LMCTL_SOCKET)
    eve.do(make_open_folder, str(run))
    os.chmod(shared, 0o755)
    sock, record = run / "lmctl.sock", run / "heard"
    pid = eve.spawn(fake_daemon, str(sock), str(record))
    try:
        wait_for(sock)
        doc = tokens_file(tmp_path, TOKENS)
        salt = "tenant-7-secret-salt"
        for env in ({}, {"LMCTL_DAEMON_UID": "12345"}):
            r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(sock), "lookup", "--tokens", doc,
                                "--cache-salt", salt], capture_output=True, text=True, timeout=60,
                               env={**env_with_path(), **env})
            assert r.returncode == 3, r.stdout + r.stderr
            assert r.stderr.strip().splitlines() == [
                f"lmctl: the socket {sock} is served by uid {eve.uid} ({eve.name}), which is neither you, root nor a "
                f"--daemon-uid; nothing was sent. If that daemon is one to trust, pass --daemon-uid {eve.uid} (or "
                f"set LMCTL_DAEMON_UID={eve.uid})"], r.stderr
            assert "forged" not in r.stdout
        r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--json", "--socket", str(sock), "status"],
                           capture_output=True, text=True, timeout=60, env=env_with_path())
        assert r.returncode == 3 and json.loads(r.stdout)["error"]["code"] == "untrusted", r.stdout
        assert record.read_bytes() == b""  # not a byte, no salt
        # an operator who means to use her daemon says so: then it is spoken to
        r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(sock), "--daemon-uid", eve.name,
                            "--json", "status"], capture_output=True, text=True, timeout=60, env=env_with_path())
        assert r.returncode == 0 and json.loads(r.stdout) == {"forged": True}, r.stdout + r.stderr
        assert b'"status"' in record.read_bytes()
    finally:
        eve.stop(pid)
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--daemon-uid", "no-such-user-x", "status"],
                       capture_output=True, text=True, timeout=60, env=env_with_path())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no-such-user-x" in r.stderr


def test_the_cli_talks_to_its_own_daemon(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        r = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(d.sock), "--json", "status"],
                           capture_output=True, text=True, timeout=60, env=env_with_path())
        assert r.returncode == 0 and json.loads(r.stdout)["store"]["tiers"]["nvme"]["chunks"] == 6
    finally:
        assert d.stop() == 0


# -- store ids: folders and indexes of other stores --------------------------------------------
def _drop_most(path: Path) -> None:
    with Store(path) as s:
        s.evict([key(i) for i in range(20)])
        s.compact(min_dead_ratio=0.0)


def test_another_stores_index_moved_in_deletes_none_of_this_stores_files(tmp_path: Path) -> None:
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, segment_bytes=256 << 10)
    a, b = tmp_path / "a", tmp_path / "b"
    put_chunks(a, cfg, 24)  # a's index has issued segment ids that b's files have too
    _drop_most(a)
    put_chunks(b, cfg, 6, start=100)
    files = {p.name: p.read_bytes() for p in (b / "nvme").glob("seg-*.lseg")}
    assert files
    shutil.rmtree(b / "index")
    shutil.copytree(a / "index", b / "index")  # a's index, moved into b
    with pytest.raises(StoreError) as e:
        Store(b)
    msg = one_line(e)
    assert f"the index {b / 'index'} is not this store's" in msg and "moved or copied in" in msg
    assert {p.name: p.read_bytes() for p in (b / "nvme").glob("seg-*.lseg")} == files
    with pytest.raises(StoreError, match="is not this store's"):
        Store(b, readonly=True)
    shutil.rmtree(b / "index")  # moved aside: b's own index comes back from its own files
    with Store(b) as s:
        for i in range(100, 106):
            c = s.get(key(i))
            assert c is not None and bytes(c.data) == content(key(i), 65536)


def test_a_tier_folder_of_another_store_is_refused(tmp_path: Path) -> None:
    dram = tmp_path / "dram"
    with Store(tmp_path / "a", dram_config(dram)) as s:
        assert s.put(key(1), content(key(1), 8192), {"dtype": "uint8"})
        a_id = s.store_id
    files = {p.name: p.read_bytes() for p in dram.iterdir()}
    with pytest.raises(StoreError) as e:
        Store(tmp_path / "b", dram_config(dram))  # the same dram folder, by mistake
    assert one_line(e) == (f"dram folder {dram} belongs to another store ({a_id}, says its .lmctl-tier); give this "
                           "store's dram tier a folder of its own")
    assert {p.name: p.read_bytes() for p in dram.iterdir()} == files
    with Store(tmp_path / "c") as s:  # a dram tier added later, in that folder: refused, nothing changed
        with pytest.raises(StoreError, match="belongs to another store"):
            s.configure(dram_config(dram))
        assert "dram" not in s.config.tiers
    with Store(tmp_path / "c") as s:
        assert "dram" not in s.config.tiers
    with Store(tmp_path / "a") as s:
        c = s.get(key(1))
        assert c is not None and bytes(c.data) == content(key(1), 8192)


def test_the_store_id_is_kept_in_the_index_and_the_markers(tmp_path: Path) -> None:
    with Store(tmp_path / "s", dram_config(tmp_path / "d")) as s:
        sid = s.store_id
        s.put_many([PutItem(key(1), content(key(1), 8192), LAYOUT, 16)], "nvme")
    assert sid is not None and len(sid) == 32
    assert sid in (tmp_path / "s" / ".lmctl-store").read_text()
    assert sid in (tmp_path / "s" / "nvme" / ".lmctl-tier").read_text()
    assert sid in (tmp_path / "d" / ".lmctl-tier").read_text()
    (seg,) = (tmp_path / "s" / "nvme").glob("seg-*.lseg")
    assert bytes.fromhex(sid) in seg.read_bytes()[:4096]  # and in each segment's header
    shutil.rmtree(tmp_path / "s" / "index")  # a lost index: rebuilt under the same id
    with Store(tmp_path / "s") as s:
        assert s.store_id == sid and s.get(key(1)) is not None
    with Store(tmp_path / "s", readonly=True) as s:
        assert s.store_id == sid
