"""The shared selectors on the CLI's side (SPEC section 6): the options, declared once, and
the selector a request carries, built from them. The daemon resolves that selector to
chunk keys (``lmctl/selection.py``).

Nothing here imports the store library: a document is read here but tokenized by the daemon.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from .client import Client, default_socket
from .terminal import CommandError, Terminal
from .units import parse_duration


def _complete_names(kind: str) -> Callable[[str], list[str]]:
    """Shell completion of label, adapter and model names, asked of the daemon."""
    def complete(incomplete: str) -> list[str]:
        try:
            names = Client(default_socket(), timeout=2).call("names")
        except Exception:
            return []
        return [n for n in names.get(kind, []) if n.startswith(incomplete)]

    return complete


SELECTORS: list[inspect.Parameter] = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann)
    for name, default, ann in [
        ("key", None, Annotated[list[str] | None, typer.Option(
            "--key", help="a chunk key (96 hex digits); repeatable", rich_help_panel="Selectors")]),
        ("model", None, Annotated[str | None, typer.Option(
            help="model id as the engine serves it", autocompletion=_complete_names("models"),
            rich_help_panel="Selectors")]),
        ("adapter", None, Annotated[str | None, typer.Option(
            help="LoRA adapter: NAME (newest served), NAME@DIGEST or its folder",
            autocompletion=_complete_names("adapters"), rich_help_panel="Selectors")]),
        ("base", False, Annotated[bool, typer.Option(
            "--base", help="the base model only (no adapter)", rich_help_panel="Selectors")]),
        ("label", None, Annotated[list[str] | None, typer.Option(
            help="chunks pinned under this label (pin/unpin: the pin's label)",
            autocompletion=_complete_names("labels"), rich_help_panel="Selectors")]),
        ("tier", None, Annotated[str | None, typer.Option(
            help="dram, nvme or remote", rich_help_panel="Selectors")]),
        ("older_than", None, Annotated[str | None, typer.Option(
            help="not used for this long (90s, 30m, 12h, 7d)", rich_help_panel="Selectors")]),
        ("pinned", None, Annotated[bool | None, typer.Option(
            "--pinned/--unpinned", help="only pinned / only unpinned chunks", rich_help_panel="Selectors")]),
        ("text", None, Annotated[str | None, typer.Option(
            help="a document given inline", rich_help_panel="Documents")]),
        ("file", None, Annotated[str | None, typer.Option(
            help="a document in a text file ('-' for stdin)", rich_help_panel="Documents")]),
        ("tokens", None, Annotated[str | None, typer.Option(
            help="a JSON file with a list of token ids", rich_help_panel="Documents")]),
        ("messages", None, Annotated[str | None, typer.Option(
            help="a JSON file of chat messages, rendered with the model's chat template",
            rich_help_panel="Documents")]),
        ("tokenizer", None, Annotated[str | None, typer.Option(
            help="tokenizer folder or id [default: the one the engine recorded]", rich_help_panel="Documents")]),
        ("salt", None, Annotated[str | None, typer.Option(
            "--cache-salt", help="the requests' cache_salt", rich_help_panel="Documents")]),
    ]
]
SELECTOR_NAMES = [p.name for p in SELECTORS]


def contradicting_flags(words: list[str]) -> str | None:
    """What contradicts itself on a command line before the parser sees it: of
    ``--pinned/--unpinned``, or of a document option given twice, the parser would keep the
    last one without a word."""
    if "--pinned" in words and "--unpinned" in words:
        return "--pinned and --unpinned contradict each other: give one"
    for flag in ("--text", "--file", "--tokens", "--messages"):  # the parser would keep the last
        n = sum(1 for w in words if w == flag or w.startswith(flag + "="))
        if n > 1:
            return f"{flag} was given {n} times: give one document"
    return None


def _read(path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise CommandError("usage", f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CommandError("usage", f"{what} {path} is not UTF-8 text (a binary file?)") from None


def _names_folder(a: str) -> bool:
    return os.sep in a or a in (".", "..") or a.startswith("~")


def adapter_spec(a: str) -> str:
    """``--adapter``: a name stays a name (even if a folder of that name is here); only a
    path (it has a slash) is a folder, sent to the daemon as an absolute path."""
    return os.path.abspath(os.path.expanduser(a)) if _names_folder(a) else a


def _folder_digest(path: str) -> str:
    """An adapter folder's digest, computed here with the caller's own rights (the daemon
    reads no folder for another user: it gets the digest)."""
    if not os.path.isdir(path):
        raise CommandError("usage", f"--adapter {path}: no such folder (give NAME, NAME@DIGEST or the adapter's "
                                    "folder)")
    from store import StoreError

    from .selection import bounded_adapter_digest

    try:
        return bounded_adapter_digest(path)
    except StoreError as exc:
        raise CommandError("usage", str(exc)) from None


def build_selector(v: dict[str, Any]) -> dict[str, Any]:
    """The selector of a request from the options' values (a document read from its file)."""
    out: dict[str, Any] = {}
    if v.get("key"):
        out["keys"] = list(v["key"])
    labels = v.get("label") or []
    if len(labels) > 1:
        raise CommandError("usage", f"give one --label, not {len(labels)} ({', '.join(labels)})")
    if labels:
        out["label"] = labels[0]
    for k in ("model", "tier", "tokenizer", "salt"):
        if v.get(k) is not None:
            out[k] = v[k]
    if v.get("base") and v.get("adapter") is not None:
        raise CommandError("usage", "--base and --adapter contradict each other: give one")
    if v.get("adapter") is not None:
        out["adapter"] = adapter_spec(v["adapter"])
        if _names_folder(v["adapter"]):
            out["adapter_digest"] = _folder_digest(out["adapter"])
    if v.get("base"):
        out["base"] = True
    if v.get("pinned") is not None:
        out["pinned"] = v["pinned"]
    if v.get("older_than") is not None:
        try:
            out["older_than"] = parse_duration(v["older_than"])
        except ValueError as exc:
            raise CommandError("usage", str(exc)) from None
    docs = [k for k in ("text", "file", "tokens", "messages") if v.get(k) is not None]
    if len(docs) > 1:
        raise CommandError("usage", "give one document: --text, --file, --tokens or --messages")
    if docs:
        kind = docs[0]
        if kind == "text":
            out["doc"] = {"text": v["text"]}
        elif kind == "file":
            out["doc"] = {"text": _read(v["file"], "document")}
        else:
            raw = _read(v[kind], "--" + kind)
            try:
                out["doc"] = {kind: json.loads(raw)}
            except ValueError:
                raise CommandError("usage", f"--{kind} {v[kind]} is not valid JSON") from None
    return out


def with_selectors(fn: Callable[..., None]) -> Callable[..., None]:
    """Add the shared selector options to a command; it receives them as ``sel``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "sel"] + SELECTORS

    @functools.wraps(fn)
    def wrapper(**kw: Any) -> None:
        raw = {k: kw.pop(k) for k in SELECTOR_NAMES}
        sel: dict[str, Any] = {}
        Terminal.of(kw["ctx"]).run(lambda: sel.update(build_selector(raw)))
        fn(sel=sel, **kw)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
