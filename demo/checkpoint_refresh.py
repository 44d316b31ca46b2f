"""A checkpoint refresh under the same served model name, on a real model.

SmolLM2-135M-Instruct (checkpoint A) serves a 3k-token document and stores its KV. Then a
"fine-tune refresh" of it (checkpoint B: the same files with the MLP output weights of the
upper layers retrained, here perturbed with seeded noise) is deployed under the same served
name on the same store:

* with the default ``model_fingerprint=auto``, B gets 0 cached tokens and exactly the
  output of B without any cache;
* with ``model_fingerprint=off`` (the behaviour before fingerprints, and vLLM's own prefix
  cache's), B loads A's KV and its output is A's KV's answer, not B's.

    .venv/bin/python demo/checkpoint_refresh.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import demo.engine  # noqa: E402,F401  (sets vLLM's environment before it is imported)
from demo.engine import Engine  # noqa: E402
from demo.models import smollm2  # noqa: E402
from demo.vllm_demo import chat_prompt, document  # noqa: E402

SERVED = "smollm2"
RETRAINED = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(10, 30)]


def refreshed(base: Path, out: Path) -> Path:
    """Checkpoint B: A with the RETRAINED tensors changed (seeded noise of 10% of their scale)."""
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    [weights] = sorted(tmp.glob("*.safetensors"))
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(5)
    for name in RETRAINED:
        w = tensors[name]
        noise = torch.randn(w.shape, generator=gen, dtype=w.dtype)
        tensors[name] = (w + 0.1 * w.abs().mean() * noise).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    tmp.rename(out)
    return out


def run(model: Path, store: Path | None, prompt: str, **connector: Any) -> dict[str, Any]:
    """One engine, one greedy answer: its text, the log-probability of its tokens (which
    tells KV apart even where the greedy text agrees), cached tokens, the fingerprint."""
    from vllm import SamplingParams

    from engine_hook.vllm import live_connectors

    eng = Engine(model, store, max_model_len=4096, lora=False, served_model_name=SERVED, connector=connector)
    try:
        out = eng.llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, logprobs=0), use_tqdm=False)[0]
        eng.flush()
        fps = {c.model_fingerprint for c in live_connectors()}
        return {"text": out.outputs[0].text, "logprob": round(float(out.outputs[0].cumulative_logprob), 4),
                "cached": int(out.num_cached_tokens or 0), "fingerprint": fps.pop() if fps else None}
    finally:
        eng.close()


def main() -> None:
    work = ROOT / ".cache"
    a = smollm2(work / "models" / "smollm2-135m-instruct")
    b = refreshed(a, work / "models" / "smollm2-135m-instruct-refresh-v2")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    prompt = chat_prompt(tok, document(120), "What must the Tenant pay each month?")
    n = len(tok(prompt)["input_ids"])
    results: dict[str, Any] = {"prompt_tokens": n, "retrained_tensors": len(RETRAINED)}
    for mode in ("auto", "off"):
        store = work / f"refresh-store-{mode}"
        shutil.rmtree(store, ignore_errors=True)
        t0 = time.perf_counter()
        results[mode] = {"A": run(a, store, prompt, model_fingerprint=mode),
                         "B": run(b, store, prompt, model_fingerprint=mode)}
        results[mode]["seconds"] = round(time.perf_counter() - t0, 1)
        shutil.rmtree(store, ignore_errors=True)
    ref = results["B without cache"] = run(b, None, prompt)
    for mode in ("auto", "off"):
        mine = results[mode]["B"]
        results[mode]["B equals B without cache"] = (mine["text"], mine["logprob"]) == (ref["text"], ref["logprob"])
    if "--json" in sys.argv:
        print(json.dumps(results, indent=1))
        return
    print(f"{n}-token prompt; checkpoint B = A with {len(RETRAINED)} MLP weights retrained; both served as {SERVED!r}")
    for mode in ("auto", "off"):
        r = results[mode]
        fa, fb = ((r[k]["fingerprint"] or "none")[:12] for k in ("A", "B"))
        same = "equals" if r["B equals B without cache"] else "differs from"
        print(f"model_fingerprint={mode}: A cached {r['A']['cached']} (fingerprint {fa}), then B cached "
              f"{r['B']['cached']} (fingerprint {fb}); B's output {same} B without cache")
        for k in ("A", "B"):
            print(f"    {k}: {r[k]['text']!r} (log-probability {r[k]['logprob']})")
    print(f"B without cache: {ref['text']!r} (log-probability {ref['logprob']})")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
