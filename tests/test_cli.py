"""The CLI run in-process: typer's CliRunner over the app, each command line in a Terminal
(its own streams, no tty, no colour), against a real daemon (``test_daemon.Daemon``). What a
command changed is checked through the store library."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from conftest import content, env_with_path, flip_byte
from test_daemon import FMT, LAYOUT, NS, OTHER, TOKENS, Daemon, fill, library, tokens_file
from typer.testing import CliRunner, Result

from lmctl.cli import app
from lmctl.client import Client, RemoteError, Unreachable
from lmctl.terminal import CommandError, ExitStatus, Terminal, classify
from store import AdapterIdentity, KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig, adapter_digest


def lmctl(d: Daemon | None, *args: str, term: Terminal | None = None) -> Result:
    """``lmctl [--socket SOCK] ARGS`` run in this process."""
    pre = ["--socket", str(d.sock)] if d is not None else []
    return CliRunner().invoke(app, [*pre, *args], obj=term or Terminal(is_tty=False, color=False))


def ok(d: Daemon, *args: str) -> Any:
    """The JSON result of a command that must succeed."""
    r = lmctl(d, "--json", *args)
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    return json.loads(r.stdout)


def error(r: Result) -> dict[str, Any]:
    """The JSON error object of a command that failed under --json (nothing on stderr)."""
    assert r.stderr == ""
    body = json.loads(r.stdout)
    assert set(body) == {"error"} and body["error"]["exit"] == r.exit_code
    return dict(body["error"])


# -- exit codes: one rule ----------------------------------------------------------------------
def test_exit_statuses_are_the_specs() -> None:
    assert [(s.name, int(s)) for s in ExitStatus] == [
        ("OK", 0), ("ERROR", 1), ("USAGE", 2), ("UNREACHABLE", 3), ("INTERRUPTED", 130)]


@pytest.mark.parametrize(("exc", "status", "code", "message"), [
    (Unreachable("/run/x.sock", "no such socket"), ExitStatus.UNREACHABLE, "unreachable",
     "no lmctl daemon on /run/x.sock (no such socket); start one with: lmctl serve --store DIR"),
    (RemoteError("usage", "no label 'x'"), ExitStatus.USAGE, "usage", "no label 'x'"),
    (RemoteError("cancelled", "compress was cancelled"), ExitStatus.ERROR, "cancelled", "compress was cancelled"),
    (RemoteError("denied", "uid 7 may not"), ExitStatus.ERROR, "denied", "uid 7 may not"),
    (CommandError("usage", "two\nlines"), ExitStatus.USAGE, "usage", "two lines"),
    (CommandError("failed", "prefill failed"), ExitStatus.ERROR, "failed", "prefill failed"),
    (KeyboardInterrupt(), ExitStatus.INTERRUPTED, "interrupted",
     "interrupted; the daemon cancels the job (changes made so far stay)"),
    (typer.Abort(), ExitStatus.INTERRUPTED, "interrupted", "interrupted"),
    (ValueError("boom"), ExitStatus.ERROR, "failed", "internal error: ValueError: boom"),
])
def test_one_rule_maps_every_ending_to_its_exit_status(exc: BaseException, status: ExitStatus, code: str,
                                                       message: str) -> None:
    f = classify(exc)
    assert (f.status, f.code, f.message) == (status, code, message)


def test_usage_errors_exit_2_as_one_line_or_a_json_object(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    r = CliRunner().invoke(app, ["frobnicate"], obj=Terminal(stdout=out, stderr=err))
    assert r.exit_code == ExitStatus.USAGE
    assert err.getvalue() == "lmctl: No such command 'frobnicate'. (see lmctl --help)\n" and out.getvalue() == ""
    assert r.stdout == r.stderr == ""  # the terminal's streams got it all
    e = error(lmctl(None, "--json", "ls", "--limit", "-1"))
    assert e["code"] == "usage" and e["exit"] == 2 and e["message"].startswith("Invalid value for '--limit'")
    # the parser would keep the last of --pinned/--unpinned; --json after the command counts too
    e = error(lmctl(None, "ls", "--pinned", "--unpinned", "--json"))
    assert e == {"code": "usage", "message": "--pinned and --unpinned contradict each other: give one", "exit": 2}
    e = error(lmctl(None, "--json", "lookup", "--tokens", "a.json", "--tokens=b.json"))  # not just the last one
    assert e == {"code": "usage", "message": "--tokens was given 2 times: give one document", "exit": 2}
    r = lmctl(None, "ls", "--older-than", "soon")
    assert r.exit_code == 2
    assert r.stderr == "lmctl: --older-than: 'soon' is not a duration like 90s, 30m, 12h, 7d or 1h30m\n"
    sock = tmp_path / "nobody.sock"
    e = error(lmctl(None, "--socket", str(sock), "--json", "status"))
    assert e["code"] == "unreachable" and e["exit"] == 3 and str(sock) in e["message"]


def test_the_daemons_errors_keep_their_exit_codes(daemon: Daemon) -> None:
    e = error(lmctl(daemon, "--json", "lookup"))
    assert e["code"] == "usage" and e["exit"] == 2 and e["message"].startswith("select chunks with")
    e = error(lmctl(daemon, "--json", "inspect", "--key", "00" * 48))
    assert e["code"] == "failed" and e["exit"] == 1 and "no chunk" in e["message"]
    r = lmctl(daemon, "unpin", "--label", "never-made")
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.startswith("lmctl: no label 'never-made'")


def test_ctrl_c_exits_130_and_the_daemon_cancels_the_job(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    env = env_with_path()
    env["LMCTL_FAULT_JOB_STEP_DELAY"] = "0.5"  # each progress step of a job takes half a second
    d = Daemon(tmp_path / "store", env=env)
    d.start()
    main = threading.main_thread().ident
    assert main is not None
    sent = threading.Event()

    def ctrl_c_once_the_job_runs() -> None:
        c = Client(str(d.sock), timeout=10)
        end = time.time() + 20
        while time.time() < end and not [j for j in c.call("status")["jobs"] if j["done"] >= 1]:
            time.sleep(0.05)
        c.close()
        signal.pthread_kill(main, signal.SIGINT)  # what Ctrl-C on the terminal does
        sent.set()

    term = Terminal(is_tty=False)
    try:
        threading.Thread(target=ctrl_c_once_the_job_runs, daemon=True).start()
        try:
            r = lmctl(d, "--json", "compress", "--model", "m", term=term)
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped the command instead of ending it with exit status 130")
        assert sent.is_set()
        assert r.exit_code == ExitStatus.INTERRUPTED == 130
        e = error(r)  # how far the job got, as the daemon reported it
        assert (e["code"], e["exit"]) == ("interrupted", 130)
        assert re.fullmatch(r"interrupted after [1-5] of 6 \(compressing\); the daemon cancels the job "
                            r"\(changes made so far stay\)", e["message"]), e["message"]
        assert term.client is None  # it hung up: that is how the daemon learns of it
        end = time.time() + 10
        while ok(d, "status")["jobs"] and time.time() < end:
            time.sleep(0.1)
        assert ok(d, "status")["jobs"] == []
        with library(d) as s:
            codecs = [s.info(k).codec for k in NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)]  # type: ignore[union-attr]
        assert codecs.count("zstd-shuffle") < 6  # the job stopped part way, every chunk whole
    finally:
        assert d.stop() == 0


# -- selectors -------------------------------------------------------------------------------
def test_older_than_selects_chunks_not_used_for_that_long(daemon: Daemon) -> None:
    old = NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)
    time.sleep(1.5)
    new = NS.chunk_keys(list(range(700, 732)))
    with Store(daemon.store) as s:  # an engine stores a new document
        for k in new:
            assert s.put(k, bytes(FMT.chunk_bytes), LAYOUT, tokens=16)
    listed = ok(daemon, "ls", "--older-than", "1s", "--limit", "0")
    assert {c["key"] for c in listed["chunks"]} == {k.hex() for k in old}
    assert ok(daemon, "ls", "--older-than", "1h")["total"] == 0
    assert ok(daemon, "evict", "--older-than", "1s", "--dry-run")["chunks"] == 6
    with library(daemon) as s:
        assert None not in s.locate(old)
    r = ok(daemon, "evict", "--older-than", "1s")
    assert r["chunks"] == 6 and r["dry_run"] is False
    with library(daemon) as s:
        assert s.locate(old) == [None] * 6 and s.locate(new) == ["nvme"] * 2


def test_unpinned_and_evict_force(daemon: Daemon) -> None:
    doc, other = NS.chunk_keys(TOKENS), NS.chunk_keys(OTHER)
    assert ok(daemon, "pin", "--label", "doc", *[a for k in doc for a in ("--key", k.hex())])["added"] == 4
    assert {c["key"] for c in ok(daemon, "ls", "--unpinned")["chunks"]} == {k.hex() for k in other}
    assert ok(daemon, "evict", "--unpinned")["chunks"] == 2
    with library(daemon) as s:
        assert s.locate(other) == [None, None] and s.locate(doc) == ["nvme"] * 4
    kept = ok(daemon, "evict", "--label", "doc")
    assert kept["chunks"] == 0 and kept["skipped_pinned"] == 4
    with library(daemon) as s:
        assert s.locate(doc) == ["nvme"] * 4
    r = lmctl(daemon, "evict", "--label", "doc", "--force")
    assert r.exit_code == 0 and "evicted 4 chunk(s)" in r.stdout
    assert "4 of them pinned (were removed by --force" in r.stdout
    with library(daemon) as s:
        assert s.locate(doc) == [None] * 4
        assert [s.pin_refs(k) for k in doc] == [1] * 4  # the pins stay: a document stored again is protected


def _adapter(folder: Path, weights: bytes) -> AdapterIdentity:
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return AdapterIdentity("civil", adapter_digest(folder))


def test_adapter_name_at_digest_and_folder_select_one_identity(tmp_path: Path) -> None:
    base = fill(tmp_path / "store")
    v1 = _adapter(tmp_path / "civil-v1", b"weights one")
    v2 = _adapter(tmp_path / "civil-v2", b"weights two")
    keys = {}
    with Store(tmp_path / "store") as s:  # two identities of one adapter name, served one after the other
        for ident in (v1, v2):
            ns = Namespace("m", FMT, ident)
            s.register_namespace(ns, {"model_id": "m"})
            keys[ident] = ns.chunk_keys(TOKENS)
            for k in keys[ident]:
                assert s.put(k, bytes(FMT.chunk_bytes), LAYOUT, tokens=16)
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        def listed(spec: str) -> set[str]:
            return {c["key"] for c in ok(d, "ls", "--adapter", spec, "--limit", "0")["chunks"]}

        hexed = {ident: {k.hex() for k in ks} for ident, ks in keys.items()}
        assert listed(f"civil@{v1.digest}") == hexed[v1]
        assert listed(str(tmp_path / "civil-v2")) == hexed[v2]  # a folder: its digest is computed
        changed = _adapter(tmp_path / "civil-v1-retrained", b"weights one, retrained")
        assert changed.digest != v1.digest and listed(str(tmp_path / "civil-v1-retrained")) == set()
        e = error(lmctl(d, "--json", "ls", "--adapter", f"civil@{changed.digest}"))
        assert e["code"] == "usage" and "has been served" in e["message"]
        assert ok(d, "evict", "--adapter", f"civil@{v1.digest}")["chunks"] == 4
        with library(d) as s:
            assert s.locate(keys[v1]) == [None] * 4 and s.locate(keys[v2]) == ["nvme"] * 4
            assert None not in s.locate(base)
        assert ok(d, "evict", "--adapter", str(tmp_path / "civil-v2"))["chunks"] == 4
        with library(d) as s:
            assert s.locate(keys[v2]) == [None] * 4 and None not in s.locate(base)
    finally:
        assert d.stop() == 0


# -- verify --fix ------------------------------------------------------------------------------
def test_verify_reports_damage_fix_repairs_it_and_the_next_verify_is_clean(daemon: Daemon) -> None:
    keys = NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)
    with library(daemon) as s:
        flip_byte(s, keys[1])  # a bit flip in one payload: only a deep verify reads it
        orphan = Path(s.path) / "nvme" / "seg-000000999999.lseg"
    orphan.write_bytes(b"")  # a segment file the index does not know (a writer killed at birth)

    r = lmctl(daemon, "verify")
    assert r.exit_code == ExitStatus.ERROR
    assert r.stdout.startswith("found: orphan-file: seg-000000999999.lseg") and r.stdout.endswith(
        "1 problem(s) left; run lmctl verify --fix (checked 6 chunk(s) in 1 segment(s), shallow)\n")
    r = lmctl(daemon, "--json", "verify", "--deep")
    assert r.exit_code == ExitStatus.ERROR
    found = json.loads(r.stdout)
    assert found["ok"] is False and sorted(p["kind"] for p in found["problems"]) == ["corrupt-chunk", "orphan-file"]
    assert not any(p["fixed"] for p in found["problems"])
    with library(daemon) as s:
        assert s.info(keys[1]) is not None and orphan.exists()  # reporting changed nothing

    r = lmctl(daemon, "verify", "--deep", "--fix")
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    assert "fixed: corrupt-chunk" in r.stdout and "fixed: orphan-file" in r.stdout
    assert r.stdout.endswith("ok: checked 6 chunk(s) in 1 segment(s) (deep: every payload read and checksummed)\n")
    assert ok(daemon, "verify", "--deep") == {"ok": True, "deep": True, "fixed": False,
                                              "checked": {"chunks": 5, "segments": 1}, "problems": []}
    with library(daemon) as s:
        assert s.info(keys[1]) is None and not orphan.exists()
        assert s.stats().counters["corrupt"] >= 1
        for k in keys[:1] + keys[2:]:
            got = s.get(k)
            assert got is not None and len(bytes(got.data)) == FMT.chunk_bytes


def test_the_terminal_decides_colour_not_the_process(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS[:40] + [9] * 30)  # two chunks cached, two missing
    plain = lmctl(daemon, "lookup", "--tokens", doc, term=Terminal(is_tty=False, color=False))
    coloured = lmctl(daemon, "lookup", "--tokens", doc, term=Terminal(is_tty=False, color=True))
    assert plain.exit_code == coloured.exit_code == 0
    assert "32 of 70 tokens cached" in plain.stdout and plain.stdout.count("│ miss │") == 2
    assert "\x1b[" not in plain.stdout and "\x1b[31mmiss" in coloured.stdout


# -- pins that would protect nothing ----------------------------------------------------------
def test_pinning_a_document_shorter_than_a_chunk_is_refused_and_leaves_no_record(daemon: Daemon,
                                                                                 tmp_path: Path) -> None:
    short = tokens_file(tmp_path, TOKENS[:10])  # 10 tokens: no full chunk of 16, no chunk key
    r = lmctl(daemon, "pin", "--label", "x", "--tokens", short)
    assert r.exit_code == ExitStatus.USAGE and r.stdout == ""
    assert r.stderr == ("lmctl: the document is 10 token(s), less than one chunk of 16: nothing of it can be "
                        "pinned (partial chunks are never stored)\n")
    e = error(lmctl(daemon, "--json", "pin", "--label", "x", "--tokens", short, "--dry-run"))
    assert e["code"] == "usage" and "less than one chunk" in e["message"]
    assert not (daemon.store / "pinned-documents").exists() or os.listdir(daemon.store / "pinned-documents") == []
    with library(daemon) as s:
        assert s.labels() == {}
    # a filter that matches no chunk pins nothing either, and says so
    key = NS.chunk_keys(TOKENS)[0].hex()
    r = lmctl(daemon, "pin", "--label", "x", "--key", key, "--older-than", "30d")
    assert r.exit_code == ExitStatus.USAGE and "nothing to pin" in r.stderr
    with library(daemon) as s:
        assert s.labels() == {}


def test_pinning_a_key_that_is_not_stored_is_refused_but_a_document_may_be_pinned_ahead(
        daemon: Daemon, tmp_path: Path) -> None:
    stored = NS.chunk_keys(TOKENS)[0].hex()
    typo = stored[:-2] + ("00" if stored[-2:] != "00" else "11")  # a whole key, one byte off
    r = lmctl(daemon, "pin", "--label", "ops", "--key", stored, "--key", typo)
    assert r.exit_code == ExitStatus.USAGE and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"lmctl: chunk key {typo[32:48]}… (namespace {typo[:8]}…) is not stored")
    assert "pin their document" in r.stderr
    assert error(lmctl(daemon, "--json", "pin", "--label", "ops", "--key", "ab" * 48, "--dry-run"))["exit"] == 2
    with library(daemon) as s:
        assert s.labels() == {}  # nothing pinned, not even the stored key given with the typo
    # a stored key pins; a document never served pins ahead of time, as documented
    assert ok(daemon, "pin", "--label", "ops", "--key", stored)["added"] == 1
    ahead = ok(daemon, "pin", "--label", "ahead", "--tokens", tokens_file(tmp_path, list(range(900, 932))))
    assert (ahead["chunks"], ahead["stored"], ahead["added"]) == (2, 0, 2)


def test_lookup_with_filters_and_no_document_is_refused_not_chained(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    other = Namespace("m", FMT, cache_salt="tenant")  # a second namespace of model m
    with Store(tmp_path / "store") as s:
        s.register_namespace(other, {"model_id": "m", "tokenizer": None})
        for k in other.chunk_keys(OTHER):
            assert s.put(k, bytes(FMT.chunk_bytes), LAYOUT, tokens=16)
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        r = lmctl(d, "lookup", "--model", "m")  # six chunks of two prompts and two chunks of another namespace
        assert r.exit_code == ExitStatus.USAGE and r.stdout == "" and r.stderr.count("\n") == 1
        assert r.stderr.startswith("lmctl: lookup answers for one prompt: give its document (--text, --file, "
                                   "--tokens or --messages) with --model")
        assert "run lmctl inspect with the same selectors" in r.stderr
        assert error(lmctl(d, "--json", "lookup", "--unpinned", "--tier", "nvme"))["exit"] == 2
        # the counts per namespace are inspect's answer
        assert ok(d, "inspect", "--model", "m")["chunks"] == 8
        # a document with the filter, and keys alone, still answer
        assert ok(d, "lookup", "--model", "m", "--tokens", tokens_file(tmp_path, TOKENS))["hit_chunks"] == 4
        keys = NS.chunk_keys(TOKENS)
        assert ok(d, "lookup", "--key", keys[0].hex(), "--key", keys[1].hex())["hit_chunks"] == 2
    finally:
        assert d.stop() == 0


# -- tokenizers: the caller's folders, local files only -----------------------------------------
def _tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer saved as a model's folder holds one (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", *(f"w{i}" for i in range(40))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(folder))


def test_tokenizer_folder_is_the_callers_and_ids_are_looked_up_locally_only(
        daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    _tiny_tokenizer(work / "tok")
    (work / "sub").mkdir()
    monkeypatch.chdir(work / "sub")  # the daemon runs elsewhere: ../tok means the caller's folder
    text = " ".join(f"w{i}" for i in range(36))  # 36 tokens: two full chunks of 16
    got = ok(daemon, "lookup", "--text", text, "--tokenizer", "../tok")
    assert (got["total_tokens"], len(got["chunks"])) == (36, 2)
    # a folder that is not there: the CLI says so, the daemon is never asked
    r = lmctl(daemon, "lookup", "--text", text, "--tokenizer", "./nope")
    assert r.exit_code == ExitStatus.USAGE and r.stderr.count("\n") == 1
    assert r.stderr.startswith("lmctl: --tokenizer ./nope: no such tokenizer folder")
    # an id no local cache holds: one line at once, no wait on a hub that cannot answer
    t0 = time.monotonic()
    r = lmctl(daemon, "lookup", "--text", text, "--tokenizer", "no-such-org/no-such-tokenizer")
    assert r.exit_code == ExitStatus.USAGE and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("lmctl: no tokenizer 'no-such-org/no-such-tokenizer' on this machine")
    assert "downloads nothing" in r.stderr and time.monotonic() - t0 < 10


# -- warm and move into a tier smaller than the selection ------------------------------------------
BIG = KVFormat("bfloat16", num_layers=2, num_kv_heads=2, head_dim=256, chunk_size=256)  # 1 MiB a chunk
BIG_NS = Namespace("big", BIG)


def _small_dram(path: Path, chunks: int) -> list[bytes]:
    """A store whose dram tier (16 MiB: 14.4 MiB of room) is smaller than ``chunks`` MiB of chunks on nvme."""
    tiers = {"nvme": TierConfig(capacity=256 * MiB), "dram": TierConfig(capacity=16 * MiB, path=str(path / "dram"))}
    layout = {"dtype": "bfloat16", "shape": list(BIG.chunk_shape)}
    with Store(path, StoreConfig(tiers=tiers, default_tier="nvme", segment_bytes=4 * MiB, codec="raw")) as s:
        s.register_namespace(BIG_NS, {"model_id": "big", "tokenizer": None})
        keys = BIG_NS.chunk_keys(list(range(256 * chunks)))
        for k in keys:
            assert s.put(k, content(k, BIG.chunk_bytes), layout, tokens=256)
    return keys


def test_warm_and_move_into_a_tier_too_small_are_refused_or_partial_and_say_what_stayed(tmp_path: Path) -> None:
    keys = _small_dram(tmp_path / "s", 20)
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        for argv in (["move", "--to", "dram", "--model", "big"], ["warm", "--model", "big"],
                     ["warm", "--model", "big", "--dry-run"]):
            r = lmctl(d, *argv)
            assert r.exit_code == ExitStatus.ERROR and r.stdout == "" and r.stderr.count("\n") == 1, argv
            assert re.match(r"lmctl: the selection \(20\.\d MiB in 20 chunk\(s\)\) exceeds dram's room \(14\.4 MiB: "
                            r"90% of its 16\.0 MiB capacity\); bringing it in would evict part of it again: .*"
                            r"add --partial to bring in what fits, in order\n", r.stderr), r.stderr
        with library(d) as s:
            assert s.locate(keys, remote=False) == ["nvme"] * 20  # nothing moved

        # --partial brings in a prefix that fits (a filter selects in key order), and every chunk it
        # reports is there at the end
        keys = sorted(keys)
        r = ok(d, "move", "--to", "dram", "--model", "big", "--partial")
        n = r["chunks"]
        assert 10 <= n < 15 and (r["left"], r["in_tier"], r["room"]) == (20 - n, n, int(16 * MiB * 0.9))
        with library(d) as s:
            assert s.locate(keys, remote=False) == ["dram"] * n + ["nvme"] * (20 - n)
        # pinned chunks in dram outside the selection take room: a warm of the rest is refused
        ok(d, "pin", "--label", "hot", *[a for k in keys[:4] for a in ("--key", k.hex())])
        e = error(lmctl(d, "--json", "warm", *[a for k in keys[4:] for a in ("--key", k.hex())]))
        assert e["exit"] == 1 and "exceeds dram's room (10.4 MiB" in e["message"]
        assert "less 4.0 MiB of pinned chunks outside the selection" in e["message"]
        text = lmctl(d, "warm", "--label", "hot")  # already there: fits, and says what is in dram
        assert text.exit_code == 0 and text.stdout.endswith("; 4 already there; 4 chunk(s) of the selection "
                                                            "are in dram now\n"), text.stdout
        with library(d) as s:
            assert s.locate(keys, remote=False) == ["dram"] * n + ["nvme"] * (20 - n)  # the pins stayed in dram
    finally:
        assert d.stop() == 0


def test_warm_manifest_reports_what_stayed_in_the_tier_when_entries_push_each_other_out(tmp_path: Path) -> None:
    keys = sorted(_small_dram(tmp_path / "s", 20))
    manifest = tmp_path / "m.json"  # two entries that fit dram's room one at a time, not together
    manifest.write_text(json.dumps([{"label": "a", "keys": [k.hex() for k in keys[:10]]},
                                    {"label": "b", "keys": [k.hex() for k in keys[10:]]}]))
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        dry = ok(d, "warm", "--manifest", str(manifest), "--dry-run")
        assert (dry["moved"], dry["in_tier"]) == (20, 20)  # each entry alone would fit
        r = lmctl(d, "--json", "warm", "--manifest", str(manifest))
        got = json.loads(r.stdout)
        assert r.exit_code == 0 and got["moved"] == 20 and got["failed"] == 0
        with library(d) as s:
            there = s.locate(keys, remote=False).count("dram")
        assert there < 20 and got["in_tier"] == there  # the second entry pushed part of the first out
        assert sum(x["in_tier"] for x in got["entries"]) == there
        text = lmctl(d, "warm", "--manifest", str(manifest), "--to", "nvme")
        assert text.exit_code == 0 and text.stdout.endswith("; 20 chunk(s) of the manifest are in nvme now\n")
    finally:
        assert d.stop() == 0
