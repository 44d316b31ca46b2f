"""Documents to token ids, exactly as vLLM tokenizes them (runs in the daemon).

* text: ``tokenizer(text)`` with special tokens, as vLLM does for a completion prompt;
* messages: the model's chat template rendered to text with the generation prompt, then
  tokenized without adding special tokens (the template has them), as vLLM does for a
  chat completion.

The tokenizer is the one the engine hook recorded for the model (or ``--tokenizer``), from
local files only (a folder, or the local Hugging Face cache): nothing is downloaded.
Tokenizers are loaded once and kept. ``transformers`` is imported here only, never by
the CLI process.
"""

from __future__ import annotations

import threading
from typing import Any

from store import StoreError

from .errors import UsageError

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
        # local files only: a daemon never reaches the network because of a CLI flag, and a
        # typo fails at once instead of after a hub lookup that cannot succeed
        tok = AutoTokenizer.from_pretrained(source, revision=revision, local_files_only=True)
    except OSError:
        raise UsageError(f"no tokenizer {source!r} on this machine: it is neither a tokenizer folder nor a model "
                         "in the daemon's local Hugging Face cache (the daemon downloads nothing); give its "
                         "folder with --tokenizer PATH, or the token ids with --tokens FILE") from None
    except Exception as exc:
        raise StoreError(f"cannot load the tokenizer {source!r}: {' '.join(str(exc).split())}") from None
    with _lock:
        _cache[key] = tok
    return tok


def check_document(doc: dict[str, Any]) -> None:
    """Refuse a malformed document (a usage error) before any tokenizer is loaded."""
    if "tokens" in doc:
        toks = doc["tokens"]
        if not isinstance(toks, list) or not toks or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in toks):
            raise UsageError("--tokens must be a non-empty JSON list of token ids (integers in [0, 2**32))")
    elif "messages" in doc:
        msgs = doc["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            raise UsageError("--messages must be a non-empty JSON list of {\"role\": ..., \"content\": ...} objects")
    elif "text" in doc:
        if not isinstance(doc["text"], str) or not doc["text"]:
            raise UsageError("the document is empty; give --text, --file, --tokens or --messages with content")
    else:
        raise UsageError("a document needs --text, --file, --tokens or --messages")


def tokenize(doc: dict[str, Any], source: str, revision: str | None = None) -> list[int]:
    """Token ids of a document: ``{"tokens": [...]}``, ``{"text": str}`` or ``{"messages": [...]}``."""
    check_document(doc)
    if "tokens" in doc:
        return list(doc["tokens"])
    tok = load_tokenizer(source, revision)
    if "text" in doc:
        return list(tok(str(doc["text"]))["input_ids"])
    if "messages" in doc:
        msgs = doc["messages"]
        if not getattr(tok, "chat_template", None):
            raise UsageError(f"the tokenizer {source!r} has no chat template; use --text")
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that rejects these messages (roles, order)
            raise UsageError(f"the model's chat template rejects these messages: {exc}") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])
    raise StoreError("a document needs --text, --file, --tokens or --messages")
