"""Does a load stall the other requests? A stream's largest gap while a cached request loads.

    .venv/bin/python benchmarks/stall.py [--rounds 2] [--prefix 4096] [--json]

On vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``, CPU, SmolLM2-135M-Instruct
float32, vLLM's prefix cache off), request A streams 300 tokens. After its 100th token,
request B arrives: a 4k-token document whose KV the store holds, plus a 2-token question.
The figure is the largest gap between A's tokens from B's arrival until B's answer, over the
median gap of A before B arrived. B's own first step (2 new tokens over 4k tokens of
context, batched with A's) is unavoidable and measures about 1.8; a load inside the
step loop adds the whole load to one gap. Goal: <= 3.

Rounds alternate a server with the connector (B loads its document) and one without
(B computes it) so both meet the same machine; each round starts a fresh server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from demo.models import smollm2  # noqa: E402
from testsupport.vllm import VllmServer  # noqa: E402

ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}



class Server(VllmServer):
    """``vllm serve`` (testsupport's launcher) as the benchmark runs it: served as "m", seed 0,
    offline; ready when it returns."""

    def __init__(self, model: Path, store: Path | None, work: Path, max_len: int) -> None:
        super().__init__(model, store, work, max_len=max_len, args=["--served-model-name", "m", "--seed", "0"],
                         env=ENV)
        self.wait_ready(300)

    def complete(self, prompt: list[int], max_tokens: int, stream: bool = False,
                 on_token: Any = None) -> list[float]:
        """POST /v1/completions; with ``stream``, the arrival time of every token event."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        times: list[float] = []
        if not stream:
            r.read()
            return times
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
        return times


def wait_for_chunks(store: Path, want: int, timeout: float = 120) -> None:
    """Until the store holds ``want`` chunks (the server's saves are written in the background)."""
    from store import Store

    end = time.time() + timeout
    while time.time() < end:
        with Store(store, readonly=True) as s:
            if s.stats().tiers["nvme"].chunks >= want:
                return
        time.sleep(0.5)
    raise RuntimeError("the document's chunks did not reach the store")


def one_round(model: Path, work: Path, with_store: bool, prefix: list[int], stream_prompt: list[int],
              question: list[int], stream_tokens: int, arrive_after: int) -> dict[str, Any]:
    store = work / "store" if with_store else None
    if store is not None:
        shutil.rmtree(store, ignore_errors=True)
    srv = Server(model, store, work, len(prefix) + 64)
    try:
        srv.complete(stream_prompt[:32], 4)  # warm up
        if store is not None:
            srv.complete(prefix + [13, 13], 1)  # the document, asked once before: its KV is stored
            wait_for_chunks(store, len(prefix) // 256)
        arrived = threading.Event()
        b: dict[str, float] = {}

        def ask() -> None:
            assert arrived.wait(600)
            b["sent"] = time.perf_counter()
            srv.complete(prefix + question, 1)
            b["done"] = time.perf_counter()

        asker = threading.Thread(target=ask)
        asker.start()
        times = srv.complete(stream_prompt, stream_tokens, stream=True,
                             on_token=lambda n: arrived.set() if n == arrive_after else None)
        asker.join()
    finally:
        srv.stop()
    gaps = [(times[i], times[i] - times[i - 1]) for i in range(1, len(times))]
    before = [g for t, g in gaps if t < b["sent"]]
    during = [g for t, g in gaps if b["sent"] < t <= b["done"] + max(before)]
    base = statistics.median(before)
    worst = max(during) if during else 0.0
    return {"median_gap_s": round(base, 4), "largest_gap_while_b_s": round(worst, 4),
            "stall_ratio": round(worst / base, 2), "b_latency_s": round(b["done"] - b["sent"], 3),
            "tokens_streamed": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode (A B A B)")
    ap.add_argument("--prefix", type=int, default=4096, help="tokens of B's cached document")
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--work", default=str(ROOT / ".cache"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = smollm2(Path(args.work) / "models" / "smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from ttft import text_tokens

    prefix = text_tokens(tok, args.prefix, 4242)
    stream_prompt = text_tokens(tok, 64, 77)
    question = tok(" Why?")["input_ids"][:2]
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="lmctl-stall-", dir=args.work))
    runs: dict[str, list[dict[str, Any]]] = {"lmctl": [], "no_connector": []}
    try:
        for _ in range(args.rounds):
            for mode in ("lmctl", "no_connector"):
                runs[mode].append(one_round(model, work, mode == "lmctl", prefix, stream_prompt, question,
                                            args.stream_tokens, 100))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"prefix_tokens": args.prefix, "runs": runs, "loadavg_start": load_start,
                              "loadavg_end": os.getloadavg()}
    for mode, rs in runs.items():
        ratios = [r["stall_ratio"] for r in rs]
        result[mode] = {"stall_ratio_median": statistics.median(ratios),
                        "stall_ratio_range": [min(ratios), max(ratios)],
                        "b_latency_s_median": statistics.median(r["b_latency_s"] for r in rs)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for mode in runs:
        r = result[mode]
        print(f"{mode:<13} stall ratio {r['stall_ratio_median']:.2f} (range {r['stall_ratio_range'][0]:.2f}-"
              f"{r['stall_ratio_range'][1]:.2f}); B answered in {r['b_latency_s_median']:.2f} s")
    print(f"load average {load_start[0]:.2f} -> {result['loadavg_end'][0]:.2f}")


if __name__ == "__main__":
    main()
