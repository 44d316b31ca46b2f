"""The seconds-long demo scripts, run as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

#: every reason ``lmctl lookup --explain`` gives (docs/cli.md)
REASONS = {"never-stored", "other-model", "other-adapter", "other-adapter-version", "other-salt",
           "other-model-fingerprint", "other-kv-format", "evicted", "corrupt", "save-dropped",
           "remote-unavailable"}


def test_explain_tour_shows_every_reason(tmp_path: Path) -> None:
    """demo/explain_tour.py: each reason from a real scenario, through the daemon and the CLI;
    no absolute temporary path in its transcript, and nothing left behind."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    res = subprocess.run([sys.executable, "demo/explain_tour.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=90)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    out = res.stdout
    shown = re.findall(r"^why: ([a-z-]+): ", out, re.MULTILINE)
    assert set(shown) == REASONS and len(shown) == len(REASONS), shown
    assert "$ lmctl events --since 1h" in out and "evictions_total lru=" in out
    assert str(tmp_path) not in out + res.stderr
    assert not list(tmp_path.iterdir())  # the work folder is removed
    left = []  # and the daemon and redis-server it started are stopped (their cwd was in it)
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/cwd").startswith(str(tmp_path)):
                left.append(pid)
        except OSError:
            continue
    assert not left, f"processes left running: {left}"
    # the closest holder names the reason: the TP=2 rank-0 engine's format (two fields differ),
    # not rank 1's (three)
    kv = next(line for line in out.splitlines() if line.startswith("why: other-kv-format"))
    assert "tp_size 2 (asked 1)" in kv and "tp_rank" not in kv
    # with the server down nobody knows whether it still holds the moved chunk
    down = next(line for line in out.splitlines() if line.startswith("why: remote-unavailable"))
    assert "may still hold it" in down and "no longer has it" not in down
    # a move is one event for the chunks it dropped, not one per chunk
    assert re.search(r"evict +│ moved-remote +│ +2 │", out), out[-3000:]


def test_trust_demo_shows_every_attack_as_a_counted_miss(tmp_path: Path) -> None:
    """demo/trust_demo.py: on two stores sharing a real redis-server, a rewritten value, a value
    forged with valid xxh3 checksums and two swapped values are misses counted ``forged``, never
    promoted; a 16 GiB head claim is ``foreign`` and allocates next to nothing."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    res = subprocess.run([sys.executable, "demo/trust_demo.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    out = res.stdout
    assert re.findall(r"forged (\d+), foreign (\d+)", out) == [("1", "0"), ("2", "0"), ("4", "0"), ("4", "2"),
                                                               ("4", "2")], out
    assert out.count("keys left on the server: 0") == 3 and "promoted into host B's own tiers: 0 of 2" in out
    assert "['miss', 'miss']" in out and "served, bytes identical; hits 1" in out
    peak = re.search(r"peak Python allocation (\d+) KiB", out)
    assert peak and int(peak.group(1)) < 4096, out
    assert not list(tmp_path.iterdir())
