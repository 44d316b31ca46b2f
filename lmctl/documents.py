"""Documents to token ids, exactly as vLLM tokenizes them (runs in the daemon).

* text: ``tokenizer(text)`` with special tokens, as vLLM does for a completion prompt;
* messages: the model's chat template rendered to text with the generation prompt, then
  tokenized without adding special tokens (the template has them), as vLLM does for a
  chat completion.

The tokenizer is the one the engine hook recorded for the model (or ``--tokenizer``).
Tokenizers are loaded once and kept. ``transformers`` is imported here only, never by
the CLI process.
"""

from __future__ import annotations

import threading
from typing import Any

from store import StoreError

_lock = threading.Lock()
_cache: dict[tuple[str, str | None], Any] = {}


def load_tokenizer(source: str, revision: str | None = None) -> Any:
    key = (source, revision)
    with _lock:
        tok = _cache.get(key)
    if tok is not None:
        return tok
    try:
        from transformers import AutoTokenizer
    except ImportError:  # pragma: no cover - transformers comes with vLLM
        raise StoreError("turning text into tokens needs the 'transformers' package in the daemon's "
                         "environment; pass --tokens FILE instead") from None
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=revision)
    except Exception as exc:
        raise StoreError(f"cannot load the tokenizer {source!r}: {exc}") from None
    with _lock:
        _cache[key] = tok
    return tok


def tokenize(doc: dict[str, Any], source: str, revision: str | None = None) -> list[int]:
    """Token ids of a document: ``{"tokens": [...]}``, ``{"text": str}`` or ``{"messages": [...]}``."""
    if "tokens" in doc:
        toks = doc["tokens"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in toks):
            raise StoreError("--tokens must be a JSON list of token ids (integers)")
        return toks
    tok = load_tokenizer(source, revision)
    if "text" in doc:
        return list(tok(str(doc["text"]))["input_ids"])
    if "messages" in doc:
        msgs = doc["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise StoreError("--messages must be a JSON list of {\"role\": ..., \"content\": ...} objects")
        if not getattr(tok, "chat_template", None):
            raise StoreError(f"the tokenizer {source!r} has no chat template; use --text")
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    raise StoreError("a document needs --text, --file, --tokens or --messages")
