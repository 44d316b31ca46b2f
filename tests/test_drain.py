"""``lmctl drain`` (docs/cli.md, drain): a real daemon copies a real store's chunks to a real
redis-server, pinned documents first, then by recent hits, within a budget and a deadline;
another host's ``warm --manifest`` brings them back. What went is checked through the store
library and the server, not through drain's own report."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import content, env_with_path
from redis_server import Server, secret_file
from test_cli import lmctl, ok
from test_cli_json import documented, same_keys
from test_daemon import FMT, LAYOUT, NS, TOKENS, Daemon, tokens_file

from lmctl.client import Client
from lmctl.manifest import parse_manifest
from lmctl.terminal import CommandError, ExitStatus
from store import MiB, PutItem, Store, StoreConfig, TierConfig
from store.config import RemoteConfig
from testsupport.lmctl import run

COLD = NS.chunk_keys(list(range(1000, 1096)))  # six chunks nobody pins
DOC = NS.chunk_keys(TOKENS)  # four chunks, pinned as a document


@pytest.fixture
def hosts(tmp_path: Path, servers: Callable[..., Server]) -> Callable[..., Path]:
    """Store folders of hosts on one Redis server (``write = "evict"``: nothing goes there
    until something sends it): ``host(name, remote=True)``."""
    redis = servers()
    secret = str(secret_file(tmp_path))

    def host(name: str, remote: bool = True) -> Path:
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, segment_bytes=4 * MiB,
                          remote=RemoteConfig(redis.url, key_prefix="test", secret_file=secret, write="evict")
                          if remote else None)
        with Store(tmp_path / name, cfg) as s:
            s.register_namespace(NS, {"model_id": "m", "tokenizer": None})  # an engine started here
        return tmp_path / name

    host.redis = redis  # type: ignore[attr-defined]
    return host


def served(folder: Path) -> None:
    """What an engine left in ``folder``: the document and six other chunks, each stored a
    moment after the last; then reads that make COLD[5], COLD[1], COLD[3] hot, the last read
    first (drain's order for them)."""
    with Store(folder) as s:
        for k in DOC + COLD:
            assert s.put_many([PutItem(k, content(k, FMT.chunk_bytes), LAYOUT, 16)]) == [True]
            time.sleep(0.01)
        for i in (3, 1, 5):
            assert s.get(COLD[i]) is not None
            time.sleep(0.01)
        s.flush()


#: drain's order for COLD: read (most recent first), then never read (most recently stored first)
HOTTEST_FIRST = [COLD[5], COLD[1], COLD[3], COLD[4], COLD[2], COLD[0]]


def in_remote(hosts: Callable[..., Path], keys: list[bytes]) -> list[bool]:
    """Which of ``keys`` the remote tier holds (asked by a store of its own)."""
    with Store(hosts("probe")) as s:
        where, unchecked = s.locate_checked(keys)
    assert unchecked == 0
    return [t == "remote" for t in where]


def manifest_keys(path: Path) -> tuple[list[dict[str, Any]], list[bytes]]:
    """A manifest's documents, and the chunk keys of its keys entries in order."""
    docs = json.loads(path.read_text())["documents"]
    return [d for d in docs if "keys" not in d], [bytes.fromhex(k) for d in docs if "keys" in d for k in d["keys"]]


def started(folder: Path, env: dict[str, str] | None = None) -> Daemon:
    d = Daemon(folder, env=env)
    d.start()
    return d


def pin_the_document(d: Daemon, tmp_path: Path) -> None:
    assert ok(d, "pin", "--label", "contracts", "--tokens", tokens_file(tmp_path, TOKENS))["chunks"] == 4


def stored(folder: Path, keys: list[bytes]) -> int:
    total = 0
    with Store(folder, readonly=True) as s:
        for k in keys:
            info = s.info(k)
            assert info is not None, k.hex()
            total += info.stored_bytes
    return total


# -- the whole round trip -------------------------------------------------------------------------
def test_drain_copies_pinned_then_hottest_and_the_replacement_warms_from_its_manifest(
        tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir, b_dir = hosts("a"), hosts("b")
    served(a_dir)
    a = started(a_dir)
    try:
        pin_the_document(a, tmp_path)
        manifest = tmp_path / "drain.json"
        r = ok(a, "drain", "--manifest", str(manifest))
        assert r["went"] == {"chunks": 10, "bytes": stored(a_dir, DOC + COLD), "pinned_chunks": 4, "documents": 1}
        assert (r["left"]["chunks"], r["pinned_left"], r["stopped"], r["entries"]) == (0, 0, None, 2)
        assert [(x["label"], x["document"], x["chunks"], x["went"], x["status"]) for x in r["pinned"]] == [
            ("contracts", "tokens", 4, 4, "went")]
        docs, keys = manifest_keys(manifest)
        assert docs == [{"label": "contracts", "model": "m", "tokens": TOKENS}]  # the pinned document first
        assert keys == HOTTEST_FIRST  # then the others, hottest first
        assert manifest.stat().st_mode & 0o777 == 0o600
        assert in_remote(hosts, DOC + COLD) == [True] * 10
        with Store(a_dir, readonly=True) as s:  # copied, not moved: a still serves until it stops
            assert s.locate(DOC + COLD, remote=False) == ["nvme"] * 10
        # the event log says where they went
        ev = ok(a, "events", "--kind", "remote-copy")
        assert sum(e["chunks"] for e in ev["events"]) == 10 and {e["reason"] for e in ev["events"]} == {"drain"}
        assert all(e["tier"] == "remote" for e in ev["events"]) and ev["counters"]["remote_copies_total"] == {
            "drain": 10}
        text = lmctl(a, "events", "--kind", "remote-copy").stdout
        assert "remote-copy" in text and "drain" in text
    finally:
        assert a.stop() == 0

    b = started(b_dir)  # the replacement: an empty store on the same remote tier
    try:
        got = ok(b, "warm", "--manifest", str(manifest), "--to", "nvme", "--pin")
        assert (got["chunks"], got["fetched"], got["missing"], got["failed"]) == (10, 10, 0, 0)
        assert [x["pinned"] for x in got["entries"]] == [4, None]  # the document pinned again; the rest not
    finally:
        assert b.stop() == 0
    with Store(b_dir, readonly=True) as s:
        assert s.locate(DOC + COLD, remote=False) == ["nvme"] * 10
        assert {k: sorted(v) for k, v in s.labels().items()} == {"contracts": sorted(DOC)}
        for k in DOC + COLD:
            c = s.get(k, touch=False)
            assert c is not None and bytes(c.data) == content(k, FMT.chunk_bytes)  # byte-identical


def test_drain_text_report_and_dry_run(tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    a = started(a_dir)
    try:
        pin_the_document(a, tmp_path)
        manifest = tmp_path / "drain.json"
        r = lmctl(a, "drain", "--manifest", str(manifest), "--dry-run")
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "would copy 10 chunk(s)" in r.stdout and f"would write {manifest}: 2 entries" in r.stdout
        assert not manifest.exists() and in_remote(hosts, DOC + COLD) == [False] * 10  # nothing changed
        r = lmctl(a, "drain", "--manifest", str(manifest))
        assert r.exit_code == 0 and r.stderr == "", r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert any(x.startswith("copied 10 chunk(s)") and "(1 pinned document(s), 4 pinned chunk(s))" in x
                   and x.endswith("the local copies stay") for x in lines), r.stdout
        assert "nothing left behind" in lines
        assert f"wrote {manifest}: 2 entries (1 document(s)); on the replacement: lmctl warm --manifest " \
               f"{manifest}" in lines
    finally:
        assert a.stop() == 0


def test_warm_pin_pins_documents_and_warms_unlabelled_keys_but_a_document_needs_a_label() -> None:
    keys = {"keys": [COLD[0].hex()]}
    doc = {"model": "m", "tokens": TOKENS}
    assert [e.kind for e in parse_manifest(json.dumps([{**doc, "label": "a"}, keys]), "m.json",
                                           need_label=True)] == ["tokens", "keys"]
    with pytest.raises(CommandError, match=r"documents\[0\]\.label: missing: --pin pins each document"):
        parse_manifest(json.dumps([doc, keys]), "m.json", need_label=True)


# -- the limits ----------------------------------------------------------------------------------
def test_a_budget_takes_pinned_then_hottest_and_stops_in_order(tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    a = started(a_dir)
    try:
        pin_the_document(a, tmp_path)
        # room for the document and the two hottest others
        room = stored(a_dir, DOC + HOTTEST_FIRST[:2])
        manifest = tmp_path / "drain.json"
        r = ok(a, "drain", "--manifest", str(manifest), "--budget", f"{room}B")
        assert (r["went"]["chunks"], r["went"]["bytes"], r["budget"], r["stopped"]) == (6, room, room, "budget")
        assert r["left"]["reasons"] == {"budget": {"chunks": 4, "bytes": stored(a_dir, HOTTEST_FIRST[2:]),
                                                   "pinned_chunks": 0}}
        assert r["pinned_left"] == 0  # only unpinned chunks stayed: exit 0
        docs, keys = manifest_keys(manifest)
        assert len(docs) == 1 and keys == HOTTEST_FIRST[:2]
        assert in_remote(hosts, DOC + HOTTEST_FIRST) == [True] * 6 + [False] * 4
    finally:
        assert a.stop() == 0


def test_a_budget_that_leaves_a_pinned_document_behind_exits_1(tmp_path: Path,
                                                              hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    a = started(a_dir)
    try:
        pin_the_document(a, tmp_path)
        manifest = tmp_path / "drain.json"
        r = lmctl(a, "--json", "drain", "--manifest", str(manifest), "--budget", "16KiB")  # under the document
        assert r.exit_code == ExitStatus.ERROR == 1 and r.stderr == "", r.stdout + r.stderr
        got = json.loads(r.stdout)
        assert (got["went"]["chunks"], got["pinned_left"], got["stopped"]) == (0, 1, "budget")
        assert got["pinned"][0] | {"bytes": 0} == {"label": "contracts", "model": "m", "adapter": None,
                                                   "document": "tokens", "chunks": 4, "not_stored": 0, "went": 0,
                                                   "bytes": 0, "left": 4, "reason": "budget", "status": "left"}
        # nothing colder went ahead of it: the order is kept
        assert got["left"]["reasons"]["budget"]["chunks"] == 10
        assert json.loads(manifest.read_text()) == {"version": 1, "documents": []}
        assert in_remote(hosts, DOC + COLD) == [False] * 10
        # a person is told why on stderr, once
        r = lmctl(a, "drain", "--manifest", str(manifest), "--budget", "16KiB")
        assert r.exit_code == 1 and r.stderr == ("lmctl: drain left work undone: 1 pinned entry left behind; "
                                                 "exit 1\n")
        assert "left 10 chunk(s)" in r.stdout and "over the budget" in r.stdout
    finally:
        assert a.stop() == 0


def test_a_deadline_mid_document_lists_what_went_and_exits_1(tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    env = env_with_path()
    env["LMCTL_FAULT_JOB_STEP_DELAY"] = "0.4"  # each chunk takes 0.4 s
    a = started(a_dir, env)
    try:
        pin_the_document(a, tmp_path)
        manifest = tmp_path / "drain.json"
        t0 = time.monotonic()
        r = lmctl(a, "--json", "drain", "--manifest", str(manifest), "--deadline", "1s")
        took = time.monotonic() - t0
        assert r.exit_code == 1, r.stdout + r.stderr
        got = json.loads(r.stdout)
        assert got["stopped"] == "deadline" and got["deadline_s"] == 1.0 and took < 5
        went = got["went"]["chunks"]
        assert 1 <= went <= 3 and got["pinned"][0]["status"] == "partial" and got["pinned_left"] == 1
        assert got["left"]["reasons"]["deadline"]["chunks"] == 10 - went
        # the document did not go whole: its chunks that went are listed by key, under its label
        docs, keys = manifest_keys(manifest)
        assert docs == [] and keys == DOC[:went]
        assert json.loads(manifest.read_text())["documents"][0]["label"] == "contracts"
        assert in_remote(hosts, DOC + COLD) == [True] * went + [False] * (10 - went)
    finally:
        assert a.stop() == 0


def test_bad_limits_and_no_remote_tier_are_usage_errors(tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a", remote=False)
    served(a_dir)
    a = started(a_dir)
    try:
        manifest = tmp_path / "drain.json"
        r = lmctl(a, "drain", "--manifest", str(manifest))
        assert r.exit_code == ExitStatus.USAGE == 2 and r.stdout == "" and r.stderr.count("\n") == 1
        assert r.stderr.startswith("lmctl: this store has no remote tier to drain to; configure one first: "
                                   "lmctl config set remote.url=")
        assert not manifest.exists()
        for argv, says in ((["--budget", "100"], "has no unit"), (["--budget", "lots"], "is not a size"),
                           (["--deadline", "5"], "has no unit"), (["--deadline", "soon"], "is not a duration"),
                           (["--deadline", "0s"], "between 1s and 366d")):
            r = lmctl(a, "drain", "--manifest", str(manifest), *argv)
            assert r.exit_code == 2 and r.stderr.count("\n") == 1 and says in r.stderr, (argv, r.stderr)
        r = lmctl(a, "drain")
        assert r.exit_code == 2 and "--manifest" in r.stderr
        r = lmctl(a, "drain", "--manifest", str(tmp_path / "no" / "such" / "m.json"))
        assert r.exit_code == 2 and "cannot write in" in r.stderr
        for bad, says in (("-", "stdout carries drain's report"), (str(tmp_path), "is a folder")):
            r = lmctl(a, "drain", "--manifest", bad, "--dry-run")
            assert r.exit_code == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    finally:
        assert a.stop() == 0


def test_a_remote_tier_that_does_not_answer_refuses_and_the_drain_exits_1(
        tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    a = started(a_dir)
    try:
        pin_the_document(a, tmp_path)
        hosts.redis.stop()  # type: ignore[attr-defined]
        manifest = tmp_path / "drain.json"
        t0 = time.monotonic()
        r = lmctl(a, "--json", "drain", "--manifest", str(manifest))
        assert r.exit_code == 1 and time.monotonic() - t0 < 30, r.stdout + r.stderr
        got = json.loads(r.stdout)
        assert got["went"]["chunks"] == 0 and got["left"]["reasons"]["refused"]["chunks"] == 10
        assert (got["pinned_left"], got["pinned"][0]["reason"], got["stopped"]) == (1, "refused", None)
        assert json.loads(manifest.read_text())["documents"] == []  # it lists nothing that is not there
        r = lmctl(a, "drain", "--manifest", str(manifest))
        assert r.exit_code == 1 and r.stderr == ("lmctl: drain left work undone: 1 pinned entry left behind; 10 "
                                                 "chunk(s) refused by the remote tier; exit 1\n")
    finally:
        assert a.stop() == 0


def test_a_chunk_evicted_during_the_drain_is_gone_not_a_failure(tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    env = env_with_path()
    env["LMCTL_FAULT_JOB_STEP_DELAY"] = "0.2"
    a = started(a_dir, env)
    try:
        manifest = tmp_path / "drain.json"
        proc = subprocess.Popen([sys.executable, "-m", "lmctl.cli", "--socket", str(a.sock), "--json", "drain",
                                 "--manifest", str(manifest)], env=env_with_path(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        c = Client(str(a.sock), timeout=10)
        end = time.time() + 30
        while time.time() < end and not [j for j in c.call("status")["jobs"] if j["cmd"] == "drain"]:
            time.sleep(0.02)
        c.close()
        assert ok(a, "evict", "--key", COLD[0].hex())["chunks"] == 1  # sixth in drain's order
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        got = json.loads(out)
        assert got["left"]["reasons"] == {"gone": {"chunks": 1, "bytes": got["left"]["bytes"], "pinned_chunks": 0}}
        # nothing is pinned here: the document's chunks, never read and stored first, go last
        assert got["went"]["chunks"] == 9
        assert manifest_keys(manifest)[1] == [k for k in HOTTEST_FIRST + DOC[::-1] if k != COLD[0]]
    finally:
        assert a.stop() == 0


# -- Ctrl-C --------------------------------------------------------------------------------------
def test_ctrl_c_leaves_a_manifest_of_chunks_that_are_all_in_the_remote_tier(
        tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    env = env_with_path()
    env["LMCTL_FAULT_JOB_STEP_DELAY"] = "0.5"  # each chunk takes half a second; what went streams every second
    a = started(a_dir, env)
    try:
        pin_the_document(a, tmp_path)
        manifest = tmp_path / "drain.json"
        proc = subprocess.Popen([sys.executable, "-m", "lmctl.cli", "--socket", str(a.sock), "drain", "--manifest",
                                 str(manifest)], env=env_with_path(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        c = Client(str(a.sock), timeout=10)
        end = time.time() + 30
        while time.time() < end and not [j for j in c.call("status")["jobs"] if j["done"] >= 7]:  # 7 copied
            time.sleep(0.05)
        c.close()
        proc.send_signal(signal.SIGINT)  # Ctrl-C, mid-way through the unpinned chunks
        proc.send_signal(signal.SIGINT)  # twice, as timeout -s INT does: the manifest is still written
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == ExitStatus.INTERRUPTED == 130, out + err
        assert err.count("\n") == 1 and err.startswith("lmctl: drain interrupted after "), err
        assert f"{manifest} lists what went: 1 document(s) and " in err
        docs, keys = manifest_keys(manifest)
        assert docs == [{"label": "contracts", "model": "m", "tokens": TOKENS}]
        assert 1 <= len(keys) < 6 and keys == HOTTEST_FIRST[:len(keys)]  # some went, in order, listed
        # every chunk the manifest lists is whole in the remote tier (a later one may be too, unlisted)
        assert all(in_remote(hosts, DOC + keys))
        assert not all(in_remote(hosts, COLD))  # it stopped
        end = time.time() + 10
        while ok(a, "status")["jobs"] and time.time() < end:
            time.sleep(0.1)
        assert ok(a, "status")["jobs"] == []
        # the event log counts every chunk that went, listed or not
        ev = ok(a, "events", "--kind", "remote-copy")
        assert sum(e["chunks"] for e in ev["events"]) == sum(in_remote(hosts, DOC + COLD))
    finally:
        assert a.stop() == 0


def test_the_daemon_side_cancel_stops_between_chunks_and_logs_what_went(tmp_path: Path,
                                                                       hosts: Callable[..., Path]) -> None:
    """The daemon's own cancellation, without the CLI: a client that hangs up mid-drain."""
    a_dir = hosts("a")
    served(a_dir)
    env = env_with_path()
    env["LMCTL_FAULT_JOB_STEP_DELAY"] = "0.2"
    a = started(a_dir, env)
    try:
        c = Client(str(a.sock), timeout=10)
        seen: list[int] = []

        class Stop(Exception):
            pass

        def progress(done: int, total: int, what: str) -> None:
            seen.append(done)
            if done >= 4:
                raise Stop

        with pytest.raises(Stop):
            c.call("drain", {}, progress)
        c.close()
        end = time.time() + 10
        while ok(a, "status")["jobs"] and time.time() < end:
            time.sleep(0.1)
        went = sum(in_remote(hosts, DOC + COLD))
        assert 4 <= went < 10
        ev = ok(a, "events", "--kind", "remote-copy")
        assert sum(e["chunks"] for e in ev["events"]) == went
    finally:
        assert a.stop() == 0


# -- the documented JSON -------------------------------------------------------------------------
def test_drain_json_has_the_documented_keys(tmp_path: Path, hosts: Callable[..., Path]) -> None:
    a_dir = hosts("a")
    served(a_dir)
    a = started(a_dir)
    try:
        pin_the_document(a, tmp_path)
        r = lmctl(a, "--json", "drain", "--manifest", str(tmp_path / "m.json"), "--budget", "40KiB",
                  "--deadline", "1m")
        same_keys(documented()["drain"], json.loads(r.stdout))
    finally:
        assert a.stop() == 0


def test_a_budget_without_a_unit_is_told_before_any_daemon_is_asked(tmp_path: Path) -> None:
    """Usage errors come first: with no daemon at all, a bad --budget is exit 2, not 3."""
    for argv, says in ((["--budget", "10"], "has no unit"), (["--deadline", "10"], "has no unit")):
        r = run("--socket", str(tmp_path / "none.sock"), "drain", "--manifest", str(tmp_path / "m.json"), *argv)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, (argv, r.stderr)
        assert not (tmp_path / "m.json").exists()
