"""``lmctl lookup --router URL``: ask a router's KV index which instances hold a document.

The router is Dynamo's KV indexer (``python -m dynamo.indexer``, or a Dynamo router that
serves the same ``POST /query``): given token ids, a model name and an adapter name, it
answers, per instance (worker id), how many leading tokens it holds and where (``gpu``,
``cpu``, ``disk``), from the KV events the engines published, lmctl's connector's among
them. Plain ``urllib``: nothing heavy at the CLI's start-up. The answer is treated as
hostile: anything but the documented shape is one clear error.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .terminal import CommandError

#: the largest answer read from a router
MAX_ANSWER = 4 * 1024 * 1024
TIMEOUT_S = 10.0
TIERS = ("gpu", "cpu", "disk")


def query_url(url: str) -> str:
    """The ``/query`` endpoint of a router given as ``http://host:port`` (a path is kept)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CommandError("usage", f"--router must be the router index's http(s) URL, e.g. http://10.0.0.5:8090, "
                                    f"not {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise CommandError("usage", f"--router {url!r}: the port is not a number from 0 to 65535") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/query"):
        path += "/query"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def ask(url: str, token_ids: list[int], model_name: str, lora_name: str | None,
        timeout: float = TIMEOUT_S) -> dict[str, dict[str, int]]:
    """Per instance, what the router says it holds of ``token_ids``: ``longest_matched``
    and the tokens per tier (``gpu``, ``cpu``, ``disk``). Instances that hold nothing are
    absent. ``CommandError`` (one line) when the router cannot be asked or answers nonsense."""
    target = query_url(url)
    body: dict[str, Any] = {"token_ids": token_ids, "model_name": model_name}
    if lora_name:
        body["lora_name"] = lora_name
    req = urllib.request.Request(target, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the operator's URL, http(s) only
            raw = r.read(MAX_ANSWER + 1)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise CommandError("failed", f"the router at {target} knows no model {model_name!r} (HTTP 404; "
                                         "--router-model names the model as the router knows it)") from None
        raise CommandError("failed", f"the router at {target} answered HTTP {exc.code} ({exc.reason})") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", exc)
        raise CommandError("failed", f"the router at {target} cannot be reached ({why})") from None
    if len(raw) > MAX_ANSWER:
        raise CommandError("failed", f"the router at {target} answered more than {MAX_ANSWER} bytes")
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CommandError("failed", f"the router at {target} did not answer JSON (is it a KV indexer?)") from None
    insts = doc.get("instances") if isinstance(doc, dict) else None
    if not isinstance(insts, dict):
        raise CommandError("failed", f"the router at {target} answered without 'instances' (is it a KV indexer?)")
    out: dict[str, dict[str, int]] = {}
    for wid, v in insts.items():
        if not isinstance(v, dict):
            continue
        row = {k: _count(v.get(k)) for k in ("longest_matched", *TIERS)}
        out[str(wid)[:64]] = row
    return out


def _count(v: Any) -> int:
    return v if type(v) is int and 0 <= v < 2**53 else 0
