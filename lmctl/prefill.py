"""``warm --endpoint``: prefill a document through the engine's OpenAI-compatible server, so
the engine computes and stores the chunks the store lacks.

The document is sent once (one output token); the engine's lmctl connector saves its KV
in the background, so the document is then looked up until those saves have landed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .terminal import CommandError, Terminal


def endpoint_base(url: str) -> str:
    """The server's root from ``--endpoint``: ``http://host:port``, with or without ``/v1``."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        _ = u.port
    except ValueError:
        u = None  # type: ignore[assignment]
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise CommandError("usage", f"--endpoint {url!r} is not a URL like http://host:8000 (the engine's "
                                    "OpenAI-compatible server)")
    path = u.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{u.scheme}://{u.netloc}{path}"


def prefill(term: Terminal, sel: dict[str, Any], endpoint: str, dry_run: bool) -> dict[str, Any]:
    """Prefill the selected document through ``endpoint`` unless the store holds all of it
    (or ``dry_run``); the hit tokens before and after. Names the store's one model in
    ``sel`` when it names none."""
    base = endpoint_base(endpoint)
    if "doc" not in sel:
        raise CommandError("usage", "--endpoint needs a document (--text, --file, --tokens or --messages)")
    known = term.call("names")["models"]
    if sel.get("model") is None:
        if len(known) != 1:
            raise CommandError("usage", "give --model: the name the engine serves the model under")
        sel["model"] = known[0]
    if sel["model"] in known:
        before = term.call("lookup", sel)  # also checks the document before anything is sent
    else:  # an engine that has not recorded the model yet: the prefill makes it do so
        before = {"hit_tokens": 0, "total_tokens": 0, "first_miss": 0}
    after = before
    if not dry_run and before.get("first_miss") is not None:
        send(base, sel)
        after = settled_lookup(term, sel)
    return {"endpoint": base, "hit_tokens_before": before["hit_tokens"], "hit_tokens_after": after["hit_tokens"],
            "total_tokens": after["total_tokens"]}


def settled_lookup(term: Terminal, sel: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
    """Look the document up until the engine's background saves have landed: every full
    chunk cached, or no change for a second, or ``timeout``."""
    end = time.monotonic() + timeout
    last, still_since = -1, time.monotonic()
    while True:
        r = term.call("lookup", sel)
        full = r["total_tokens"] // r["chunk_size"] * r["chunk_size"] if r.get("chunk_size") else 0
        if r["hit_tokens"] != last:
            last, still_since = r["hit_tokens"], time.monotonic()
        if r["hit_tokens"] >= full or time.monotonic() - still_since > 1.0 or time.monotonic() > end:
            return r
        time.sleep(0.1)


def send(endpoint: str, sel: dict[str, Any]) -> None:
    """Send the document once through the engine (one output token) so it stores the KV."""
    import urllib.error
    import urllib.request

    doc = sel["doc"]
    body: dict[str, Any] = {"model": sel.get("model"), "max_tokens": 1, "temperature": 0}
    if "messages" in doc:
        url, body["messages"] = endpoint + "/v1/chat/completions", doc["messages"]
    elif "tokens" in doc:
        url, body["prompt"] = endpoint + "/v1/completions", doc["tokens"]
    else:
        url, body["prompt"] = endpoint + "/v1/completions", doc["text"]
    if sel.get("adapter") and os.sep not in sel["adapter"]:
        # vLLM serves a LoRA adapter under its name (NAME@DIGEST: the name; the digest is
        # checked when the chunks are looked up)
        body["model"] = sel["adapter"].partition("@")[0]
    if sel.get("salt"):
        body["cache_salt"] = sel["salt"]
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CommandError("failed", f"prefill through {url} failed: {exc}") from None
