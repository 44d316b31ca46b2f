"""The CLI's surface as a new operator meets it (docs/cli.md): durations, pipes, salts,
escaping, completion, help, keys, the shell. Commands run in-process (typer's CliRunner and
a ``Terminal``) against a real daemon, except where the process itself is the point (a
closed pipe, start-up imports, the shell on a terminal)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import env_with_path, flip_byte
from test_cli import error, lmctl, ok
from test_daemon import NS, OTHER, TOKENS, Daemon, fill, library, tokens_file
from typer.testing import CliRunner

from lmctl.cli import app
from lmctl.shell import Shell
from lmctl.terminal import Terminal
from lmctl.units import parse_duration
from store import AdapterIdentity, KVFormat, MiB, Namespace, PutItem, Store, StoreConfig, StoreError, TierConfig

KEYS = NS.chunk_keys(TOKENS) + NS.chunk_keys(OTHER)


# -- durations (3, 29) ---------------------------------------------------------------------------
def test_a_duration_without_a_unit_is_refused_and_nothing_is_evicted(daemon: Daemon) -> None:
    for args in (("evict", "--older-than", "7", "--unpinned"), ("ls", "--older-than", "7"),
                 ("events", "--since", "7"), ("evict", "--older-than", "0", "--unpinned")):
        r = lmctl(daemon, *args)
        assert r.exit_code == 2, args
        n = args[2]
        assert r.stderr == f"lmctl: {args[1]}: '{n}' has no unit: write {n}d, {n}h, {n}m or {n}s\n"
    with library(daemon) as s:
        assert None not in s.locate(KEYS)


def test_compound_durations_as_systemd_and_go_write_them(daemon: Daemon) -> None:
    assert parse_duration("1h30m", unit_required=True) == 5400
    assert parse_duration("1d12h", unit_required=True) == 129600
    assert parse_duration("1.5h") == parse_duration("90m") == 5400
    assert parse_duration("2w 3d") == 2 * 604800 + 3 * 86400
    for bad in ("30m1h", "1h1h", "1h30", "h", "1y"):
        with pytest.raises(ValueError):
            parse_duration(bad, unit_required=True)
    assert ok(daemon, "ls", "--older-than", "1h30m")["total"] == 0
    assert ok(daemon, "events", "--since", "1d12h")["events"] is not None


# -- lookup --explain: the closest holder (5) --------------------------------------------------------
def test_explain_names_another_version_of_the_adapter_before_another_adapter(tmp_path: Path) -> None:
    fmt = KVFormat("float32", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=16)
    toks = list(range(4000, 4032))
    v1, v2, legal = AdapterIdentity("civil", "1" * 32), AdapterIdentity("civil", "2" * 32), \
        AdapterIdentity("legal", "3" * 32)
    with Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
        # a shared document: the base model and a sibling adapter hold it too
        for adapter in (None, legal, v1):
            held = Namespace("m", fmt, adapter)
            s.register_namespace(held)
            items = [PutItem(k, os.urandom(fmt.chunk_bytes), {"dtype": "float32"}, 16, prefix=p)
                     for k, p in zip(held.chunk_keys(toks), s.prefix_ids(toks, 16), strict=True)]
            assert s.put_many(items) == [True, True]
        asked = Namespace("m", fmt, v2)
        s.register_namespace(asked)
        ex = s.explain(asked, toks)
        assert ex is not None
        assert ex.reason == "other-adapter-version", ex.message
        assert str(v1) in ex.message and "weights changed" in ex.message


# -- a reader that goes away (6) -----------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["--help"], ["status"], ["ls", "--limit", "0"], ["events"], ["inspect"],
    ["--json", "top", "--interval", "0.1", "--iterations", "0"],  # no limit: it must end by itself
])
def test_a_closed_pipe_ends_any_command_with_status_0(daemon: Daemon, args: list[str]) -> None:
    read, write = os.pipe()
    os.close(read)  # | head that has already gone
    try:
        p = subprocess.run([sys.executable, "-m", "lmctl.cli", "--socket", str(daemon.sock), *args], stdout=write,
                           stderr=subprocess.PIPE, text=True, env=env_with_path(), timeout=60)
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (0, "")


def test_a_broken_stdout_in_process_is_no_failure(daemon: Daemon) -> None:
    class Gone(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    for args in (["status"], ["ls"], ["--json", "status"]):
        r = lmctl(daemon, *args, term=Terminal(stdout=Gone(), stderr=io.StringIO(), is_tty=False, color=False))
        assert r.exit_code == 0, args


# -- cache salts (7) ------------------------------------------------------------------------------
def test_a_cache_salt_from_a_file_or_the_environment(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    given = ok(daemon, "lookup", "--tokens", doc, "--cache-salt", "SECRET-tenant")["namespace"]
    assert given["salted"] is True
    (tmp_path / "salt").write_text("SECRET-tenant\n")
    from_file = ok(daemon, "lookup", "--tokens", doc, "--cache-salt-file", str(tmp_path / "salt"))["namespace"]
    assert from_file == given
    r = CliRunner().invoke(app, ["--socket", str(daemon.sock), "--json", "lookup", "--tokens", doc],
                           obj=Terminal(is_tty=False, color=False), env={"LMCTL_CACHE_SALT": "SECRET-tenant"})
    assert r.exit_code == 0 and json.loads(r.stdout)["namespace"] == given
    unsalted = ok(daemon, "lookup", "--tokens", doc)["namespace"]
    assert unsalted["salted"] is False
    # the variable is for documents: a filter is not changed by it
    r = CliRunner().invoke(app, ["--socket", str(daemon.sock), "--json", "ls", "--model", "m"],
                           obj=Terminal(is_tty=False, color=False), env={"LMCTL_CACHE_SALT": "x"})
    assert r.exit_code == 0 and json.loads(r.stdout)["total"] == 6
    e = error(lmctl(daemon, "--json", "lookup", "--tokens", doc, "--cache-salt", "a", "--cache-salt-file",
                    str(tmp_path / "salt")))
    assert e["exit"] == 2 and "contradict" in e["message"]
    (tmp_path / "empty").write_text("")
    e = error(lmctl(daemon, "--json", "lookup", "--tokens", doc, "--cache-salt-file", str(tmp_path / "empty")))
    assert e["exit"] == 2 and "is empty" in e["message"]


def test_the_shell_history_keeps_no_cache_salt(daemon: Daemon, tmp_path: Path) -> None:
    import pexpect

    doc = tokens_file(tmp_path, TOKENS)
    env = env_with_path()
    env["HOME"] = str(tmp_path)
    sh = pexpect.spawn(sys.executable, ["-m", "lmctl.cli", "--socket", str(daemon.sock), "shell"], env=env,
                       encoding="utf-8", timeout=30)
    try:
        sh.expect("lmctl> ")
        sh.sendline(f"lookup --tokens {doc} --cache-salt SECRET-tenant --json")
        sh.expect('"salted": true')
        sh.expect("lmctl> ")
        sh.sendline(f"lookup --tokens {doc} --cache-salt=SECRET-two")
        sh.expect("lmctl> ")
        sh.sendline("exit")
        sh.expect(pexpect.EOF)
    finally:
        sh.close()
    history = (tmp_path / ".lmctl_history").read_text()
    assert "SECRET" not in history
    assert f"lookup --tokens {doc} --cache-salt '***' --json" in history and "--cache-salt=***" in history
    from lmctl.shell import redact

    assert redact("lookup --cache-salt 'a b' --text x") == "lookup --cache-salt '***' --text x"
    assert redact("lookup --cache-salt 'open") is None  # cannot be parsed: not kept at all


# -- control characters (15) ----------------------------------------------------------------------
EVIL = "evil\nlabel\x1b[31mRED\u202e"


def test_control_characters_in_labels_are_escaped_in_every_table(daemon: Daemon) -> None:
    with Store(daemon.store) as s:  # a label as an older lmctl, or the library, let through
        s.pin(EVIL, KEYS[:2])
    shown = "evil\\nlabel\\x1b[31mRED\\u202e"
    for args in (["inspect"], ["events"], ["inspect", "--key", KEYS[0].hex()], ["ls", "--label", EVIL]):
        r = lmctl(daemon, *args, term=Terminal(is_tty=False, color=True))  # colour on: no escape is ours
        assert r.exit_code == 0, (args, r.stdout + r.stderr)
        assert "\x1b[31mRED" not in r.stdout and "\u202e" not in r.stdout and "evil\nlabel" not in r.stdout
        if args[0] != "ls":
            assert shown in re.sub(r"\x1b\[[0-9;]*m", "", r.stdout), args
    r = lmctl(daemon, "unpin", "--label", EVIL)
    assert r.exit_code == 0 and "\x1b" not in r.stdout and "\n" not in r.stdout.rstrip("\n")


def test_top_escapes_the_names_it_shows() -> None:
    from rich.console import Console

    from lmctl.top import rates, render

    snap = {"time": 1e9, "gauges": [], "cells": [{"name": "lookups_total", "labels": {"model": EVIL, "adapter": ""},
                                                  "value": 1}],
            "status": {"store": {"tiers": {}, "counters": {}}, "jobs": []}}
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="standard", width=200).print(render(rates(None, snap)))
    assert "\x1b[31mRED" not in out.getvalue() and "evil\\nlabel\\x1b[31mRED" in out.getvalue()


def test_a_label_is_text_never_markup(daemon: Daemon) -> None:
    with Store(daemon.store) as s:
        s.pin("[bold]x[/bold]", KEYS[:1])
    r = lmctl(daemon, "inspect")
    assert "[bold]x[/bold]" in r.stdout


# -- completion (16) -------------------------------------------------------------------------------
def test_the_shell_completes_values_not_options(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "lease.json").write_text("[]")
    (tmp_path / "legal").mkdir()
    sh = Shell(app, Terminal(socket=str(daemon.sock), is_tty=False, color=False))

    def complete(line: str) -> list[str]:
        text = "" if line.endswith(" ") else shlex.split(line)[-1]
        return sh.candidates(line, text)

    assert complete("ls --sort ") == ["key", "age", "access", "size"]
    assert complete("ls --sort a") == ["age", "access"]
    assert complete("events --kind ") == ["evict", "corrupt", "save-dropped", "pin", "unpin", "remote-copy", "announce"]
    assert complete("move --to ") == ["dram", "nvme", "remote"] and complete("warm --to ") == ["dram", "nvme"]
    assert complete("compress --codec z") == ["zstd-shuffle", "zstd"]
    assert complete("config ") == ["set", "show"] and complete("config s") == ["set", "show"]
    assert "tiers.nvme.capacity=" in complete("config set ") and complete("config set codec") == [
        "codec=", "codec_level="]
    assert complete(f"lookup --messages {tmp_path}/le") == [f"{tmp_path}/lease.json", f"{tmp_path}/legal/"]
    assert complete(f"pin --export-manifest {tmp_path}/lea") == [f"{tmp_path}/lease.json"]
    assert complete("ls --limit ") == []  # a number goes here: no option
    assert complete("help con") == ["config"]
    assert "--sort" in complete("ls --s")


@pytest.mark.parametrize(("line", "want"), [
    ("lmctl ls --sort ", ["key", "age", "access", "size"]),
    ("lmctl events --kind ", ["evict", "corrupt", "save-dropped", "pin", "unpin", "remote-copy", "announce"]),
    ("lmctl move --to ", ["dram", "nvme", "remote"]),
    ("lmctl config set codec", ["codec=", "codec_level="]),
    ("lmctl completion show ", ["bash", "zsh", "fish"]),
    ("lmctl lookup --messages ", []),  # nothing: the script falls back to file names
])
def test_the_completion_scripts_complete_values(line: str, want: list[str]) -> None:
    words = line.split(" ")
    bash = CliRunner().invoke(app, [], env={"_LMCTL_COMPLETE": "complete_bash", "COMP_WORDS": line,
                                            "COMP_CWORD": str(len(words) - 1)})
    assert bash.stdout.split() == want
    zsh = CliRunner().invoke(app, [], env={"_LMCTL_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": line})
    assert zsh.stdout.strip() == ("_files" if not want else
                                  "_arguments '*: :((" + "\n".join(f'"{w}"' for w in want) + "))'")
    fish = CliRunner().invoke(app, [], env={"_LMCTL_COMPLETE": "complete_fish", "_TYPER_COMPLETE_ARGS": line,
                                            "_TYPER_COMPLETE_FISH_ACTION": "get-args"})
    assert fish.stdout.split() == want


# -- help (17, 18, 19, 20, 38) ----------------------------------------------------------------------
@pytest.mark.parametrize("args", [[], ["config"], ["completion"]])
def test_a_line_without_its_command_prints_the_help(args: list[str]) -> None:
    r = lmctl(None, *args)
    assert r.exit_code == 2 and r.stderr == ""
    assert r.stdout.startswith("Usage: lmctl") and "\nCommands:\n" in r.stdout and r.stdout.count("\n") > 5


def test_json_alone_is_a_usage_error_not_silence() -> None:
    e = error(lmctl(None, "--json"))
    assert e == {"code": "usage", "message": "give a command: lmctl --help lists them", "exit": 2}


def test_help_is_a_command() -> None:
    r = lmctl(None, "help")
    assert r.exit_code == 0 and r.stdout == lmctl(None, "--help").stdout
    r = lmctl(None, "help", "config", "set")
    assert r.exit_code == 0 and r.stdout == lmctl(None, "config", "set", "--help").stdout
    assert r.stdout.startswith("Usage: lmctl config set")
    r = lmctl(None, "help", "nosuch")
    assert r.exit_code == 2 and r.stderr == "lmctl: no command 'nosuch': lmctl --help lists the commands\n"


def test_json_after_serve_is_the_global_option(tmp_path: Path) -> None:
    e = error(lmctl(None, "serve", "--store", str(tmp_path / "none"), "--json"))
    assert "No such option" not in e["message"] and "no lmctl store" in e["message"]


def _commands(group: Any, path: list[str]) -> list[list[str]]:
    out = []
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            out += _commands(cmd, [*path, name])
        else:
            out.append([*path, name])
    return out


def test_every_commands_help_has_an_example_and_no_python_types() -> None:
    import typer

    paths = _commands(typer.main.get_command(app), [])
    assert len(paths) >= 19
    for path in paths:
        text = lmctl(None, *path, "--help").stdout
        assert re.search(r"\n  Examples:\n    lmctl ", text), path
        assert not re.search(r"<(str|int|float|bool|list|int range)", text), (path, text)
        if path[0] not in ("completion", "help"):
            assert "--json" in text and "--socket PATH" in text, path
    text = lmctl(None, "ls", "--help").stdout
    assert "--key HEX" in text and "--older-than DURATION" in text and "--limit N" in text
    assert "--allow-uid UID" in lmctl(None, "serve", "--help").stdout


def test_config_set_help_lists_the_keys_settings_read() -> None:
    from lmctl import completion, settings

    assert (completion.STORE_SETTINGS, completion.TIER_SETTINGS, completion.REMOTE_SETTINGS) == (
        settings.STORE_KEYS, settings.TIER_KEYS, settings.REMOTE_KEYS)
    text = " ".join(lmctl(None, "config", "set", "--help").stdout.split())
    for key in (*settings.STORE_KEYS, *(f"tiers.TIER.{k}" for k in settings.TIER_KEYS),
                *(f"remote.{k}" for k in settings.REMOTE_KEYS)):
        assert key in text, key


# -- keys (23, 24) -----------------------------------------------------------------------------------
def test_inspect_key_shows_labels_as_text(daemon: Daemon) -> None:
    with Store(daemon.store) as s:
        s.pin("合同🏠", KEYS[:1])
    r = lmctl(daemon, "inspect", "--key", KEYS[0].hex())
    assert r.exit_code == 0 and "合同🏠" in r.stdout and "\\u" not in r.stdout
    assert re.search(r"bytes +│ 8\.0 KiB \(8192 B\)", r.stdout)


def test_key_errors_say_what_a_key_is(daemon: Daemon) -> None:
    r = lmctl(daemon, "lookup", "--key", "abc")
    assert r.exit_code == 2 and "a chunk key is 96 hex digits, this has 3" in r.stderr and "not hex" not in r.stderr
    r = lmctl(daemon, "lookup", "--key", "zz" * 48)
    assert r.exit_code == 2 and "is not hex" in r.stderr
    r = lmctl(daemon, "inspect", "--key", "ab" * 49)
    assert r.exit_code == 2 and "this has 98" in r.stderr
    missing = "f" * 95  # hex, one digit short, and no chunk starts with it
    r = lmctl(daemon, "inspect", "--key", missing)
    assert r.exit_code == 2 and "this has 95" in r.stderr and "no stored chunk" in r.stderr


def test_a_short_key_as_the_tables_show_it_names_its_chunk(daemon: Daemon) -> None:
    listed = lmctl(daemon, "ls")
    shown = re.findall(r"│ ([0-9a-f]{16})… ", listed.stdout)
    assert sorted(shown) == sorted(k.hex()[32:48] for k in KEYS)
    target = next(k for k in KEYS if k.hex()[32:48] == shown[0])
    assert ok(daemon, "inspect", "--key", shown[0])["chunk"]["key"] == target.hex()
    assert ok(daemon, "inspect", "--key", shown[0][:6])["chunk"]["key"] == target.hex()
    assert ok(daemon, "inspect", "--key", shown[0] + "…")["chunk"]["key"] == target.hex()  # pasted from a table
    assert ok(daemon, "inspect", "--key", target.hex()[:95])["chunk"]["key"] == target.hex()  # a whole key's start
    assert ok(daemon, "evict", "--key", shown[0], "--dry-run")["chunks"] == 1
    e = error(lmctl(daemon, "--json", "inspect", "--key", target.hex()[:8]))  # the namespace: every chunk has it
    assert e["exit"] == 2 and "ambiguous" in e["message"]


# -- ls's next page (25) -------------------------------------------------------------------------------
def test_the_next_page_line_is_a_whole_command(daemon: Daemon) -> None:
    seen: list[str] = []
    args = ["--socket", str(daemon.sock), "ls", "--sort", "size", "--limit", "4", "--model", "m"]
    r = lmctl(None, *args)
    seen += re.findall(r"│ ([0-9a-f]{16})… ", r.stdout)
    line = next(x for x in r.stdout.splitlines() if x.startswith("next page: "))[len("next page: "):]
    words = shlex.split(line)
    assert words[0] == "lmctl" and words[1:len(args) + 1] == args and words[-2] == "--cursor"
    r = lmctl(None, *words[1:])
    assert r.exit_code == 0 and "next page" not in r.stdout
    seen += re.findall(r"│ ([0-9a-f]{16})… ", r.stdout)
    assert sorted(seen) == sorted(k.hex()[32:48] for k in KEYS)
    r = lmctl(daemon, "ls", "--limit", "1", "--model", "m", "--cache-salt", "SECRET")  # a salt is never shown
    assert "SECRET" not in r.stdout and "--cache-salt SALT --cursor" in r.stdout


# -- lookup of a short document (26) ----------------------------------------------------------------
def test_a_document_shorter_than_a_chunk_gets_one_coherent_answer(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS[:10])
    r = lmctl(daemon, "lookup", "--tokens", doc, "--explain")
    assert r.exit_code == 0
    assert r.stdout.startswith("the document's 10 token(s) are less than one chunk of 16: nothing of it is stored")
    assert "first miss" not in r.stdout and "nothing misses" not in r.stdout and "┏" not in r.stdout
    got = ok(daemon, "lookup", "--tokens", doc, "--explain")
    assert got["chunks"] == [] and got["first_miss"] is None and got["explain"] is None
    full = tokens_file(tmp_path, TOKENS + [1, 2, 3], "full.json")  # every full chunk hits, 3 tokens over
    r = lmctl(daemon, "lookup", "--tokens", full, "--explain")
    assert "first miss" not in r.stdout and "4 of 4 full chunks" in r.stdout
    assert "the last 3 token(s) are less than a chunk" in r.stdout and "nothing misses" in r.stdout
    assert ok(daemon, "lookup", "--tokens", full)["first_miss"] is None


# -- the shell as a script (32) -------------------------------------------------------------------
def test_the_shell_fed_a_script_prints_results_only_and_fails_as_its_lines(daemon: Daemon, tmp_path: Path) -> None:
    script = "status\nlookup --model nosuch --text hi\nhelp nosuch\nhelp config set\ninspect --json\n"
    r = CliRunner().invoke(app, ["--socket", str(daemon.sock), "shell"], input=script,
                           obj=Terminal(is_tty=False, color=False), env={"HOME": str(tmp_path)})
    assert r.exit_code == 2, r.stdout + r.stderr  # the first line that failed: a usage error
    assert "lmctl>" not in r.stdout and "type help" not in r.stdout and r.stdout.startswith("lmctl ")
    assert "Usage: lmctl config set" in r.stdout and '"labels"' in r.stdout
    assert "no command 'nosuch'" in r.stderr and "nosuch" in r.stderr.splitlines()[0]
    assert not (tmp_path / ".lmctl_history").exists()  # a script is no history
    r = CliRunner().invoke(app, ["--socket", str(daemon.sock), "shell"], input="status\nls\n",
                           obj=Terminal(is_tty=False, color=False), env={"HOME": str(tmp_path)})
    assert r.exit_code == 0


def test_the_shell_says_not_connected_while_no_daemon_answers(tmp_path: Path) -> None:
    import pexpect

    fill(tmp_path / "store")
    d = Daemon(tmp_path / "store")
    env = env_with_path()
    env["HOME"] = str(tmp_path)
    sh = pexpect.spawn(sys.executable, ["-m", "lmctl.cli", "--socket", str(d.sock), "shell"], env=env,
                       encoding="utf-8", timeout=30)
    try:
        sh.expect("no daemon answers")
        sh.expect("not connected> ")
        sh.sendline("status")
        sh.expect("no lmctl daemon on")
        sh.expect("not connected> ")
        d.start()
        sh.sendline("status")
        sh.expect("hits")
        sh.expect("\nlmctl> ")
        sh.sendline("exit")
        sh.expect(pexpect.EOF)
    finally:
        sh.close()
        if d.proc is not None:
            assert d.stop() == 0


# -- verify (35) --------------------------------------------------------------------------------------
def test_verify_says_what_it_checked_and_names_the_chunk(daemon: Daemon) -> None:
    r = lmctl(daemon, "verify")
    assert r.exit_code == 0
    assert r.stdout == ("ok: checked 6 chunk(s) in 1 segment(s) (shallow: the index against the segment files and "
                        "the counts; --deep also reads every payload)\n")
    with library(daemon) as s:
        flip_byte(s, KEYS[2])
    r = lmctl(daemon, "--json", "verify", "--deep")
    assert r.exit_code == 1
    found = json.loads(r.stdout)
    assert found["checked"] == {"chunks": 6, "segments": 1}
    assert [(p["kind"], p["key"]) for p in found["problems"]] == [("corrupt-chunk", KEYS[2].hex())]


# -- Ctrl-C (36) is in test_cli.py; compress (37) ------------------------------------------------------
def test_compress_refuses_a_level_for_raw_and_says_would_grow(daemon: Daemon) -> None:
    e = error(lmctl(daemon, "--json", "compress", "--codec", "raw", "--level", "5", "--model", "m"))
    assert e["exit"] == 2 and "--level 5 means nothing for --codec raw" in e["message"]
    assert ok(daemon, "compress", "--model", "m")["chunks"] == 6
    r = lmctl(daemon, "compress", "--codec", "raw", "--model", "m", "--dry-run")
    assert r.exit_code == 0 and "would grow by" in r.stdout and "grew" not in r.stdout
    assert ok(daemon, "compress", "--codec", "raw", "--model", "m")["level"] is None


# -- status of an empty store (39) ------------------------------------------------------------------
def test_an_empty_stores_write_amplification_is_a_dash(tmp_path: Path) -> None:
    Store(tmp_path / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})).close()
    d = Daemon(tmp_path / "s")
    d.start()
    try:
        r = lmctl(d, "status")
        assert r.exit_code == 0 and "write amplification -" in r.stdout
        assert "write amplification -" in lmctl(d, "inspect").stdout
    finally:
        assert d.stop() == 0


# -- waits (40) --------------------------------------------------------------------------------------
def test_a_long_wait_on_a_terminal_says_the_cli_waits(daemon: Daemon) -> None:
    assert daemon.proc is not None
    err = io.StringIO()
    daemon.proc.send_signal(signal.SIGSTOP)  # a daemon busy loading a tokenizer, as seen from here
    threading.Timer(1.5, daemon.proc.send_signal, (signal.SIGCONT,)).start()
    r = lmctl(daemon, "status", term=Terminal(is_tty=False, color=False, stderr=err, err_tty=True,
                                              wait_notice_s=0.3))
    assert r.exit_code == 0 and "hits" in r.stdout
    assert "lmctl: waiting for the daemon (status)" in err.getvalue() and err.getvalue().endswith("\r\x1b[K")
    quiet = io.StringIO()  # not a terminal: not a word
    assert lmctl(daemon, "status", term=Terminal(is_tty=False, stderr=quiet, err_tty=False,
                                                 wait_notice_s=0)).exit_code == 0
    assert quiet.getvalue() == ""


# -- events (42) ---------------------------------------------------------------------------------------
def test_events_show_the_time_zone_and_user_names(daemon: Daemon) -> None:
    import pwd

    assert ok(daemon, "pin", "--label", "ops", "--key", KEYS[0].hex())["added"] == 1
    r = lmctl(daemon, "events")
    assert r.exit_code == 0
    assert re.search(r"\d\d:\d\d:\d\d [+-]\d{4}", r.stdout)
    assert f"uid {os.getuid()} ({pwd.getpwuid(os.getuid()).pw_name})" in r.stdout


# -- an oversized document (43) -----------------------------------------------------------------------
def test_an_oversized_document_is_a_usage_error_that_names_it(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_text("lease " * (1_600_000))  # 9.2 MiB
    r = lmctl(None, "--socket", str(tmp_path / "no.sock"), "lookup", "--file", str(big))
    assert r.exit_code == 2
    assert f"document {big} is 9.2 MiB, over the" in r.stderr and "--tokens" in r.stderr


# -- warm's wording (44) ---------------------------------------------------------------------------
def test_warm_says_where_chunks_went_and_what_it_does_not_know(tmp_path: Path) -> None:
    fill(tmp_path / "store", dram=True)
    d = Daemon(tmp_path / "store")
    d.start()
    try:
        assert ok(d, "move", "--to", "dram", "--model", "m")["chunks"] == 6
        r = lmctl(d, "warm", "--to", "nvme", "--model", "m")
        assert r.exit_code == 0 and "promoted" not in r.stdout
        assert r.stdout.startswith("brought 6 chunk(s) into nvme: 48.0 KiB")
    finally:
        assert d.stop() == 0
    from lmctl.commands.warm import _show_warm

    out = io.StringIO()
    _show_warm(Terminal(stdout=out, is_tty=False, color=False),
               {"chunks": 12, "bytes": 0, "bytes_before": 0, "bytes_after": 0, "skipped": 0, "missing": 0,
                "unchecked": 0, "fetched": 12, "dry_run": True, "to": "dram"})
    assert out.getvalue() == "would bring 12 chunk(s) into dram: all from the remote tier (sizes known once fetched)\n"


# -- repeated options (46) ---------------------------------------------------------------------------
def test_a_single_value_option_given_twice_is_a_usage_error(daemon: Daemon, tmp_path: Path) -> None:
    for args, says in [
        (("ls", "--sort", "size", "--sort", "age"), "--sort was given 2 times ('size', 'age'): give it once"),
        (("move", "--to", "dram", "--to=nvme", "--model", "m"), "--to was given 2 times"),
        (("verify", "--deep", "--no-deep"), "--deep and --no-deep contradict each other"),
        (("config", "set", "codec=raw", "codec=zstd"), "codec is set twice"),
        (("--socket", "a.sock", "status", "--socket", "b.sock"), "--socket was given more than once"),
    ]:
        r = lmctl(daemon, *args)
        assert r.exit_code == 2 and says in r.stderr, (args, r.stderr)
    store = tmp_path / "new"
    r = lmctl(None, "serve", "--store", str(store), "--init", "--capacity", "nvme=1TB", "--capacity", "nvme=2TB")
    assert r.exit_code == 2 and "--capacity names tier nvme twice (nvme=1TB, nvme=2TB)" in r.stderr
    r = lmctl(None, "serve", "--store", str(store), "--init", "--set", "codec=raw", "--set", "codec=zstd")
    assert r.exit_code == 2 and "--set names setting codec twice" in r.stderr
    assert not store.exists()
    with library(daemon) as s:
        assert s.config.codec == "raw"


# -- start-up (build item 5) ----------------------------------------------------------------------
#: what the CLI's start-up path must not import: the store library and what it pulls in, the
#: engine's stack, pydantic (typer's coercion), the modules of commands that are not running
HEAVY = ("pydantic", "pydantic_core", "typer._adapters", "store", "lmdb", "zstandard", "numpy", "torch", "vllm",
         "transformers", "lmctl.manifest", "lmctl.prefill", "lmctl.shell", "lmctl.top", "lmctl.daemon",
         "lmctl.settings", "rich.progress", "rich.live")


@pytest.mark.parametrize("args", [["--help"], ["status"], ["lookup", "--text", "hi"], ["ls", "--help"]])
def test_start_up_imports_nothing_heavy(daemon: Daemon, args: list[str]) -> None:
    code = ("import sys\nfrom lmctl.cli import main\n"
            f"try:\n    main({['--socket', str(daemon.sock), *args]!r})\nexcept SystemExit:\n    pass\n"
            f"print('IMPORTED', [m for m in {HEAVY!r} if m in sys.modules] + "
            f"(['rich'] if {args[-1] == '--help'} and 'rich' in sys.modules else []))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_path(), timeout=60)
    assert r.stdout.splitlines()[-1] == "IMPORTED []", r.stdout + r.stderr


def test_the_root_builds_only_the_command_it_runs() -> None:
    from lmctl.group import root

    group = root(app)
    assert group.commands == {}

    def run(*args: str, via: Any = group) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as ended:
            via.main(list(args), obj=Terminal(stdout=out, stderr=err, is_tty=False))
        return int(ended.value.code or 0), out.getvalue(), err.getvalue()

    code, out, _ = run("--help")
    assert code == 0 and group.commands == {}
    import typer

    assert out == run("--help", via=typer.main.get_command(app))[1]  # the list from summaries is typer's list
    assert set(group.list_commands(None)) >= {"status", "lookup", "config", "help"}  # type: ignore[arg-type]
    code, out, _ = run("status", "--help")
    assert code == 0 and out.startswith("Usage: lmctl status") and list(group.commands) == ["status"]
    code, _, err = run("stauts")
    assert code == 2 and "Did you mean 'status'?" in err


def test_plain_options_are_coerced_without_pydantic() -> None:
    for args, says in [(("ls", "--limit", "-1"), "Invalid value for '--limit': must be at least 0, not -1"),
                       (("ls", "--limit", "abc"), "Invalid value for '--limit': 'abc' is not a whole number"),
                       (("top", "--interval", "x"), "Invalid value for '--interval': 'x' is not a number")]:
        r = lmctl(None, *args)
        assert r.exit_code == 2 and says in r.stderr, r.stderr



def test_warm_manifest_takes_the_salt_from_the_environment(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    assert ok(daemon, "pin", "--label", "tenant", "--tokens", doc, "--cache-salt", "s3")["added"] == 4
    manifest = str(tmp_path / "m.json")
    assert ok(daemon, "pin", "--export-manifest", manifest, "--label", "tenant")["needs_cache_salt"] == 1
    ok(daemon, "unpin", "--label", "tenant")
    env = {"LMCTL_CACHE_SALT": "s3"}
    r = CliRunner().invoke(app, ["--socket", str(daemon.sock), "--json", "warm", "--manifest", manifest, "--pin",
                                 "--allow-missing"],
                           obj=Terminal(is_tty=False, color=False), env=env)
    assert r.exit_code == 0, r.stdout
    with library(daemon) as s:
        assert sorted(s.labels()["tenant"]) == sorted(Namespace("m", NS.kv_format, cache_salt="s3").chunk_keys(TOKENS))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"tokens": TOKENS, "model": "m"}]))
    r = CliRunner().invoke(app, ["--socket", str(daemon.sock), "--json", "warm", "--manifest", str(plain)],
                           obj=Terminal(is_tty=False, color=False), env=env)
    assert r.exit_code == 0, r.stdout  # a salt in the environment may go unused; --cache-salt may not


# -- settings (4, 11, 13, 21, 22, 33, 41) -----------------------------------------------------------
def test_a_size_too_large_says_so_and_names_the_limit(daemon: Daemon) -> None:
    for value in ("99999999PiB", "1e400GiB", "9EiB"):
        r = lmctl(daemon, "config", "set", f"tiers.nvme.capacity={value}")
        assert r.exit_code == 2, r.stdout
        assert r.stderr == (f"lmctl: size '{value}' is too large: the largest size is 2^63 - 1 bytes "
                            "(just under 8EiB)\n"), r.stderr
    r = lmctl(daemon, "config", "set", "tiers.nvme.capacity=lots")
    assert r.exit_code == 2 and "is not a size like 512MiB" in r.stderr
    assert ok(daemon, "config", "set", "tiers.nvme.capacity=1PiB")["settings"]["tiers"]["nvme"]["capacity"] == 1 << 50


def settings_rows(out: str) -> dict[str, str]:
    """``config show``'s table: {setting: value}."""
    cells = ([c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│"))
    return {c[0]: c[1] for c in cells if len(c) == 2}


def test_sizes_in_messages_and_config_show_carry_units(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    ok(daemon, "config", "set", "tiers.nvme.pin_budget=1KiB")
    r = lmctl(daemon, "pin", "--label", "doc", "--tokens", doc)
    assert r.exit_code == 1 and re.search(r"would put \d+\.\d KiB pinned in tier nvme, over its pin budget of "
                                          r"1\.0 KiB; ", r.stderr), r.stderr
    ok(daemon, "config", "set", "tiers.nvme.pin_budget=0.5")
    ok(daemon, "pin", "--label", "doc", "--tokens", doc)
    r = lmctl(daemon, "config", "set", "tiers.nvme.pin_budget=1KiB")
    assert r.exit_code == 2 and re.search(r"tier nvme holds \d+\.\d KiB of pinned chunks, over the pin budget of "
                                          r"1\.0 KiB these settings give", r.stderr), r.stderr
    r = lmctl(daemon, "config", "show")
    rows = settings_rows(r.stdout)
    assert rows["tiers.nvme.capacity"] == "256.0 MiB" and rows["segment_bytes"] == "4.0 MiB", r.stdout
    assert rows["retire_after_s"] == "1h" and rows["access_flush_s"] == "1s" and rows["tiers.nvme.pin_budget"] == "0.5"
    assert rows["compress_cold_after_s"] == "0s" and rows["remote"] == "none"
    for rejected in ("tiers.nvme.capacity=256.0 MiB", "retire_after_s=1h"):  # what it shows, config set takes
        ok(daemon, "config", "set", rejected)
    assert not [v for k, v in rows.items()  # no byte counts
                if re.search(r"\d{5}", v) and k not in ("event_log_max", "admit_ghosts")], rows


def test_config_show_gives_the_remote_tier_a_row_per_setting(daemon: Daemon) -> None:
    ok(daemon, "config", "set", "remote.url=redis://:hunter2@127.0.0.1:9/0", "remote.trust=all-writers",
       "remote.key_prefix=tour")
    r = lmctl(daemon, "config", "show")
    rows = settings_rows(r.stdout)
    assert "remote" not in rows and rows["remote.key_prefix"] == "tour" and rows["remote.write"] == "always"
    assert rows["remote.url"].startswith("redis://") and "127.0.0.1:9/0" in rows["remote.url"]
    assert rows["remote.piece_bytes"] == "4.0 MiB" and rows["remote.lookup_timeout_s"] == "0.05s"
    assert rows["remote.io_timeout_s"] == "2s" and rows["remote.secret_file"] == "none"
    assert "hunter2" not in r.stdout  # the password stays out, as in the JSON
    assert max(map(len, r.stdout.splitlines())) <= 80, r.stdout


def test_a_remote_tier_turned_off_and_on_again_keeps_its_settings(daemon: Daemon) -> None:
    ok(daemon, "config", "set", "remote.url=redis://127.0.0.1:9/0", "remote.trust=all-writers",
       "remote.key_prefix=tour", "remote.write=never", "remote.io_timeout_s=5s")
    off = ok(daemon, "config", "set", "remote.url=none")["settings"]
    assert off["remote"] is None and "remote_off" not in off
    r = lmctl(daemon, "config", "set", "remote.key_prefix=other")  # no url: the tier stays off
    assert r.exit_code == 2 and "needs remote.url" in r.stderr
    back = ok(daemon, "config", "set", "remote.url=redis://127.0.0.1:9/1")["settings"]["remote"]
    assert (back["url"], back["key_prefix"], back["write"], back["trust"], back["io_timeout_s"]) == (
        "redis://127.0.0.1:9/1", "tour", "never", "all-writers", 5.0), back
    with library(daemon) as s:
        assert s.config.remote is not None and s.config.remote.key_prefix == "tour" and s.config.remote_off is None


def test_a_relative_tier_path_is_recorded_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # serve runs here: its relative --tier-path is relative to this folder
    d = Daemon(tmp_path / "s2", tmp_path / "s2.sock", ["--init", "--tier-path", "dram=relative/path",
                                                        "--capacity", "dram=64MiB"])
    d.start()
    try:
        assert ok(d, "config", "show")["settings"]["tiers"]["dram"]["path"] == str(work / "relative" / "path")
    finally:
        assert d.stop() == 0
    monkeypatch.chdir("/")  # another process, another folder: the same tier folder
    with library(d) as s:
        assert s.stats().tiers["dram"].path == str(work / "relative" / "path")
    assert not Path("/relative").exists()


def test_a_relative_tier_path_an_older_store_recorded_is_refused_then_fixed(tmp_path: Path) -> None:
    from test_hostile_inputs import set_meta

    store = tmp_path / "old"
    dram = tmp_path / "dram"
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB), "dram": TierConfig(64 * MiB, path=str(dram))})
    Store(store, cfg).close()
    cfg.tiers["dram"].path = "dram"  # as an older lmctl recorded --tier-path dram=dram, run from tmp_path
    set_meta(store, b"config", cfg.to_json().encode())
    want = (f"store {store}: tier dram's folder is recorded as the relative path 'dram' (an older lmctl kept "
            "--tier-path as typed), which each process would look for from its own working folder; record its "
            f"absolute path once: lmctl serve --store {store} --tier-path dram=/ABSOLUTE/FOLDER")
    for readonly in (True, False):
        with pytest.raises(StoreError) as e:
            Store(store, readonly=readonly)
        assert str(e.value) == want
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", "serve", "--store", str(store)], capture_output=True,
                       text=True, env=env_with_path(), timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"lmctl: {want}"], r.stderr
    d = Daemon(store, extra=["--tier-path", f"dram={dram}"])
    d.start()
    try:
        assert ok(d, "config", "show")["settings"]["tiers"]["dram"]["path"] == str(dram)
    finally:
        assert d.stop() == 0
    with Store(store, readonly=True) as s:  # recorded: every process finds the one folder
        assert s.config.tiers["dram"].path == str(dram)


def test_a_dram_tier_on_disk_is_warned_of_and_an_empty_tier_can_be_removed(daemon: Daemon) -> None:
    from store.format.private import MEMORY_FILESYSTEMS, filesystem_type

    if filesystem_type(str(daemon.store)) in MEMORY_FILESYSTEMS:
        pytest.skip("the store is on tmpfs: a dram tier there is where it belongs")
    r = lmctl(daemon, "config", "set", "tiers.dram.capacity=64MiB")
    assert r.exit_code == 0, r.stdout + r.stderr
    dram = daemon.store / "dram"
    assert r.stderr.splitlines() == [f"lmctl: warning: tier dram's folder {dram} is on "
                                     f"{filesystem_type(str(dram))}, not tmpfs: its chunks are on disk, not in "
                                     "memory; give the dram tier a folder under /dev/shm (while it is empty: "
                                     "tiers.dram=none, then tiers.dram.path=/dev/shm/... and tiers.dram.capacity)"]
    assert ok(daemon, "status")["store"]["notes"] == [r.stderr.splitlines()[0].removeprefix("lmctl: warning: ")]
    assert f"note: tier dram's folder {dram} is on" in lmctl(daemon, "status").stdout
    assert ok(daemon, "move", "--to", "dram", "--model", "m")["chunks"] == 6
    r = lmctl(daemon, "config", "set", "tiers.dram=none")
    assert r.exit_code == 2 and re.fullmatch(
        r"lmctl: tier dram holds 6 chunk\(s\), [\d.]+ KiB: move or evict them first \(lmctl move --tier dram --to "
        r"nvme, or lmctl evict --tier dram\), then remove it\n", r.stderr), r.stderr
    ok(daemon, "move", "--to", "nvme", "--tier", "dram")
    removed = ok(daemon, "config", "set", "tiers.dram=none")["settings"]["tiers"]
    assert list(removed) == ["nvme"]
    assert ok(daemon, "status")["store"]["notes"] == [] and not list(dram.glob("seg-*"))
    with library(daemon) as s:
        assert list(s.config.tiers) == ["nvme"] and None not in s.locate(KEYS)
    for setting, says in (("tiers.dram=none", "this store has no tier dram"),
                          ("tiers.nvme=none", "a store needs at least one tier"),
                          ("tiers.nvme=1GiB", "takes none")):
        r = lmctl(daemon, "config", "set", setting)
        assert r.exit_code == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_the_documented_config_file_is_read_and_shows_every_setting_of_daemon_and_remote_write() -> None:
    from lmctl.settings import DAEMON_KEYS, check_values, read_config_file
    from store.config import REMOTE_WRITES

    docs = Path(__file__).resolve().parent.parent / "docs"
    toml = (docs / "cli.md").read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(toml)
        f.flush()
        daemon, changes = read_config_file(f.name)
    check_values(changes)
    assert sorted(daemon) == sorted(DAEMON_KEYS)
    write = toml[toml.index("write = "):toml.index("password_file")]
    assert all(f'"{w}"' in write for w in REMOTE_WRITES), write
    guide = (docs / "operator-guide.md").read_text()
    what = guide[guide.index("- **What it does**"):][:600]
    assert all(re.search(f"[`\"]{w}[`\"]", what) for w in REMOTE_WRITES), what
