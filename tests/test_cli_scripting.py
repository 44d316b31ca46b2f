"""What scripts and service managers ask of lmctl: ``-q/--quiet``, ``-o/--output`` and
``--no-headers``, ``events --follow``, dry runs that list what they would change, ``lookup
--min-hit``, read-only peers (``serve --allow-uid-ro``) and systemd's ``Type=notify``. Each
against a real daemon (``test_daemon.Daemon``) and the real command line (in this process,
``test_cli.lmctl``, or as a process of its own, ``test_daemon.cli``)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import content, env_with_path
from test_cli import lmctl
from test_daemon import NS, OTHER, TOKENS, Daemon, cj, cli, fill, library, tokens_file

from lmctl.client import Client
from lmctl.terminal import ExitStatus
from store import KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig
from stress.users import as_user, call, open_folder, throwaway_user
from stress.users import cli as run_cli

#: chunks of 512 KiB: a few dozen fill more than the smallest capacity a tier takes (16 MiB)
BIG = KVFormat("bfloat16", num_layers=8, num_kv_heads=8, head_dim=128, chunk_size=16)
BIG_NS = Namespace("big", BIG)


@pytest.fixture
def big(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon over 40 chunks of 512 KiB (about 20 MiB on nvme), the first 4 pinned."""
    path = tmp_path / "big"
    with Store(path, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, segment_bytes=4 * MiB)) as s:
        s.register_namespace(BIG_NS, {"model_id": "big", "tokenizer": None})
        keys = BIG_NS.chunk_keys(list(range(40 * 16)))
        layout = {"dtype": "bfloat16", "shape": list(BIG.chunk_shape)}
        for k in keys:
            assert s.put(k, content(k, BIG.chunk_bytes), layout, tokens=16)
        s.pin("kept", keys[:4])
    d = Daemon(path)
    d.start()
    yield d
    if d.proc is not None:
        assert d.stop() == 0


# -- -q/--quiet ---------------------------------------------------------------------------------
def test_quiet_keeps_data_errors_and_exit_codes_and_drops_the_rest(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    # a change says nothing under -q (before or after the command), and still happens
    r = cli(daemon, "-q", "pin", "--label", "q", "--tokens", doc)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = cli(daemon, "evict", "--key", NS.chunk_keys(OTHER)[0].hex(), "--quiet")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = cli(daemon, "-q", "config", "set", "codec_level=2")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    with library(daemon) as s:
        assert set(s.labels()) == {"q"}
        assert s.locate([NS.chunk_keys(OTHER)[0]]) == [None] and s.config.codec_level == 2
    # a listing prints its rows alone: no header, no summary, no next-page line
    loud = cli(daemon, "ls", "--limit", "2")
    assert "chunk hash" in loud.stdout and "next page" in loud.stdout
    r = cli(daemon, "-q", "ls", "--limit", "2")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout
    assert all("│" not in x and "chunk hash" not in x and "next page" not in x for x in lines)
    assert [x.split()[0] for x in lines] == [c["key"][32:48] + "…" for c in cj(daemon, "ls", "--limit", "2")["chunks"]]
    # events: the rows, without the totals line
    r = cli(daemon, "-q", "events")
    assert r.returncode == 0 and "totals" not in r.stdout and len(r.stdout.splitlines()) == 2  # pin, evict
    # errors and exit codes stay
    r = cli(daemon, "-q", "unpin", "--label", "never-made")
    assert r.returncode == ExitStatus.USAGE and r.stdout == "" and r.stderr.startswith("lmctl: no label")
    r = cli(None, "-q", "status", sock=str(tmp_path / "nobody.sock"))
    assert r.returncode == ExitStatus.UNREACHABLE and r.stderr.startswith("lmctl: no lmctl daemon")
    # --json wins: JSON is data
    assert json.loads(cli(daemon, "-q", "--json", "pin", "--label", "q", "--tokens", doc).stdout)["chunks"] == 4
    # in process too, and in the shell's lines
    res = lmctl(daemon, "-q", "unpin", "--label", "q")
    assert res.exit_code == 0 and res.stdout == ""
    r = cli(daemon, "shell", stdin="-q pin --label q2 --tokens " + doc + "\npin --label q3 --tokens " + doc + "\n")
    assert r.returncode == 0 and "q2" not in r.stdout and "'q3'" in r.stdout, r.stdout
    assert set(cj(daemon, "inspect")["labels"]) == {"q2", "q3"}


def test_quiet_serve_logs_warnings_only(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    d = Daemon(tmp_path / "store", extra=["-q"])
    proc = d.start()
    assert cj(d, "status")["daemon"]["pid"] == proc.pid
    assert d.stop() == 0
    assert proc.stderr is not None and " INFO " not in proc.stderr.read()


# -- -o/--output and --no-headers ------------------------------------------------------------------
def test_ls_output_formats_paste_back_into_key(daemon: Daemon, tmp_path: Path) -> None:
    keys = [c["key"] for c in cj(daemon, "ls", "--limit", "0")["chunks"]]
    assert len(keys) == 6
    r = cli(daemon, "ls", "--limit", "0", "-o", "name")
    assert r.returncode == 0 and r.stdout.splitlines() == keys  # nothing but the keys: no summary line
    # pasted back into --key: the chunks they name
    got = cj(daemon, "ls", "--limit", "0", *[w for k in r.stdout.split() for w in ("--key", k)])
    assert [c["key"] for c in got["chunks"]] == keys
    r = cli(daemon, "ls", "--limit", "0", "--output", "tsv")
    lines = [x.split("\t") for x in r.stdout.splitlines()]
    assert lines[0] == ["key", "tier", "bytes", "tokens", "pins", "hits", "created", "last_access", "model",
                        "adapter", "codec"]
    assert [x[0] for x in lines[1:]] == keys and all(x[1] == "nvme" and x[2].isdigit() and x[3] == "16"
                                                     and x[8] == "m" and x[9] == "" for x in lines[1:])
    assert all(len(x) == 11 and x[6][:2] == "20" and "T" in x[6] for x in lines[1:])
    r = cli(daemon, "ls", "--limit", "0", "-o", "tsv", "--no-headers")
    assert [x.split("\t")[0] for x in r.stdout.splitlines()] == keys
    r = cli(daemon, "ls", "--limit", "0", "-o", "wide")
    assert all(k in r.stdout for k in keys) and "codec" in r.stdout and "6 chunk(s)" in r.stdout
    r = cli(daemon, "ls", "--limit", "2", "--no-headers")  # a table without its header; the summary stays
    assert "chunk hash" not in r.stdout and "│" not in r.stdout and "next page" in r.stdout
    # a format that is none of them, or two formats: usage errors
    r = cli(daemon, "ls", "-o", "yaml")
    assert r.returncode == 2 and "-o/--output must be wide, tsv or name, not 'yaml'" in r.stderr
    r = cli(daemon, "--json", "ls", "-o", "tsv")
    assert r.returncode == 2 and "two output formats" in json.loads(r.stdout)["error"]["message"]


def test_events_and_inspect_output_formats(daemon: Daemon, tmp_path: Path) -> None:
    key = NS.chunk_keys(OTHER)[0].hex()
    assert cli(daemon, "evict", "--key", key).returncode == 0
    assert cli(daemon, "pin", "--label", "tsv\tlabel", "--tokens", tokens_file(tmp_path, TOKENS)).returncode == 0
    r = cli(daemon, "events", "-o", "tsv")
    rows = [x.split("\t") for x in r.stdout.splitlines()]
    assert rows[0] == ["time", "kind", "reason", "chunks", "tier", "label", "uid", "bytes", "key", "detail"]
    assert [x[1] for x in rows[1:]] == ["evict", "pin"] and rows[1][8] == key and rows[1][7].isdigit()
    assert rows[2][5] == "tsv\\tlabel" and len(rows[2]) == 10  # a tab in a value is escaped
    assert cli(daemon, "events", "-o", "name", "--kind", "evict").stdout == key + "\n"
    r = cli(daemon, "events", "-o", "wide", "--kind", "evict")
    assert key in r.stdout and "totals" in r.stdout
    r = cli(daemon, "events", "--no-headers", "-q")
    assert len(r.stdout.splitlines()) == 2 and "reason" not in r.stdout
    # inspect: a section per table; one chunk as field/value; its key as a name
    r = cli(daemon, "inspect", "-o", "tsv")
    sections = r.stdout.split("\n\n")
    assert [s.split("\t")[0] for s in sections] == ["tier", "model", "model", "label"], r.stdout
    assert sections[0].splitlines()[1].split("\t")[:2] == ["nvme", "5"]
    bare = cli(daemon, "inspect", "-o", "tsv", "--no-headers").stdout
    assert bare.splitlines()[0].split("\t")[:2] == ["nvme", "5"]
    first = NS.chunk_keys(TOKENS)[0].hex()
    assert cli(daemon, "inspect", "--key", first[32:40], "-o", "name").stdout == first + "\n"
    r = cli(daemon, "inspect", "--key", first, "-o", "tsv")
    fields = dict(x.split("\t", 1) for x in r.stdout.splitlines()[1:])
    assert fields["key"] == first and fields["tokens"] == "16" and fields["labels"] == '["tsv\\tlabel"]'
    r = cli(daemon, "inspect", "-o", "name")
    assert r.returncode == 2 and "lmctl ls -o name" in r.stderr
    r = cli(daemon, "inspect", "-o", "wide")
    assert r.returncode == 0 and "write amplification" in r.stdout


# -- events --follow ----------------------------------------------------------------------------------
class Follower:
    """``lmctl events --follow ...`` as a process of its own, its stdout read line by line."""

    def __init__(self, d: Daemon, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lmctl.cli", "--socket", str(d.sock), "events",
                                      "--follow", "--interval", "0.2", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env_with_path())
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next(self, timeout: float = 20) -> str:
        return self.lines.get(timeout=timeout)

    def quiet_for(self, seconds: float) -> bool:
        """Whether no line comes within ``seconds``."""
        try:
            line = self.lines.get(timeout=seconds)
        except queue.Empty:
            return True
        raise AssertionError(f"unexpected line: {line!r}")

    def end(self, sig: int) -> tuple[int, str]:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=20)
        assert self.proc.stderr is not None
        return rc, self.proc.stderr.read()


def test_events_follow_prints_new_events_as_they_come_until_sigterm(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    assert cli(daemon, "pin", "--label", "before", "--tokens", doc).returncode == 0
    f = Follower(daemon, "--kind", "evict", "--kind", "unpin")
    try:
        assert f.quiet_for(1.0)  # the pin before it is of another kind
        keys = NS.chunk_keys(OTHER)
        t0 = time.monotonic()
        assert cli(daemon, "evict", "--key", keys[0].hex()).returncode == 0
        assert f.next().split() == ["time", "kind", "reason", "chunks", "details"]  # the header, once
        line = f.next()
        assert time.monotonic() - t0 < 10
        assert line.split()[3:6] == ["evict", "operator", "1"] and keys[0].hex()[32:48] in line, line
        assert cli(daemon, "pin", "--label", "after", "--tokens", doc).returncode == 0  # filtered out
        assert cli(daemon, "unpin", "--label", "after").returncode == 0
        assert cli(daemon, "evict", "--key", keys[1].hex()).returncode == 0
        assert f.next().split()[3] == "unpin" and f.next().split()[3] == "evict"
        assert f.quiet_for(0.6)  # each event once
    finally:
        rc, err = f.end(signal.SIGTERM)
    assert (rc, err) == (0, "")


def test_events_follow_json_lines_and_ctrl_c(daemon: Daemon, tmp_path: Path) -> None:
    doc = tokens_file(tmp_path, TOKENS)
    assert cli(daemon, "pin", "--label", "old", "--tokens", doc).returncode == 0
    f = Follower(daemon, "--json", "--limit", "1")
    try:
        first = json.loads(f.next())  # the newest event there was, as a JSON line of its own
        assert (first["kind"], first["label"]) == ("pin", "old")
        assert cli(daemon, "unpin", "--label", "old").returncode == 0
        e = json.loads(f.next())
        assert (e["kind"], e["label"], e["seq"]) == ("unpin", "old", first["seq"] + 1)
    finally:
        rc, err = f.end(signal.SIGINT)
    assert (rc, err) == (130, "")
    r = cli(daemon, "events", "--follow", "--interval", "0")
    assert r.returncode == 2 and "--interval must be between 0.1 and 60" in r.stderr
    # -o name: the first chunk of each event, nothing else
    f = Follower(daemon, "-o", "name", "--limit", "0", "--kind", "evict")
    try:
        assert f.quiet_for(0.6)
        key = NS.chunk_keys(OTHER)[0].hex()
        assert cli(daemon, "evict", "--key", key).returncode == 0
        assert f.next() == key
    finally:
        assert f.end(signal.SIGTERM)[0] == 0


# -- dry runs that say what would go ---------------------------------------------------------------
def test_config_set_dry_run_says_what_a_smaller_capacity_would_evict(big: Daemon) -> None:
    before = cj(big, "ls", "--limit", "0")
    r = cj(big, "config", "set", "tiers.nvme.capacity=16MiB", "--dry-run")
    assert r["dry_run"] is True and r["changed"] == ["tiers.nvme.capacity"]
    assert r["settings"]["tiers"]["nvme"]["capacity"] == 16 * MiB  # the settings it would give
    e = r["evicts"]["nvme"]
    assert e["capacity_before"] == 256 * MiB and e["capacity"] == 16 * MiB and e["moves_to"] is None
    assert 10 < e["chunks"] < 36 and e["bytes"] >= e["chunks"] * BIG.chunk_bytes
    # nothing applied, nothing evicted
    assert cj(big, "config", "show")["settings"]["tiers"]["nvme"]["capacity"] == 256 * MiB
    assert cj(big, "ls", "--limit", "0") == before
    h = cli(big, "config", "set", "tiers.nvme.capacity=16MiB", "--dry-run")
    assert h.returncode == 0 and h.stdout.splitlines() == [
        "would change tiers.nvme.capacity (nothing applied)",
        f"tier nvme: would evict {e['chunks']} chunk(s), {e['bytes'] / MiB:.1f} MiB at once "
        "(capacity 256.0 MiB -> 16.0 MiB)"]
    # a setting refused is refused by the dry run too; a larger capacity evicts nothing
    bad = cli(big, "config", "set", "tiers.nvme.capacity=1MiB", "--dry-run")
    assert bad.returncode == 2
    assert cj(big, "config", "set", "tiers.nvme.capacity=1GiB", "--dry-run")["evicts"]["nvme"]["chunks"] == 0
    # applied, it evicts at once what it said it would (background maintenance may take a few more
    # later, where dead space left in segments keeps the tier above its high watermark)
    cj(big, "config", "set", "tiers.nvme.capacity=16MiB")
    first = cj(big, "events", "--kind", "evict")["events"][0]
    assert (first["reason"], first["chunks"], first["bytes"]) == ("lru", e["chunks"], e["bytes"])
    after = cj(big, "ls", "--limit", "0")
    assert after["total"] <= before["total"] - e["chunks"]
    pinned = {c["key"] for c in before["chunks"] if c["pins"]}
    assert pinned <= {c["key"] for c in after["chunks"]}


def test_evict_dry_run_lists_what_would_go_pasteable_with_o_name(big: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    everything = cj(big, "ls", "--limit", "0")["chunks"]
    unpinned = [c["key"] for c in everything if not c["pins"]]
    r = cj(big, "evict", "--model", "big", "--dry-run")
    assert (r["chunks"], r["skipped_pinned"]) == (36, 4)
    assert [x["key"] for x in r["keys"]] == unpinned and all(x["tier"] == "nvme" for x in r["keys"])
    assert sum(x["bytes"] for x in r["keys"]) == r["bytes"] and {x["pins"] for x in r["keys"]} == {0}
    # people: a table of short keys with sizes, then the count
    h = cli(big, "evict", "--model", "big", "--dry-run")
    assert h.returncode == 0 and unpinned[0][32:48] + "…" in h.stdout and "KiB" in h.stdout
    assert h.stdout.splitlines()[-1].startswith("would evict 36 chunk(s)")
    # scripts: the keys alone, that --key takes back
    names = cli(big, "evict", "--model", "big", "--dry-run", "-o", "name").stdout.split()
    assert names == unpinned[:len(names)] and len(names) == 36
    tsv = cli(big, "evict", "--model", "big", "--dry-run", "-o", "tsv", "--no-headers").stdout.splitlines()
    assert [x.split("\t")[0] for x in tsv] == unpinned and tsv[0].split("\t")[1] == "nvme"
    assert cli(big, "evict", "--model", "big", "-o", "name").returncode == 2  # -o lists a dry run only
    # a table shows the first rows and says how many more there are
    monkeypatch.setattr("lmctl.commands.changes.VICTIM_ROWS", 10)
    h2 = lmctl(big, "evict", "--model", "big", "--dry-run")
    assert h2.exit_code == 0 and unpinned[9][32:48] in h2.stdout and unpinned[10][32:48] not in h2.stdout
    assert "... and 26 more (-o name or -o tsv lists them all)" in h2.stdout
    # the protocol: counts alone unless a listing is asked for (a dry run of filters reads the counts)
    c = Client(str(big.sock))
    try:
        assert "keys" not in c.call("evict", {"model": "big", "dry_run": True})
        few = c.call("evict", {"model": "big", "dry_run": True, "list": 3})
        assert (few["chunks"], [x["key"] for x in few["keys"]]) == (36, unpinned[:3])
    finally:
        c.close()
    assert cj(big, "ls", "--limit", "0")["chunks"] == everything  # nothing evicted so far
    r = cj(big, "evict", *[w for k in names[:5] for w in ("--key", k)])
    assert r["chunks"] == 5
    with library(big) as s:
        assert s.locate([bytes.fromhex(k) for k in names[:6]]) == [None] * 5 + ["nvme"]


# -- lookup --min-hit -----------------------------------------------------------------------------------
def test_lookup_min_hit_exits_1_with_one_line_below_the_fraction(daemon: Daemon, tmp_path: Path) -> None:
    whole = tokens_file(tmp_path, TOKENS)
    half = tokens_file(tmp_path, TOKENS[:40] + [9] * 24, "half.json")  # 32 of 64 tokens cached
    r = cli(daemon, "-q", "lookup", "--tokens", whole, "--min-hit", "1")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = cli(daemon, "-q", "lookup", "--tokens", half, "--min-hit", "0.9")
    assert (r.returncode, r.stdout) == (ExitStatus.ERROR, "")
    assert r.stderr == "lmctl: 50.0% of the document is cached (32 of 64 tokens), below --min-hit 0.9\n"
    assert cli(daemon, "-q", "lookup", "--tokens", half, "--min-hit", "0.5").returncode == 0  # at least: passes
    r = cli(daemon, "lookup", "--tokens", half, "--min-hit", "0.9")  # the result is shown, then the line
    assert r.returncode == 1 and "32 of 64 tokens cached (50%)" in r.stdout and r.stderr.count("\n") == 1
    r = cli(daemon, "--json", "lookup", "--tokens", half, "--min-hit", "0.9")
    assert r.returncode == 1 and r.stderr == "" and json.loads(r.stdout)["hit_tokens"] == 32
    for bad in ("1.5", "-0.1", "nan"):
        r = cli(daemon, "lookup", "--tokens", half, "--min-hit", bad)
        assert r.returncode == ExitStatus.USAGE and r.stdout == "" and r.stderr.count("\n") == 1, (bad, r.stderr)
    # a deploy script's gate, as written in the docs
    r = subprocess.run(["sh", "-c", f'{sys.executable} -m lmctl.cli --socket {daemon.sock} -q lookup --tokens {half} '
                                    '--min-hit 0.9 && echo warm || echo cold'],
                       capture_output=True, text=True, env=env_with_path(), timeout=60)
    assert r.stdout == "cold\n"


# -- serve --allow-uid-ro ------------------------------------------------------------------------------
READS = [["status"], ["ls", "--limit", "0"], ["inspect"], ["events"], ["verify"], ["config", "show"],
         ["top", "--interval", "0.1"], ["evict", "--model", "m", "--dry-run"]]
CHANGES = [(["evict", "--model", "m"], "evict"), (["config", "set", "codec_level=3"], "config set"),
           (["verify", "--fix"], "verify --fix"), (["unpin", "--label", "ro"], "unpin"),
           (["compress", "--model", "m"], "compress"), (["move", "--to", "nvme", "--model", "m"], "move")]


def test_a_read_only_uid_reads_and_is_denied_every_change(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second user and switch to it")
    fill(tmp_path / "store")
    with throwaway_user() as user, open_folder() as shared:
        doc = Path(shared) / "doc.json"
        doc.write_text(json.dumps(TOKENS))
        os.chmod(doc, 0o644)
        d = Daemon(tmp_path / "store", Path(shared) / "lmctl.sock",
                   ["--allow-uid-ro", str(user.uid), "--socket-mode", "0666"])
        d.start()
        try:
            sock = str(d.sock)
            assert run_cli("--socket", sock, "pin", "--label", "ro", "--tokens", str(doc))["rc"] == 0
            lines = [*READS, ["--json", "lookup", "--tokens", str(doc)], *(c for c, _ in CHANGES)]
            for args in lines:  # as the owner first: a child of another uid finds the modules loaded
                dry = args[0] in ("evict", "compress", "move", "unpin", "config") and args[:2] != ["config", "show"]
                run_cli("--socket", sock, *args, "--dry-run" if dry and "--dry-run" not in args else "--json")
            before = cj(d, "ls", "--limit", "0")
            for args in READS:
                out = as_user(user, run_cli, "--socket", sock, *args)
                assert out["rc"] == 0, (args, out)
            got = json.loads(as_user(user, run_cli, "--socket", sock, "--json", "lookup", "--tokens", str(doc))
                             ["stdout"])
            assert got["hit_tokens"] == 64
            for args, what in CHANGES:
                out = as_user(user, run_cli, "--socket", sock, *args)
                assert out["rc"] == ExitStatus.ERROR and out["stdout"] == "", (args, out)
                assert out["stderr"] == (f"lmctl: uid {user.uid} may only read this store (serve --allow-uid-ro): "
                                         f"{what} changes it; --dry-run shows what it would do, or ask the store's "
                                         f"owner (uid 0)\n"), out
            # through the protocol too, whatever the client: every op that changes something
            for cmd, request in [("pin", {"label": "x", "keys": [NS.chunk_keys(TOKENS)[0].hex()]}),
                                 ("warm", {"label": "ro"}), ("warm", {"label": "ro", "dry_run": True}),
                                 ("config", {"set": {"codec": "zstd"}}), ("evict", {"label": "ro", "dry_run": 1})]:
                r = as_user(user, call, sock, cmd, request)
                assert r.get("error") == "denied", (cmd, request, r)
            assert as_user(user, call, sock, "frobnicate", {}).get("error") == "usage"
            # nothing changed; the owner still changes anything
            assert cj(d, "ls", "--limit", "0") == before
            assert cj(d, "config", "show")["settings"]["codec_level"] == 1
            assert cj(d, "evict", "--model", "m")["chunks"] == 2
        finally:
            assert d.stop() == 0
    # a uid given both kinds of access is a usage error; the config file's [daemon] takes the list
    r = cli(None, "serve", "--store", str(tmp_path / "store"), "--allow-uid", "4242", "--allow-uid-ro", "4242")
    assert r.returncode == 2 and "both full (--allow-uid) and read-only" in r.stderr
    conf = tmp_path / "lmctl.toml"
    conf.write_text("[daemon]\nallow_uid_ro = [\"x\"]\n")
    r = cli(None, "serve", "--store", str(tmp_path / "store"), "--config", str(conf))
    assert r.returncode == 2 and "allow_uid_ro must be a list of uids" in r.stderr


# -- systemd Type=notify ---------------------------------------------------------------------------------
@pytest.mark.parametrize("abstract", [False, True])
def test_serve_tells_notify_socket_ready_once_it_serves_and_stopping_on_sigterm(tmp_path: Path,
                                                                               abstract: bool) -> None:
    import socket

    fill(tmp_path / "store")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"lmctl-test-notify-{os.getpid()}-{time.monotonic_ns()}"
    listener.bind("\0" + name if abstract else str(tmp_path / "notify"))
    listener.settimeout(30)
    env = env_with_path()
    env["NOTIFY_SOCKET"] = "@" + name if abstract else str(tmp_path / "notify")
    d = Daemon(tmp_path / "store", env=env)
    try:
        proc = d.start(wait=False)
        ready = listener.recv(4096).decode()
        # READY=1 comes once the socket answers and the store is open: a request succeeds at once
        lines = ready.split("\n")
        assert lines[0] == "READY=1" and lines[1] == f"MAINPID={proc.pid}" and lines[2].startswith("STATUS=serving")
        assert cj(d, "status")["store"]["tiers"]["nvme"]["chunks"] == 6
        assert d.stop() == 0
        assert listener.recv(4096) == b"STOPPING=1"
    finally:
        if d.proc is not None:
            d.proc.kill()
        listener.close()


def test_serve_without_a_listening_notify_socket_still_serves(tmp_path: Path) -> None:
    fill(tmp_path / "store")
    env = env_with_path()
    env["NOTIFY_SOCKET"] = str(tmp_path / "nobody-listens")
    d = Daemon(tmp_path / "store", env=env)
    proc = d.start()
    try:
        assert cj(d, "status")["daemon"]["pid"] == proc.pid
    finally:
        assert d.stop() == 0
    assert d.proc is None


def test_quiet_tsv_is_rows_alone(daemon: Daemon) -> None:
    loud = cli(daemon, "ls", "--limit", "0", "-o", "tsv").stdout.splitlines()
    assert cli(daemon, "-q", "ls", "--limit", "0", "-o", "tsv").stdout.splitlines() == loud[1:]
