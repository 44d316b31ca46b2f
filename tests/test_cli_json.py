"""Every command's --json output has exactly the keys docs/cli.md shows for it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from conftest import ROOT, fake_engine
from test_daemon import OTHER, TOKENS, Daemon, cj, cli, fill, tokens_file

#: objects keyed by data (tier names, labels, layouts), not by a fixed set of fields
MAPS = {"tiers", "store.tiers", "settings.tiers", "labels", "queues", "chunk.layout", "chunks[].layout",
        "evicts", "left.reasons",
        *(f"counters.{name}" for name in ("evictions_total", "corrupt_total", "saves_dropped_total", "pins_total",
                                          "unpins_total", "remote_copies_total", "announced_total"))}


#: documented JSON that another test checks (it needs a redis-server)
ELSEWHERE = {"drain": "tests/test_drain.py::test_drain_json_has_the_documented_keys"}


def documented() -> dict[str, Any]:
    text = (ROOT / "docs" / "cli.md").read_text()
    out = {}
    for name, body in re.findall(r"<!-- json: ([^>]+?) -->\n```json\n(.*?)```", text, re.S):
        out[name] = json.loads(body)
    return out


def same_keys(doc: Any, got: Any, path: str = "") -> None:
    if path in MAPS:
        assert isinstance(got, dict), path
        if doc and got:
            same_keys(next(iter(doc.values())), next(iter(got.values())), path + ".*")
        return
    if isinstance(doc, dict):
        assert isinstance(got, dict), f"{path}: documented an object, got {got!r}"
        assert set(doc) == set(got), f"{path or 'top'}: keys differ: {sorted(set(doc) ^ set(got))}"
        for k in doc:
            same_keys(doc[k], got[k], f"{path}.{k}" if path else k)
    elif isinstance(doc, list):
        assert isinstance(got, list), path
        if doc and got:
            same_keys(doc[0], got[0], path + "[]")
    elif doc is not None:
        assert not isinstance(got, (dict, list)), f"{path}: documented a value, got {got!r}"


def status_after_a_maintenance_pass(d: Daemon) -> Any:
    """``status`` once the daemon's maintenance has run (every 0.5 s here), so that the
    documented object of its last pass is there to compare."""
    end = time.monotonic() + 30
    while (st := cj(d, "status"))["daemon"]["maintenance"]["last_ok"] is None:
        assert time.monotonic() < end, "no maintenance pass within 30 s"
        time.sleep(0.05)
    return st


def test_json_of_every_command_matches_the_docs(tmp_path: Path) -> None:
    docs = documented()
    fill(tmp_path / "store", dram=True)
    d = Daemon(tmp_path / "store")
    d.start()

    try:
        with fake_engine() as (url, _requests):
            doc = tokens_file(tmp_path, TOKENS + [1, 2, 3])
            key = cj(d, "lookup", "--tokens", doc)["chunks"][0]["key"]
            got = {
                "error": json.loads(cli(d, "--json", "pin", "--tokens", doc).stdout),
                "config": cj(d, "config", "set", "codec_level=1"),
                "config set --dry-run": cj(d, "config", "set", "tiers.nvme.capacity=16MiB", "--dry-run"),
                "status": status_after_a_maintenance_pass(d),
                "lookup": cj(d, "lookup", "--tokens", doc),
                "pin": cj(d, "pin", "--label", "contracts", "--tokens", doc),
                "unpin": cj(d, "unpin", "--label", "contracts", "--key", key, "--dry-run"),
                "evict": cj(d, "evict", "--unpinned", "--dry-run"),
                "move": cj(d, "move", "--to", "dram", "--label", "contracts"),
                "compress": cj(d, "compress", "--label", "contracts"),
                "inspect": cj(d, "inspect"),
                "inspect --key": cj(d, "inspect", "--key", key),
                "ls": cj(d, "ls", "--limit", "1"),
                "warm": cj(d, "warm", "--tokens", doc, "--endpoint", url),
                "pin --export-manifest": cj(d, "pin", "--export-manifest", str(tmp_path / "m.json"), "--label",
                                            "contracts"),
                "warm --manifest": cj(d, "warm", "--manifest", str(tmp_path / "m.json")),
                "verify": cj(d, "verify"),
            }
            full = tokens_file(tmp_path, OTHER, "other.json")  # never pinned
            assert cli(d, "evict", "--key", cj(d, "lookup", "--tokens", full)["chunks"][1]["key"]).returncode == 0
            got["lookup --explain"] = cj(d, "lookup", "--tokens", full, "--explain")
            got["events"] = cj(d, "events")
            got["top"] = cj(d, "top", "--interval", "0.1")
    finally:
        d.stop()
    assert set(got) | set(ELSEWHERE) == set(docs), (
        f"documented JSON without a check, or the reverse: {(set(got) | set(ELSEWHERE)) ^ set(docs)}")
    for name in got:
        same_keys(docs[name], got[name], "")
