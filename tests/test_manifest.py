"""Manifests: ``pin --export-manifest`` on one store, ``warm --manifest`` on another (docs/cli.md,
Manifests). The CLI runs in-process against real daemons; what changed is checked through
the store library."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, content, fake_engine
from redis_server import Server, secret_file
from test_cli import error, lmctl, ok
from test_daemon import FMT, LAYOUT, NS, OTHER, TOKENS, Daemon, fill, library, tokens_file

from lmctl.manifest import parse_manifest
from lmctl.terminal import CommandError
from store import MiB, Namespace, PutItem, Store, StoreConfig, TierConfig
from store.config import RemoteConfig

NEW = list(range(900, 948))  # three chunks no store holds


def write(tmp_path: Path, body: Any, name: str = "manifest.json") -> str:
    p = tmp_path / name
    p.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(p)


# -- the format ----------------------------------------------------------------------------------
GOOD = {"label": "a", "model": "m", "tokens": [1, 2, 3]}
KEY = "ab" * 48


@pytest.mark.parametrize(("body", "where"), [
    ("[{", "is not valid JSON"),
    ({"version": 1, "documents": [], "extra": 1}, ": extra: unknown field"),
    ({"version": 2, "documents": []}, ": version: 2 is newer"),
    ({"version": "1", "documents": []}, ": version: must be a positive integer"),
    ({"version": 1}, ": documents: missing"),
    ({"documents": {"a": 1}}, ": documents: must be a list"),
    ([GOOD, 3], ": documents[1]: must be an object"),
    ([GOOD, {"tokens": [1], "txt": "a"}], ": documents[1].txt: unknown field"),
    ([GOOD, {"model": "m"}], ": documents[1]: has no document: give text, messages, tokens or keys"),
    ([GOOD, {"text": "a", "tokens": [1]}], ": documents[1].text+tokens: an entry has one document"),
    ([{"model": 3, "text": "a"}], ": documents[0].model: must be a non-empty string"),
    ([{"tokens": ["1"]}], ": documents[0].tokens: must be a non-empty list of token ids"),
    ([{"tokens": []}], ": documents[0].tokens: must be a non-empty list"),
    ([{"tokens": [True]}], ": documents[0].tokens: must be"),
    ([{"tokens": [2**32]}], ": documents[0].tokens: must be"),
    ([{"text": ""}], ": documents[0].text: must be a non-empty string"),
    ([{"messages": [{"content": "hi"}]}], ": documents[0].messages: must be a non-empty list of"),
    ([{"messages": "hi"}], ": documents[0].messages: must be"),
    ([{"keys": ["zz"]}], ": documents[0].keys: must be a non-empty list of chunk keys"),
    ([{"keys": [KEY], "cache_salt": "s"}], ": documents[0].cache_salt: not in a keys entry"),
    ([{"keys": [KEY], "base": True}], ": documents[0].base: not in a keys entry"),
    ([{"text": "a", "base": "yes"}], ": documents[0].base: must be true or false"),
    ([{"text": "a", "adapter": "./civil"}], ": documents[0].adapter: must be NAME or NAME@DIGEST: a manifest"),
    ([{"text": "a", "adapter": "civil@"}], ": documents[0].adapter: must be NAME or NAME@DIGEST"),
    ([{"text": "a", "adapter": "civil", "base": True}], ": documents[0].base: contradicts adapter"),
    ([{"text": "a", "label": ""}], ": documents[0].label: must be a non-empty string"),
    ([{"text": "a", "label": "x" * 201}], ": documents[0].label: must be at most 200"),
    ([{"text": "a", "needs_cache_salt": 1}], ": documents[0].needs_cache_salt: must be true or false"),
    ([GOOD, {"text": "a", "needs_cache_salt": True}], ": documents[1].needs_cache_salt: this document was pinned"),
])
def test_a_bad_manifest_is_a_usage_error_naming_entry_and_field(tmp_path: Path, body: Any, where: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(CommandError) as exc:
        parse_manifest(Path(path).read_text(), path)
    assert exc.value.code == "usage" and where in str(exc.value), str(exc.value)
    # on the command line: exit 2, one line, before any request (no daemon here)
    r = lmctl(None, "--socket", str(tmp_path / "none.sock"), "warm", "--manifest", path)
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and where in r.stderr, r.stderr
    assert r.stderr.startswith(f"lmctl: manifest {path}")
    e = error(lmctl(None, "--socket", str(tmp_path / "none.sock"), "--json", "warm", "--manifest", path))
    assert e["code"] == "usage" and where in e["message"]


def test_manifest_options_are_checked_before_any_request(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")
    salted = write(tmp_path, [{"text": "a", "needs_cache_salt": True}, {"text": "b", "cache_salt": "mine"}])
    assert len(parse_manifest(Path(salted).read_text(), salted, cache_salt="s")) == 2
    plain = write(tmp_path, [GOOD], "plain.json")
    e = error(lmctl(None, "--socket", sock, "--json", "warm", "--manifest", plain, "--cache-salt", "s"))
    assert e["exit"] == 2 and "has none" in e["message"] and "--cache-salt applies" in e["message"]
    e = error(lmctl(None, "--socket", sock, "--json", "warm", "--manifest", plain, "--label", "a"))
    assert e["exit"] == 2 and e["message"] == "--manifest takes its selectors from the manifest: drop --label"
    unlabelled = write(tmp_path, [GOOD, {"tokens": [1]}], "unlabelled.json")
    e = error(lmctl(None, "--socket", sock, "--json", "warm", "--manifest", unlabelled, "--pin"))
    assert e["exit"] == 2 and "documents[1].label: missing: --pin" in e["message"]
    e = error(lmctl(None, "--socket", sock, "--json", "warm", "--pin", "--label", "a"))
    assert e["exit"] == 2 and "--pin goes with --manifest" in e["message"]
    e = error(lmctl(None, "--socket", sock, "--json", "warm", "--manifest", str(tmp_path / "absent.json")))
    assert e["exit"] == 2 and "cannot read manifest" in e["message"]
    e = error(lmctl(None, "--socket", sock, "--json", "pin", "--export-manifest", "x.json", "--tier", "nvme"))
    assert e["exit"] == 2 and "takes --label, --model, --adapter and --base, not --tier" in e["message"]
    # the list alone is a manifest too; the example in docs/cli.md is one
    assert [e.kind for e in parse_manifest(json.dumps([GOOD, {"keys": [KEY]}]), "list")] == ["tokens", "keys"]
    example = re.search(r"<!-- manifest example -->\n```json\n(.*?)```", (ROOT / "docs" / "cli.md").read_text(), re.S)
    assert example is not None
    kinds = [e.kind for e in parse_manifest(example.group(1), "docs/cli.md", cache_salt="s")]
    assert kinds == ["messages", "text", "tokens", "keys"]


# -- export --------------------------------------------------------------------------------------
def test_export_writes_documents_and_keys_and_never_a_salt(daemon: Daemon, tmp_path: Path) -> None:
    doc, other = NS.chunk_keys(TOKENS), NS.chunk_keys(OTHER)
    ok(daemon, "pin", "--label", "contracts", "--tokens", tokens_file(tmp_path, TOKENS))
    ok(daemon, "pin", "--label", "contracts", "--key", other[0].hex())  # pinned by key: no document
    ok(daemon, "pin", "--label", "tenant", "--tokens", tokens_file(tmp_path, NEW, "new.json"),
       "--cache-salt", "tenant-secret")
    ok(daemon, "pin", "--label", "dry", "--tokens", tokens_file(tmp_path, OTHER, "o.json"), "--dry-run")
    out = tmp_path / "contracts.json"
    r = ok(daemon, "pin", "--export-manifest", str(out), "--label", "contracts")
    assert r == {"manifest": str(out), "entries": 2, "documents": 1, "keys": 1, "chunks": 5,
                 "needs_cache_salt": 0, "dry_run": False}
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600  # it holds the documents themselves
    assert json.loads(out.read_text()) == {"version": 1, "documents": [
        {"label": "contracts", "model": "m", "tokens": TOKENS},
        {"label": "contracts", "model": "m", "keys": [other[0].hex()]}]}

    everything = tmp_path / "all.json"
    r = ok(daemon, "pin", "--export-manifest", str(everything))
    assert (r["entries"], r["needs_cache_salt"], r["chunks"]) == (3, 1, 8)
    text = everything.read_text()
    assert "tenant-secret" not in text
    for folder, _dirs, files in os.walk(daemon.store):  # nor does the daemon's record of it
        for f in files:
            if (Path(folder) / f).is_file():  # not the socket
                assert b"tenant-secret" not in (Path(folder) / f).read_bytes(), f
    salted = json.loads(text)["documents"][2]
    assert salted == {"label": "tenant", "model": "m", "needs_cache_salt": True, "tokens": NEW}
    with pytest.raises(CommandError, match="needs_cache_salt"):
        parse_manifest(text, "all.json")
    assert ok(daemon, "pin", "--export-manifest", str(tmp_path / "m.json"), "--model", "m")["entries"] == 3
    assert ok(daemon, "pin", "--export-manifest", str(tmp_path / "b.json"), "--base", "--label", "tenant")[
        "documents"] == 1
    dry = ok(daemon, "pin", "--export-manifest", str(tmp_path / "dry.json"), "--label", "tenant", "--dry-run")
    assert dry["dry_run"] is True and not (tmp_path / "dry.json").exists()
    r = lmctl(daemon, "pin", "--export-manifest", "-", "--label", "contracts")  # stdout: the manifest only
    assert r.exit_code == 0 and json.loads(r.stdout) == json.loads(out.read_text())
    e = error(lmctl(daemon, "--json", "pin", "--export-manifest", str(tmp_path / "x.json"), "--label", "nope"))
    assert e["exit"] == 2 and "no label 'nope'" in e["message"]
    e = error(lmctl(daemon, "--json", "pin", "--export-manifest", str(tmp_path / "x.json"), "--model", "nope"))
    assert e["exit"] == 2 and "no model 'nope'" in e["message"]
    r = lmctl(daemon, "pin", "--export-manifest", str(out), "--label", "contracts")
    assert r.exit_code == 0 and f"wrote {out}: 1 document(s), 1 of chunk keys" in r.stdout

    records = daemon.store / "pinned-documents"
    assert len(os.listdir(records)) == 2 and stat.S_IMODE(os.stat(records).st_mode) == 0o700
    # a document unpinned in part has no document any more: its pinned chunks export as keys
    ok(daemon, "unpin", "--label", "contracts", "--key", doc[0].hex())
    ok(daemon, "pin", "--export-manifest", str(out), "--label", "contracts")
    assert json.loads(out.read_text())["documents"] == [
        {"label": "contracts", "model": "m", "keys": sorted(k.hex() for k in doc[1:] + other[:1])}]
    assert len(os.listdir(records)) == 1  # tenant's
    ok(daemon, "unpin", "--label", "tenant")  # a label gone takes its records along
    assert os.listdir(records) == []


# -- warm ------------------------------------------------------------------------------------
def test_warm_reports_each_entry_and_runs_the_others_when_one_fails(tmp_path: Path) -> None:
    keys = fill(tmp_path / "store", dram=True)
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        manifest = write(tmp_path, {"version": 1, "documents": [
            {"label": "a", "model": "m", "tokens": TOKENS},                  # stored on nvme
            {"label": "a", "tokens": TOKENS[:32] + NEW[:32]},                 # half stored
            {"label": "a", "model": "nope", "tokens": TOKENS},                # an unknown model
            {"label": "a", "model": "m", "adapter": "civil", "tokens": TOKENS},  # an unknown adapter
            {"label": "b", "keys": [keys[4].hex(), "00" * 48]},              # one stored, one not
        ]})
        before = ok(d, "ls", "--limit", "0")
        dry = lmctl(d, "--json", "warm", "--manifest", manifest, "--dry-run")
        assert dry.exit_code == 1 and json.loads(dry.stdout)["moved"] == 7  # entry 1's two chunks are on nvme yet
        assert ok(d, "ls", "--limit", "0") == before  # a dry run changes nothing

        r = lmctl(d, "--json", "warm", "--manifest", manifest)
        assert r.exit_code == 1  # an entry failed; the others ran
        got = json.loads(r.stdout)
        rows = got["entries"]
        counts = [(x["chunks"], x["found"], x["moved"], x["already"], x["missing"]) for x in rows]
        assert counts == [(4, 4, 4, 0, 0), (4, 2, 0, 2, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0), (2, 1, 1, 0, 1)]
        assert [x["error"] and x["error"]["code"] for x in rows] == [None, None, "usage", "usage", None]
        assert "no model 'nope'" in rows[2]["error"]["message"]
        assert "no adapter named 'civil'" in rows[3]["error"]["message"]
        assert (got["to"], got["failed"], got["moved"], got["missing"], got["fetched"]) == ("dram", 2, 5, 3, 0)
        assert rows[0]["bytes"] > 0 and got["bytes"] == sum(x["bytes"] for x in rows)
        with library(d) as s:
            assert s.locate(keys) == ["dram"] * 5 + ["nvme"]
            assert s.labels() == {}  # warm pins nothing without --pin

        # the human output: a table, a summary, and each failure as one line on stderr
        r = lmctl(d, "warm", "--manifest", manifest, "--to", "nvme")
        assert r.exit_code == 1
        assert "warmed 5 entries into nvme: 5 chunk(s) moved (0 from remote" in r.stdout
        assert "; 2 entries failed" in r.stdout and "partial" in r.stdout
        assert r.stderr.count("\n") == 3 and r.stderr.startswith("lmctl: documents[2]: no model 'nope'")
        assert r.stderr.endswith("lmctl: 3 selected chunk(s) were not warmed (3 in no tier); exit 1 (--allow-missing "
                                 "accepts that)\n")  # entries 1 and 4 left chunks cold
        with library(d) as s:
            assert s.locate(keys) == ["nvme"] * 6

        # single warm takes --to too; remote is move's business
        assert ok(d, "warm", "--key", keys[0].hex(), "--to", "dram")["chunks"] == 1
        e = error(lmctl(d, "--json", "warm", "--key", keys[0].hex(), "--to", "remote"))
        assert e["exit"] == 2 and "--to must be dram or nvme" in e["message"]
    finally:
        assert d.stop() == 0


def test_warm_prefills_what_no_tier_has_and_pins(tmp_path: Path) -> None:
    fill(tmp_path / "store", dram=True)
    d = Daemon(tmp_path / "store")
    d.start()

    def engine_stores(path: str, body: Any) -> None:  # what the connector does on a prefill
        with Store(d.store) as s:
            for k in NS.chunk_keys(body["prompt"]):
                s.put(k, bytes(FMT.chunk_bytes), LAYOUT, tokens=16)

    try:
        manifest = write(tmp_path, [{"label": "a", "model": "m", "tokens": TOKENS},
                                    {"label": "a", "model": "m", "tokens": NEW}])
        with fake_engine(engine_stores) as (url, requests):
            got = ok(d, "warm", "--manifest", manifest, "--endpoint", url, "--pin")
        assert [p for p, _ in requests] == ["/v1/completions"]  # only the document no tier had
        assert requests[0][1]["prompt"] == NEW and requests[0][1]["model"] == "m"
        rows = got["entries"]
        assert [(x["found"], x["prefilled"], x["moved"], x["missing"], x["pinned"]) for x in rows] == [
            (4, 0, 4, 0, 4), (0, 3, 3, 0, 3)]
        assert (got["prefilled"], got["failed"]) == (3, 0)
        with library(d) as s:
            assert s.locate(NS.chunk_keys(TOKENS) + NS.chunk_keys(NEW)) == ["dram"] * 7
            assert sorted(s.labels()) == ["a"] and len(s.labels()["a"]) == 7
    finally:
        assert d.stop() == 0


@pytest.fixture
def shared(tmp_path: Path, servers: Callable[..., Server]) -> Callable[..., Path]:
    """Store folders of two hosts on one Redis server: ``host(name, dram=False)``."""
    redis = servers()
    secret = str(secret_file(tmp_path))

    def host(name: str, dram: bool = False) -> Path:
        tiers = {"nvme": TierConfig(capacity=256 * MiB)}
        if dram:
            tiers["dram"] = TierConfig(capacity=64 * MiB, path=str(tmp_path / name / "dram-tier"))
        with Store(tmp_path / name, StoreConfig(tiers=tiers, segment_bytes=4 * MiB,
                                                remote=RemoteConfig(redis.url, key_prefix="test",
                                                                    secret_file=secret))) as s:
            s.register_namespace(NS, {"model_id": "m", "tokenizer": None})  # an engine started here
        return tmp_path / name

    host.redis = redis  # type: ignore[attr-defined]
    return host


def test_export_on_one_host_warm_on_another_from_the_remote_tier(tmp_path: Path,
                                                                 shared: Callable[..., Path]) -> None:
    a_dir, b_dir = shared("a"), shared("b", dram=True)
    doc, other = NS.chunk_keys(TOKENS), NS.chunk_keys(OTHER)
    with Store(a_dir) as s:  # host a's engine served the document and another prompt (written through)
        assert all(s.put_many([PutItem(k, content(k, FMT.chunk_bytes), LAYOUT, 16) for k in doc + other]))
    a, b = Daemon(a_dir), Daemon(b_dir)
    a.start()
    b.start()
    try:
        ok(a, "pin", "--label", "contracts", "--tokens", tokens_file(tmp_path, TOKENS))
        ok(a, "pin", "--label", "contracts", "--key", other[1].hex())
        ok(a, "pin", "--label", "tenant", "--tokens", tokens_file(tmp_path, NEW, "new.json"), "--cache-salt", "s3")
        manifest = str(tmp_path / "from-a.json")
        assert ok(a, "pin", "--export-manifest", manifest)["entries"] == 3

        got = ok(b, "warm", "--manifest", manifest, "--cache-salt", "s3", "--pin", "--allow-missing")
        rows = got["entries"]
        assert [(x["label"], x["document"], x["chunks"], x["found"], x["moved"], x["fetched"], x["missing"])
                for x in rows] == [("contracts", "tokens", 4, 4, 4, 4, 0), ("contracts", "keys", 1, 1, 1, 1, 0),
                                   ("tenant", "tokens", 3, 0, 0, 0, 3)]  # never served anywhere
        assert got["failed"] == 0 and [x["pinned"] for x in rows] == [4, 1, 3]
        salted = Namespace("m", FMT, cache_salt="s3").chunk_keys(NEW)
        with library(b) as s:
            assert s.locate(doc + other[1:], remote=False) == ["dram"] * 5
            assert s.locate(other[:1], remote=False) == [None]  # not in the manifest
            for k in doc + other[1:]:
                c = s.get(k, touch=False)
                assert c is not None and bytes(c.data) == content(k, FMT.chunk_bytes)  # byte-identical
            assert sorted(s.labels()["contracts"]) == sorted(doc + other[1:])
            assert sorted(s.labels()["tenant"]) == sorted(salted)  # the salt gave the same keys

        # b now describes its pins as a did: the manifest round-trips
        again = str(tmp_path / "from-b.json")
        ok(b, "pin", "--export-manifest", again)
        assert json.loads(Path(again).read_text()) == json.loads(Path(manifest).read_text())
        # warming again moves nothing
        assert ok(b, "warm", "--manifest", manifest, "--cache-salt", "s3", "--allow-missing")["already"] == 5
        # status names the remote tier and what this daemon's calls to it did
        st = ok(b, "status")["store"]["remote"]
        assert (st["key_prefix"], st["hits"], st["errors"], st["breaker"]) == ("test", 5, 0, "closed")
        text = lmctl(b, "status").stdout
        line = next(x for x in text.splitlines() if x.startswith(f"remote {st['url']} (prefix test, write always"))
        assert "breaker closed  puts 0  hits 5  misses 0  errors 0  forged 0" in line
    finally:
        assert a.stop() == 0
        assert b.stop() == 0


# -- the remote tier as a selector ---------------------------------------------------------------
def test_tier_remote_as_a_selector_is_refused_saying_how_remote_chunks_are_found(
        tmp_path: Path, shared: Callable[..., Path]) -> None:
    a_dir = shared("a")
    doc = NS.chunk_keys(TOKENS)
    with Store(a_dir) as s:
        assert all(s.put_many([PutItem(k, content(k, FMT.chunk_bytes), LAYOUT, 16) for k in doc]))
    a = Daemon(a_dir)
    a.start()
    try:
        assert ok(a, "move", "--to", "remote", "--model", "m")["chunks"] == 4
        for argv in (["ls", "--tier", "remote"], ["inspect", "--tier", "remote"],
                     ["warm", "--tier", "remote", "--to", "nvme", "--dry-run"], ["evict", "--tier", "remote"]):
            r = lmctl(a, *argv)
            assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, argv
            assert r.stderr.startswith("lmctl: --tier remote selects nothing: this store's index lists only the "
                                       "chunks of its local tiers"), argv
            assert "by document" in r.stderr and "whole key" in r.stderr
        # what the message offers finds them
        got = ok(a, "warm", "--tokens", tokens_file(tmp_path, TOKENS), "--to", "nvme", "--dry-run")
        assert (got["chunks"], got["fetched"]) == (4, 4)
        assert ok(a, "lookup", "--key", doc[0].hex())["tiers"] == {"remote": 1}
    finally:
        assert a.stop() == 0


# -- warm that warmed nothing ----------------------------------------------------------------------
def test_warm_that_leaves_chunks_cold_exits_1_and_an_unanswering_remote_is_not_in_no_tier(
        tmp_path: Path, shared: Callable[..., Path]) -> None:
    a_dir, b_dir = shared("a"), shared("b", dram=True)
    redis: Server = shared.redis  # type: ignore[attr-defined]
    doc = NS.chunk_keys(TOKENS)
    with Store(a_dir) as s:  # host a's engine served the document (written through to the server)
        assert all(s.put_many([PutItem(k, content(k, FMT.chunk_bytes), LAYOUT, 16) for k in doc]))
    b = Daemon(b_dir)
    b.start()
    paused = False
    try:
        # a manifest warmed with the wrong cache salt: every chunk missing, and that is a failure
        manifest = write(tmp_path, [{"label": "t", "model": "m", "tokens": TOKENS, "needs_cache_salt": True}])
        r = lmctl(b, "warm", "--manifest", manifest, "--to", "nvme", "--cache-salt", "wrong")
        assert r.exit_code == 1 and "4 missing" in r.stdout and "partial" in r.stdout
        assert r.stderr == ("lmctl: 4 selected chunk(s) were not warmed (4 in no tier); exit 1 (--allow-missing "
                            "accepts that)\n")
        got = ok(b, "warm", "--manifest", manifest, "--to", "nvme", "--cache-salt", "wrong", "--allow-missing")
        assert (got["missing"], got["unchecked"], got["failed"]) == (4, 0, 0)

        # the server stops answering (paused, as a hung server is): its chunks are not "in no tier"
        redis.signal(signal.SIGSTOP)
        paused = True
        doc_file = tokens_file(tmp_path, TOKENS)
        r = lmctl(b, "warm", "--tokens", doc_file, "--to", "nvme")
        assert r.exit_code == 1
        assert r.stdout == ("brought 0 chunk(s) into nvme: 0 B; remote tier did not answer (4 chunk(s) not "
                            "checked); 0 chunk(s) of the selection are in nvme now\n")
        assert r.stderr == ("lmctl: 4 selected chunk(s) were not warmed (4 not checked (the remote tier did not "
                            "answer)); exit 1 (--allow-missing accepts that)\n")
        j = lmctl(b, "--json", "warm", "--tokens", doc_file, "--to", "nvme", "--dry-run")
        got = json.loads(j.stdout)
        assert j.exit_code == 1 and j.stderr == "" and (got["missing"], got["unchecked"]) == (0, 4)
        got = ok(b, "warm", "--tokens", doc_file, "--to", "nvme", "--allow-missing")
        assert (got["chunks"], got["missing"], got["unchecked"]) == (0, 0, 4)
        r = lmctl(b, "warm", "--manifest", manifest, "--to", "nvme", "--cache-salt", "wrong")
        assert r.exit_code == 1 and "remote tier did not answer (4 chunk(s) not checked)" in r.stdout
        redis.signal(signal.SIGCONT)
        paused = False

        # when the server answers again, the same warm brings every chunk and exits 0
        deadline = time.monotonic() + 15  # the breaker lets a probe through after its backoff
        while True:
            r = lmctl(b, "--json", "warm", "--tokens", doc_file, "--to", "nvme")
            if r.exit_code == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        got = json.loads(r.stdout)
        assert r.exit_code == 0 and (got["chunks"], got["fetched"], got["missing"], got["unchecked"]) == (4, 4, 0, 0)
    finally:
        if paused:
            redis.signal(signal.SIGCONT)
        assert b.stop() == 0


def test_a_server_that_stops_answering_during_warm_leaves_chunks_unchecked_not_missing(
        tmp_path: Path, shared: Callable[..., Path]) -> None:
    from lmctl.ops import Job, op_warm

    a_dir, b_dir = shared("a"), shared("b")
    redis: Server = shared.redis  # type: ignore[attr-defined]
    doc = NS.chunk_keys(TOKENS)
    with Store(a_dir) as s:
        assert all(s.put_many([PutItem(k, content(k, FMT.chunk_bytes), LAYOUT, 16) for k in doc]))
    with Store(b_dir) as b:
        real_get = b.get
        reads = []

        def get(key: bytes, *a: Any, **kw: Any) -> Any:  # the server hangs after the first chunk
            reads.append(key)
            if len(reads) == 2:
                redis.signal(signal.SIGSTOP)
            return real_get(key, *a, **kw)

        b.get = get  # type: ignore[method-assign]
        try:
            got = op_warm(b, {"keys": [k.hex() for k in doc], "to": "nvme"}, Job())
        finally:
            redis.signal(signal.SIGCONT)
        assert (got["chunks"], got["fetched"], got["missing"], got["unchecked"]) == (1, 1, 0, 3)
