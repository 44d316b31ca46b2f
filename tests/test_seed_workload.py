"""benchmarks/seed_workload.py as CI runs it: ``--quick`` end to end (real vLLM engines on the
CPU with SmolLM2-135M and the LoRA adapter ``civil``, a real redis-server, real stores), and
its bad input. Timings are not asserted (a shared CI machine); what lmctl must do is: the
cached tokens of the first requests after a restart and on a second instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import ROOT, env_with_path

SCRIPT = str(ROOT / "benchmarks" / "seed_workload.py")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env_with_path(), capture_output=True,
                          text=True, timeout=timeout)


def _benchmark() -> Any:
    """The benchmark's module, imported here (it quietens vLLM's log for its own run when
    imported: the environment is put back)."""
    saved = dict(os.environ)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import seed_workload
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        os.environ.clear()
        os.environ.update(saved)
    return seed_workload


@pytest.mark.slow
def test_quick_run_caches_the_fixed_prefixes_after_a_restart_and_on_a_second_instance() -> None:
    r = _run("--quick", "--json", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res = json.loads(r.stdout)  # stdout is the JSON alone: vLLM's logs go to stderr
    block, chunk = res["engine"]["block_size"], res["engine"]["chunk_size"]
    assert block == 32 and chunk % block == 0  # read from the running engine and connector
    prefix = res["prefix_tokens"]
    assert 330 <= prefix["planner"] <= 350 and 235 <= prefix["generator"] <= 250
    cases = res["cases"]
    for case in ("restart", "second_instance"):
        for kind in ("planner", "generator"):
            c = cases[case][kind]
            # vLLM alone on a fresh engine has nothing; lmctl serves every whole block of the
            # fixed prefix (at 32-token blocks: 320 of the planner's 350, 224 of the generator's
            # 250), not only whole 256-token chunks
            assert c["vllm"]["cached_tokens"] == 0, (case, kind, c)
            floor = prefix[kind] // block * block
            assert floor <= c["lmctl"]["cached_tokens"] < c["lmctl"]["prompt_tokens"], (case, kind, c)
            assert c["lmctl"]["prompt_tokens"] == res["prompt_tokens"][kind] > prefix[kind]
            assert c["ratio"]["median"] > 0 and isinstance(c["met"], bool)
            if c["lmctl"]["cached_tokens"] <= c["vllm"]["cached_tokens"]:
                assert not c["met"]  # a gain without a token from lmctl is not lmctl's
        assert cases[case]["planner"]["lmctl"]["cached_tokens"] > 0  # the planner's prefix is over a chunk
    rnd = res["per_round"][0]
    assert rnd["order"] == ["vllm", "restart", "second"]
    assert rnd["restart"]["connector"]["loaded_chunks"] >= 1  # from the local disk
    assert rnd["second"]["connector"]["loaded_chunks"] >= 1   # from Redis: its own store started empty
    assert rnd["restart"]["connector"]["failed_loads"] == rnd["second"]["connector"]["failed_loads"] == 0
    steady = cases["steady"]
    assert res["steady_bursts"] == res["rounds"] * res["pipelines_per_user"]
    for side in ("vllm", "lmctl"):  # each burst: a planner and a generator request per user
        assert steady[side]["requests"]["all"] == [res["users"] * 2] * res["steady_bursts"]
        assert steady[side]["cached_fraction"]["median"] > 0.4  # vLLM's own prefix cache serves the prefixes
    assert steady["ratio"]["median"] > 0 and steady["throughput_ratio"] > 0
    assert steady["met"] == (steady["throughput_ratio"] >= 0.97)

    text = _benchmark().table(res)
    assert "(a) after a restart" in text and "(b) second instance" in text and "(c) 4 users, steady" in text
    assert f"lmctl chunk {chunk} tokens" in text


def test_bad_arguments_are_one_line_and_exit_2() -> None:
    for args, says in ((["--set", "chunk_sise=128"], "unknown lmctl connector setting(s) chunk_sise"),
                       (["--set", "chunk_size"], "write KEY=VALUE"),
                       (["--set", "remote_url=redis://127.0.0.1:1/0"], "chooses store_path and the remote_*"),
                       (["--rounds", "0"], "at least 1"),
                       (["--untimed-bursts", "-1"], "--untimed-bursts at least 0"),
                       (["--block-size", "16"], "a power of two from 32 up"),
                       (["--block-size", "48"], "a power of two from 32 up")):
        r = _run(*args, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert says in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr, (args, r.stderr)
        assert r.stdout == ""


def test_a_default_run_has_enough_questions_that_start_differently() -> None:
    """A default run asks about 270 planner and 270 generator questions; no two may share the
    block that holds their start, or a cache could serve a question (the old questions ran out
    of distinct starts after about 315)."""
    sw = _benchmark()
    from transformers import AutoTokenizer

    from demo.models import smollm2

    tok = AutoTokenizer.from_pretrained(smollm2(ROOT / ".cache" / "models" / "smollm2-135m-instruct"))
    planner_sys, planner_fixed = sw.fixed_prefix(tok, sw.PLANNER_RULES, sw.PLANNER_TOKENS)
    generator_sys, generator_fixed = sw.fixed_prefix(tok, sw.GENERATOR_RULES, sw.GENERATOR_TOKENS)
    seen: set[tuple[int, ...]] = set()
    kinds = [(sw.Questions(tok, planner_sys, planner_fixed, seen, 1000), planner_fixed),
             (sw.Questions(tok, generator_sys, generator_fixed, seen, 1 << 20), generator_fixed)]
    heads = []
    for _ in range(400):
        for q, fixed in kinds:
            ids = q.next()
            assert len(ids) == fixed + sw.QUESTION_TOKENS
            heads.append(tuple(ids[fixed : fixed + sw.UNIQUE_HEAD]))
    # the first block boundary after either fixed part falls UNIQUE_HEAD (4) or more tokens into
    # the question (at 16- and 32-token blocks), so distinct heads mean distinct blocks
    assert sw.UNIQUE_HEAD == 4 and len(set(heads)) == len(heads) == 800
    for fixed in (planner_fixed, generator_fixed):
        for block in (16, 32):
            assert not 0 < sw.head_in_block(fixed, block) < sw.UNIQUE_HEAD
