"""What scripts and service managers ask of lmctl: ``-q/--quiet``, ``-o/--output`` and
``--no-headers``, ``events --follow``, dry runs that list what they would change, ``lookup
--min-hit``, read-only peers (``serve --allow-uid-ro``) and systemd's ``Type=notify``. Each
against a real daemon (``test_daemon.Daemon``) and the real command line (in this process,
``test_cli.lmctl``, or as a process of its own, ``test_daemon.cli``)."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli import lmctl
from test_daemon import NS, OTHER, TOKENS, Daemon, cj, cli, library, tokens_file

from lmctl.terminal import ExitStatus


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
    r = lmctl(daemon, "-q", "unpin", "--label", "q")
    assert r.exit_code == 0 and r.stdout == ""
    r = cli(daemon, "shell", stdin="-q pin --label q2 --tokens " + doc + "\npin --label q3 --tokens " + doc + "\n")
    assert r.returncode == 0 and "q2" not in r.stdout and "'q3'" in r.stdout, r.stdout
    assert set(cj(daemon, "inspect")["labels"]) == {"q2", "q3"}
