"""The shared selectors on the CLI's side (SPEC section 6): the options, declared once, and
the selector a request carries, built from them. The daemon resolves that selector to
chunk keys (``lmctl/selection.py``).

Nothing here imports the store library: a document is read here but tokenized by the daemon.

A cache salt is a secret: besides ``--cache-salt`` (which ``ps`` and the shell's history
see) it can come from a file (``--cache-salt-file``) or from ``$LMCTL_CACHE_SALT``, which
applies to documents when no option gives one.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from .completion import complete_values
from .terminal import CommandError, Terminal, human
from .units import parse_duration

#: the environment variable that holds a cache salt for documents
SALT_ENV = "LMCTL_CACHE_SALT"
KEY_DIGITS = 96
#: the fewest hex digits a short key may have (git's rule)
SHORT_KEY_DIGITS = 4
_HEX = re.compile(r"[0-9a-fA-F]+")


def _complete_names(kind: str) -> Callable[[str], list[str]]:
    """Shell completion of label, adapter and model names, asked of the daemon."""
    def complete(incomplete: str) -> list[str]:
        from .client import Client, default_socket

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
            "--key", help="a chunk key (96 hex digits), or a unique start of one's chunk hash as the tables show "
                          "it (at least 4 digits); repeatable", rich_help_panel="Selectors")]),
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
            help="dram or nvme (chunks in the remote tier are found by document or whole key)",
            autocompletion=complete_values("--tier"), rich_help_panel="Selectors")]),
        ("older_than", None, Annotated[str | None, typer.Option(
            help="not used for this long: 90s, 30m, 12h, 7d, 1h30m (a unit is required)",
            rich_help_panel="Selectors")]),
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
            help="tokenizer folder, or a model id in the daemon's local cache [default: the one the engine recorded]",
            rich_help_panel="Documents")]),
        ("salt", None, Annotated[str | None, typer.Option(
            "--cache-salt", help=f"the requests' cache_salt (a secret: prefer --cache-salt-file or ${SALT_ENV})",
            rich_help_panel="Documents")]),
        ("salt_file", None, Annotated[str | None, typer.Option(
            "--cache-salt-file", help="a file that holds the cache salt (its first line)",
            rich_help_panel="Documents")]),
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


def tokenizer_spec(t: str) -> str:
    """``--tokenizer``: a folder (a path that starts with ``/``, ``./``, ``../`` or ``~``, or
    a folder that is here) is sent to the daemon as an absolute path, as ``--adapter``'s
    folder is, so it means what it means in the caller's folder; anything else is a model id
    (``org/name``) that the daemon looks up in its local Hugging Face cache only."""
    path = os.path.expanduser(t)
    looks_local = t in (".", "..") or t.startswith(("/", "./", "../", "~"))
    if os.path.isdir(path):
        return os.path.abspath(path)
    if looks_local:
        raise CommandError("usage", f"--tokenizer {t}: no such tokenizer folder (give the folder that holds "
                                    "tokenizer.json, a model id in the daemon's local cache, or --tokens FILE)")
    return t


def _folder_digest(path: str) -> str:
    """An adapter folder's digest, computed here with the caller's own rights (the daemon
    reads no folder for another user: it gets the digest)."""
    if not os.path.isdir(path):
        raise CommandError("usage", f"--adapter {path}: no such folder (give NAME, NAME@DIGEST or the adapter's "
                                    "folder)")
    from store import StoreError

    from .errors import UsageError
    from .selection import bounded_adapter_digest

    try:
        return bounded_adapter_digest(path)
    except (StoreError, UsageError) as exc:
        raise CommandError("usage", str(exc)) from None


def check_key(text: str) -> str:
    """A ``--key`` as the daemon takes it: 96 hex digits, or the start of a chunk hash (the
    daemon resolves it to the one stored chunk it names)."""
    k = text.strip().removesuffix("…")  # as the tables show it, pasted with its ellipsis
    if not _HEX.fullmatch(k):
        raise CommandError("usage", f"chunk key {k!r} is not hex: a chunk key is {KEY_DIGITS} hex digits (or the "
                                    "start of its chunk hash, as the tables show it)")
    if len(k) > KEY_DIGITS:
        raise CommandError("usage", f"chunk key {k[:16]}… is too long: a chunk key is {KEY_DIGITS} hex digits, this "
                                    f"has {len(k)}")
    if len(k) < SHORT_KEY_DIGITS:
        raise CommandError("usage", f"chunk key {k!r} is too short: a chunk key is {KEY_DIGITS} hex digits, this "
                                    f"has {len(k)} (a short key needs {SHORT_KEY_DIGITS} digits of the chunk hash)")
    return k.lower()


def cache_salt(v: dict[str, Any], document: bool) -> str | None:
    """The cache salt of a request: ``--cache-salt``, else the first line of
    ``--cache-salt-file``, else (for a document) ``$LMCTL_CACHE_SALT``."""
    if v.get("salt") is not None and v.get("salt_file") is not None:
        raise CommandError("usage", "--cache-salt and --cache-salt-file contradict each other: give one")
    if v.get("salt_file") is not None:
        lines = _read(v["salt_file"], "--cache-salt-file").splitlines()
        if not lines or not lines[0]:
            raise CommandError("usage", f"--cache-salt-file {v['salt_file']} is empty: its first line is the salt")
        return lines[0]
    if v.get("salt") is not None:
        return str(v["salt"])
    return (os.environ.get(SALT_ENV) or None) if document else None


def _check_size(doc: dict[str, Any], what: str) -> None:
    """A document that cannot travel in one request is a usage error that says so, not the
    protocol's message."""
    from .protocol import MAX_FRAME

    size = len(json.dumps(doc, ensure_ascii=False).encode())
    room = MAX_FRAME - (64 << 10)  # the rest of the request
    if size > room:
        hint = ("split it" if "tokens" in doc else
                "send the part the engine is given (no model's context is this long), or its token ids with "
                "--tokens FILE")
        raise CommandError("usage", f"{what} is {human(size)}, over the {human(room)} one request to the daemon "
                                    f"carries: {hint}")


def build_selector(v: dict[str, Any]) -> dict[str, Any]:
    """The selector of a request from the options' values (a document read from its file)."""
    out: dict[str, Any] = {}
    if v.get("key"):
        out["keys"] = [check_key(k) for k in v["key"]]
    labels = v.get("label") or []
    if len(labels) > 1:
        raise CommandError("usage", f"give one --label, not {len(labels)} ({', '.join(labels)})")
    if labels:
        out["label"] = labels[0]
    for k in ("model", "tier"):
        if v.get(k) is not None:
            out[k] = v[k]
    if v.get("tokenizer") is not None:
        out["tokenizer"] = tokenizer_spec(v["tokenizer"])
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
            out["older_than"] = parse_duration(v["older_than"], unit_required=True)
        except ValueError as exc:
            raise CommandError("usage", f"--older-than: {exc}") from None
    docs = [k for k in ("text", "file", "tokens", "messages") if v.get(k) is not None]
    if len(docs) > 1:
        raise CommandError("usage", "give one document: --text, --file, --tokens or --messages")
    salt = cache_salt(v, bool(docs))
    if salt is not None:
        out["salt"] = salt
    if docs:
        kind = docs[0]
        if kind == "text":
            out["doc"] = {"text": v["text"]}
            what = "the --text document"
        elif kind == "file":
            out["doc"] = {"text": _read(v["file"], "document")}
            what = f"document {v['file']}"
        else:
            raw = _read(v[kind], "--" + kind)
            try:
                out["doc"] = {kind: json.loads(raw)}
            except ValueError:
                raise CommandError("usage", f"--{kind} {v[kind]} is not valid JSON") from None
            what = f"--{kind} {v[kind]}"
        _check_size(out["doc"], what)
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
