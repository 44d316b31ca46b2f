"""The shared test harness (testsupport/): the CLI run in-process answers exactly as the
process does, and nothing outside tests/ imports tests/."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from testsupport.lmctl import ROOT, run, run_process
from testsupport.vllm import server_env


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["frobnicate"],
    ["ls", "--older-than", "soon"],
    ["--json", "ls", "--pinned", "--unpinned"],
    ["status"],
    ["--json", "lookup", "--key", "00" * 48],
])
def test_in_process_and_a_real_process_answer_alike(argv: list[str], tmp_path: Path) -> None:
    """Exit status, stdout and stderr byte for byte, with no daemon on the socket (exit 3) and
    for usage errors and help, so that a test run in-process checks what an operator sees."""
    args = ["--socket", str(tmp_path / "nobody.sock"), *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCTL_")}
    inside, outside = run(*args, env=env), run_process(*args, env=env)
    assert (inside.returncode, inside.stdout, inside.stderr) == (outside.returncode, outside.stdout, outside.stderr)
    assert inside.returncode in (0, 2, 3)


def test_run_gives_the_command_its_environment_and_stdin_and_puts_them_back(tmp_path: Path) -> None:
    sock = tmp_path / "from-env.sock"
    before = dict(os.environ)
    r = run("status", env={"LMCTL_SOCKET": str(sock)})  # nothing else: no HOME, no PATH
    assert r.returncode == 3 and str(sock) in r.stderr
    assert dict(os.environ) == before
    r = run("shell", stdin="frobnicate\n", env={"LMCTL_SOCKET": str(sock), "HOME": str(tmp_path)})
    assert r.returncode == 2 and "frobnicate" in r.stderr


def imports_of_tests(source: str) -> list[str]:
    """Where ``source`` imports tests/ (``import tests``, ``from tests...``) or puts it on its
    path (a ``sys.path`` change naming "tests")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            found.append(f"line {node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names):
            found.append(f"line {node.lineno}: import tests")
        elif (isinstance(node, ast.Call) and "sys.path" in ast.unparse(node.func)
              and any(isinstance(c, ast.Constant) and c.value == "tests" for c in ast.walk(node))):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_finds_an_import_of_tests() -> None:
    planted = ("import sys\nsys.path.insert(0, str(ROOT / 'tests'))\nfrom tests.redis_server import Server\n"
               "import tests.faultfs\nfrom testsupport.redis import Server\n")
    assert sorted(f.split(":")[0] for f in imports_of_tests(planted)) == ["line 2", "line 3", "line 4"]


def test_demo_benchmarks_stress_and_testsupport_never_import_tests() -> None:
    found = {str(p.relative_to(ROOT)): hits for d in ("demo", "benchmarks", "stress", "testsupport")
             for p in sorted((ROOT / d).glob("*.py")) if (hits := imports_of_tests(p.read_text()))}
    assert found == {}


def test_a_vllm_server_logs_at_info_whatever_an_earlier_import_set(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    # benchmarks/seed_workload.py and the demos quieten vLLM for their own output when imported;
    # a server started later in the same process must still log (its metrics test reads the log)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    env = server_env(tmp_path)
    assert env["VLLM_LOGGING_LEVEL"] == "INFO" and env["VLLM_CONFIGURE_LOGGING"] == "1"
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stdout"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and env["TMPDIR"] == str(tmp_path)
    assert server_env(tmp_path, {"VLLM_LOGGING_LEVEL": "DEBUG"})["VLLM_LOGGING_LEVEL"] == "DEBUG"
