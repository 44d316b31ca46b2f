"""The CLI as a user runs it: a real process on a real store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import content, env_with_path

from store import Store


def lmctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmctl.cli", *args], capture_output=True, text=True,
                          env=env_with_path(), timeout=60)


def test_cli_never_imports_torch_or_vllm() -> None:
    code = "import sys, lmctl.cli; bad=[m for m in ('torch','vllm','numpy') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_path())
    assert out.stdout.strip() == "[]"
    r = lmctl("--help")
    assert r.returncode == 0 and "inspect" in r.stdout


def test_inspect_and_verify_a_real_store(tmp_path: Path) -> None:
    with Store(tmp_path / "s") as s:
        k = b"\x02" * 48
        s.put(k, content(k, 10000), {"dtype": "uint8"}, tokens=256)
    r = lmctl("inspect", "--store", str(tmp_path / "s"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tiers"]["nvme"]["chunks"] == 1 and doc["counters"]["puts"] == 1
    r = lmctl("verify", "--store", str(tmp_path / "s"), "--deep")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok")
    # corrupt the payload: verify finds it (exit 1), --fix repairs it (exit 0)
    seg = next((tmp_path / "s" / "nvme").glob("seg-*.lseg"))
    with open(seg, "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\xff\xff")
    r = lmctl("verify", "--store", str(tmp_path / "s"), "--deep", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["problems"][0]["kind"] == "corrupt-chunk"
    r = lmctl("verify", "--store", str(tmp_path / "s"), "--deep", "--fix")
    assert r.returncode == 0
    with Store(tmp_path / "s") as s:
        assert s.stats()["tiers"]["nvme"]["chunks"] == 0


def test_missing_store_is_one_clear_line(tmp_path: Path) -> None:
    r = lmctl("inspect", "--store", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no store at" in r.stderr
    assert not os.path.exists(tmp_path / "nope")  # inspecting never creates a store
    r = lmctl("inspect", "--store", str(tmp_path / "nope"), "--json")
    assert json.loads(r.stdout)["error"]["code"] == 1
