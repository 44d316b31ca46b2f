"""What the store keeps private: salts never stored or printed, owner-only files whatever
the umask, and a socket that an allowed second uid can really use (and others cannot)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from conftest import content
from test_daemon import FMT, LAYOUT, Daemon, cj, cli, fill, tokens_file

from lmctl.client import Client, RemoteError
from store import MiB, Namespace, PutItem, Store, StoreConfig, TierConfig

SALT = "tenant-7f3Qz-very-secret-cache-salt"
TOKENS = list(range(1000, 1048))  # three chunks


def all_bytes(root: Path) -> Iterator[tuple[Path, bytes]]:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                yield p, p.read_bytes()


def salted_store(path: Path) -> Namespace:
    ns = Namespace("m", FMT, cache_salt=SALT)
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)}, segment_bytes=4 * MiB)) as s:
        s.register_namespace(ns, {"model_id": "m", "tokenizer": None})
        for k in ns.chunk_keys(TOKENS):
            assert s.put(k, content(k, FMT.chunk_bytes), LAYOUT, tokens=16)
    return ns


# -- salts ------------------------------------------------------------------------------------
def test_salt_is_in_no_file_and_no_output(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ns = salted_store(root)
    for p, data in all_bytes(root):
        assert SALT.encode() not in data, f"the cache salt is stored in {p}"
    with Store(root, readonly=True) as s:
        [(rec, doc)] = s.namespace_records().values()
        assert "cache_salt" not in doc["namespace"] and doc["namespace"]["salt_digest"] == s.salt_digest(SALT)
        assert rec.salted and rec.ns_id == ns.ns_id
        assert rec.namespace(SALT).chunk_keys(TOKENS) == ns.chunk_keys(TOKENS)  # keys come back with the salt
        assert rec.namespace(None).ns_id != ns.ns_id
        assert s.salt_digest("another salt") != rec.salt_digest
    d = Daemon(root)
    d.start()
    try:
        doc_path = tokens_file(tmp_path, TOKENS)
        outputs = []
        r = cj(d, "lookup", "--tokens", doc_path, "--cache-salt", SALT)
        assert r["hit_tokens"] == 48
        assert r["namespace"]["salted"] is True and "cache_salt" not in r["namespace"]
        assert r["namespace"]["salt_digest"] == rec.salt_digest
        outputs.append(r)
        r = cj(d, "lookup", "--tokens", doc_path)  # without the tenant's salt: its chunks are not found
        assert r["hit_tokens"] == 0 and r["namespace"]["salted"] is False
        outputs.append(r)
        outputs += [cj(d, "ls"), cj(d, "inspect"), cj(d, "inspect", "--key", ns.chunk_keys(TOKENS)[0].hex()),
                    cj(d, "ls", "--model", "m"), cj(d, "status")]
        assert outputs[2]["total"] == 3 and outputs[5]["total"] == 3
        human = cli(d, "lookup", "--tokens", doc_path, "--cache-salt", SALT)
        assert human.returncode == 0
        for out in [*map(json.dumps, outputs), human.stdout, human.stderr]:
            assert SALT not in out
    finally:
        assert d.stop() == 0
    assert d.proc is None
    for p, data in all_bytes(root):
        assert SALT.encode() not in data, f"the cache salt is stored in {p}"


def _write_legacy(root: Path, ns: Namespace, unsalted: Namespace) -> None:
    """Turn the store's records into what earlier versions wrote: the raw salt, no salt key."""
    env = lmdb.open(str(root / "index"), max_dbs=16, map_size=1 << 30)
    try:
        meta, nsdb = env.open_db(b"meta"), env.open_db(b"namespaces")
        with env.begin(write=True) as txn:
            txn.delete(b"salt_key", db=meta)
            for n in (ns, unsalted):
                doc = {"namespace": json.loads(n.to_json()), "info": {"model_id": "m"}, "updated": 1.0}
                txn.put(n.ns_id, json.dumps(doc, sort_keys=True).encode(), db=nsdb)
    finally:
        env.close()


def test_records_holding_raw_salts_are_rewritten_when_opened_for_writing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    ns = salted_store(root)
    unsalted = Namespace("m", FMT)
    _write_legacy(root, ns, unsalted)
    with Store(root, readonly=True) as s:  # read-only: nothing rewritten, records still readable
        assert SALT in json.dumps(list(s.namespaces().values()))
        recs = {nid: rec for nid, (rec, _doc) in s.namespace_records().items()}
        assert recs[ns.ns_id].salted and recs[ns.ns_id].salt_digest is None
        assert not recs[unsalted.ns_id].salted
    with caplog.at_level(logging.WARNING, logger="lmctl.store"):
        with Store(root) as s:
            docs = s.namespaces()
            assert SALT not in json.dumps(list(docs.values()))
            assert docs[ns.ns_id]["namespace"]["salt_digest"] == s.salt_digest(SALT)
            assert docs[unsalted.ns_id]["namespace"]["salt_digest"] is None
            assert all("cache_salt" not in d["namespace"] for d in docs.values())
            assert docs[ns.ns_id]["info"] == {"model_id": "m"}  # the rest of the record is kept
            rec, _doc = s.namespace_records()[ns.ns_id]
            assert rec.namespace(SALT).ns_id == ns.ns_id
            assert s.lookup(rec.namespace(SALT), TOKENS).hit_tokens == 48
        migrated = [r for r in caplog.records if "digests of cache salts" in r.getMessage()]
        assert len(migrated) == 1 and "2 namespace records" in migrated[0].getMessage()
        caplog.clear()
        with Store(root) as s:  # once: nothing left to rewrite
            digest = s.namespaces()[ns.ns_id]["namespace"]["salt_digest"]
        assert not [r for r in caplog.records if "digests of cache salts" in r.getMessage()]
    with Store(root) as s:  # the key made during the migration is kept: digests stay stable
        assert s.salt_digest(SALT) == digest


# -- file modes -------------------------------------------------------------------------------
def modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.lstat().st_mode
    out["."] = root.lstat().st_mode
    return out


def assert_private(root: Path, besides: tuple[str, ...] = ()) -> None:
    for rel, mode in modes(root).items():
        if rel in besides:
            continue
        if stat.S_ISDIR(mode):
            assert stat.S_IMODE(mode) == 0o700, f"{rel} is {stat.S_IMODE(mode):04o}"
        elif stat.S_ISREG(mode):
            assert stat.S_IMODE(mode) == 0o600, f"{rel} is {stat.S_IMODE(mode):04o}"


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_a_new_store_is_private_whatever_the_umask(tmp_path: Path, umask: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("store.store.tighten", lambda *a, **k: [])  # creating alone must be private
    root, root2 = tmp_path / "store", tmp_path / "store2"
    outside = tmp_path / "elsewhere" / "dram"
    old = os.umask(umask)
    try:
        fill(root, dram=True)  # an nvme tier and a dram tier at a path of its own, both in the store
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB),
                                 "dram": TierConfig(capacity=64 * MiB, path=str(outside))},
                          segment_bytes=4 * MiB)
        with Store(root2, cfg) as s:
            k = Namespace("m", FMT).chunk_keys(TOKENS)[0]
            assert s.put_many([PutItem(k, bytes(FMT.chunk_bytes), LAYOUT, 16)], "dram") == [True]
        assert_private(root)
        assert_private(root2)
        d = Daemon(root)  # the daemon (same umask) adds its socket and lock file
        d.start()
        try:
            assert cj(d, "status")["store"]["tiers"]["nvme"]["chunks"] == 6
            assert stat.S_IMODE(d.sock.stat().st_mode) == 0o600
        finally:
            assert d.stop() == 0
    finally:
        os.umask(old)
    found = modes(root)
    assert {"index", "index/data.mdb", "index/lock.mdb", "nvme", "dram-tier"} <= set(found)
    assert "lmctl.sock.lock" not in found  # the lock file goes when the daemon stops
    assert any(n.endswith(".lseg") for n in found)
    assert_private(root)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o700
    segs = list(outside.glob("seg-*.lseg"))
    assert segs and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in segs)


def test_a_loose_store_is_tightened_when_its_owner_opens_it_for_writing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    fill(root, dram=True)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    extra = root / "notes.txt"  # not a file the store makes: never the store's to change
    extra.write_text("x")
    os.chmod(extra, 0o666)
    loose = len([root, *root.rglob("*")]) - 1  # everything else in the store is open to others now
    with Store(root, readonly=True):
        pass
    assert stat.S_IMODE((root / "index" / "data.mdb").stat().st_mode) == 0o644  # read-only opens change nothing
    with caplog.at_level(logging.WARNING, logger="lmctl.store"):
        with Store(root):
            pass
    assert_private(root, besides=("notes.txt",))
    assert stat.S_IMODE(extra.stat().st_mode) == 0o666
    tightened = [r for r in caplog.records if "private" in r.getMessage()]
    assert len(tightened) == 1
    msg = tightened[0].getMessage()
    assert f"made {loose} files and folders" in msg and "index (0755)" in msg and "notes.txt" not in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmctl.store"):
        with Store(root):
            pass
    assert not [r for r in caplog.records if "private" in r.getMessage()]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a file as another uid")
def test_files_of_other_users_are_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "store"
    fill(root)
    theirs = root / "theirs.txt"
    theirs.write_text("x")
    os.chown(theirs, 65534, 65534)
    os.chmod(theirs, 0o644)
    os.chmod(root / "index" / "data.mdb", 0o644)
    with Store(root):
        pass
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o644
    assert stat.S_IMODE((root / "index" / "data.mdb").stat().st_mode) == 0o600


# -- the socket and a second uid ---------------------------------------------------------------
def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def users() -> Iterator[dict[str, Any]]:
    """Two throwaway users: ``a`` (with its own group) and ``b``, also a member of a's group."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create users and switch to them")
    import grp
    import pwd

    tag = uuid.uuid4().hex[:8]
    a, b = f"lmcta{tag}", f"lmctb{tag}"
    made: list[str] = []
    try:
        _run("useradd", "-M", "-U", "-s", "/usr/sbin/nologin", a)
        made.append(a)
        _run("useradd", "-M", "-N", "-G", a, "-s", "/usr/sbin/nologin", b)
        made.append(b)
        yield {"a": pwd.getpwnam(a).pw_uid, "b": pwd.getpwnam(b).pw_uid, "group": a,
               "gid": grp.getgrnam(a).gr_gid, "b_gid": pwd.getpwnam(b).pw_gid}
    finally:
        for name in reversed(made):
            subprocess.run(["userdel", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", a], capture_output=True, timeout=60)


def as_user(uid: int, gid: int, groups: list[int], sock: str) -> dict[str, Any]:
    """Call ``status`` on the daemon from a child process running as ``uid``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, connect, report, exit
        code = 0
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                out: dict[str, Any] = {"ok": Client(sock, timeout=10).call("status")}
            except RemoteError as exc:
                out = {"error": exc.code, "message": str(exc)}
            except Exception as exc:
                out = {"error": type(exc).__name__, "message": str(exc)}
            os.write(w, json.dumps({"uid": os.getuid(), **out}).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while data := os.read(r, 65536):
        chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return dict(json.loads(b"".join(chunks)))


def test_an_allowed_uid_connects_through_a_group_socket_and_others_are_denied(
        tmp_path: Path, users: dict[str, Any]) -> None:
    fill(tmp_path / "store")
    run_dir = Path(tempfile.mkdtemp(prefix="lmctl-run-", dir="/tmp"))
    try:
        os.chown(run_dir, 0, users["gid"])
        os.chmod(run_dir, 0o750)  # only the group passes: as /run/lmctl with RuntimeDirectory
        sock = run_dir / "lmctl.sock"
        d = Daemon(tmp_path / "store", sock, ["--init", "--allow-uid", str(users["a"]), "--socket-mode", "0660",
                                                    "--socket-group", users["group"]])
        d.start()
        try:
            st = sock.stat()
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == users["gid"]
            got = as_user(users["a"], users["gid"], [users["gid"]], str(sock))
            assert got["uid"] == users["a"] and "ok" in got, got
            assert d.proc is not None
            assert got["ok"]["daemon"]["pid"] == d.proc.pid and got["ok"]["store"]["tiers"]["nvme"]["chunks"] == 6
            for _ in range(40):  # every time: the reply that says why arrives before the hang-up
                other = as_user(users["b"], users["b_gid"], [users["gid"]], str(sock))
                assert other["error"] == "denied" and f"uid {users['b']}" in other["message"], other
            # and the owner still gets in
            assert cj(d, "status")["daemon"]["pid"] == d.proc.pid
        finally:
            assert d.stop() == 0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _serve_fails(tmp_path: Path, *args: str) -> str:
    r = cli(None, "serve", "--store", str(tmp_path / "store"), "--init", *args)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_serve_refuses_an_allowed_uid_the_socket_keeps_out(tmp_path: Path) -> None:
    uid = 65534 if os.geteuid() != 65534 else 65533
    # the default socket lives in the private store folder
    line = _serve_fails(tmp_path, "--allow-uid", str(uid))
    assert line.startswith("lmctl: ") and "inside the store folder" in line
    assert "--socket /run/lmctl/lmctl.sock --socket-mode 0660 --socket-group" in line
    assert not (tmp_path / "store").exists()  # refused before creating anything
    run_dir = Path(tempfile.mkdtemp(prefix="lmctl-run-", dir="/tmp"))
    try:
        os.chmod(run_dir, 0o755)
        # a reachable folder, but a socket only its owner may use
        line = _serve_fails(tmp_path, "--allow-uid", str(uid), "--socket", str(run_dir / "s.sock"))
        assert "mode 0600" in line and "--socket-mode 0660" in line
        # a socket others may use, in a folder they cannot pass through
        os.chmod(run_dir, 0o700)
        line = _serve_fails(tmp_path, "--allow-uid", str(uid), "--socket", str(run_dir / "s.sock"),
                            "--socket-mode", "0666")
        assert f"the folder {run_dir}" in line and "--socket-group" in line
        assert not (run_dir / "s.sock").exists()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_serve_rejects_bad_socket_options_as_usage_errors(tmp_path: Path) -> None:
    for args in (["--socket-mode", "rw-"], ["--socket-mode", "0755"], ["--socket-mode", "0066"],
                 ["--socket-group", f"no-such-group-{uuid.uuid4().hex[:6]}"]):
        r = cli(None, "serve", "--store", str(tmp_path / "store"), "--init", *args)
        assert r.returncode == 2, r.stdout + r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("lmctl: "), r.stderr
