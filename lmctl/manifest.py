"""Manifests: the documents a host or a later deploy should have warm (docs/cli.md, warm).

``lmctl pin --export-manifest FILE`` writes one from a selection's pins (the daemon's
``export`` request; ``lmctl/pinned_documents.py`` keeps what pins were made from) and
``lmctl warm --manifest FILE`` brings every entry's chunks into a local tier, from wherever
they are, prefilling through an engine what no tier has (``--endpoint``).

A manifest is JSON: ``{"version": 1, "documents": [ENTRY, ...]}``, or the list alone. An
entry is one document (``text``, ``messages`` or ``tokens``) with the selectors that place
it (``model``, ``adapter`` as NAME or NAME@DIGEST, ``base``, ``cache_salt``), or, where no
document is known, the chunk ``keys`` themselves; ``label`` names it (and is the pin's label
under ``warm --pin``); ``needs_cache_salt`` marks a document pinned with a cache salt, which
a manifest never holds unless its author writes it in. Validation is strict and done before
any request: the first problem is a usage error naming the entry and the field.

Nothing here imports the store library.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .client import RemoteError
from .prefill import endpoint_base, prefill
from .selectors import SALT_ENV, _read
from .terminal import CommandError, Terminal

MANIFEST_VERSION = 1
DOCUMENT_FIELDS = ("text", "messages", "tokens", "keys")
FIELDS = ("label", "model", "adapter", "base", "cache_salt", "needs_cache_salt", *DOCUMENT_FIELDS)
#: fields a ``keys`` entry may have: its keys name their namespace, salt included
KEYS_FIELDS = ("label", "model", "adapter", "keys")
_KEY_HEX = re.compile(r"[0-9a-fA-F]{96}")


# -- the format -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestEntry:
    """One validated entry of a manifest (``index``: its place in ``documents``)."""

    index: int
    fields: dict[str, Any]

    @property
    def kind(self) -> str:
        return next(k for k in DOCUMENT_FIELDS if k in self.fields)

    @property
    def label(self) -> str | None:
        return self.fields.get("label")

    def request(self, cache_salt: str | None) -> dict[str, Any]:
        """The selector of a request for this entry (``cache_salt``: ``--cache-salt``, for
        entries that need one and do not hold it)."""
        f = self.fields
        if self.kind == "keys":  # model and adapter only describe them
            return {"keys": list(f["keys"])}
        sel: dict[str, Any] = {k: f[k] for k in ("model", "adapter") if k in f}
        if f.get("base"):
            sel["base"] = True
        salt = f.get("cache_salt") or (cache_salt if f.get("needs_cache_salt") else None)
        if salt:
            sel["salt"] = salt
        sel["doc"] = {self.kind: f[self.kind]}
        return sel


class _Bad(Exception):
    """A problem with one field of an entry (its name, and what is wrong)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _string(f: dict[str, Any], name: str, what: str) -> None:
    v = f.get(name)
    if name in f and (not isinstance(v, str) or not v or "\0" in v):
        raise _Bad(name, f"must be {what}")


def _check_entry(f: Any) -> None:
    """Refuse a malformed entry (``_Bad`` names the field)."""
    if not isinstance(f, dict):
        raise _Bad("", f"must be an object with one of {', '.join(DOCUMENT_FIELDS)}, not {type(f).__name__}")
    unknown = sorted(set(f) - set(FIELDS))
    if unknown:
        raise _Bad(unknown[0], f"unknown field (an entry has {', '.join(FIELDS)})")
    docs = [k for k in DOCUMENT_FIELDS if k in f]
    if not docs:
        raise _Bad("", "has no document: give text, messages, tokens or keys")
    if len(docs) > 1:
        raise _Bad("+".join(docs), "an entry has one document: text, messages, tokens or keys, not "
                   + " and ".join(docs))
    if docs[0] == "keys":
        extra = sorted(set(f) - set(KEYS_FIELDS))
        if extra:
            raise _Bad(extra[0], "not in a keys entry (chunk keys already name their namespace and any cache salt)")
    _string(f, "label", "a non-empty string without NUL")
    if "label" in f and len(f["label"]) > 200:
        raise _Bad("label", "must be at most 200 characters")
    _string(f, "model", "a non-empty string (the model id the engine serves)")
    _string(f, "adapter", "a non-empty string: NAME or NAME@DIGEST")
    a = f.get("adapter")
    if a is not None and ("/" in a or os.sep in a or a.startswith("~") or a in (".", "..")):
        raise _Bad("adapter", "must be NAME or NAME@DIGEST: a manifest names no folders")
    if a is not None and "@" in a and (not a.partition("@")[0] or not a.partition("@")[2]):
        raise _Bad("adapter", "must be NAME or NAME@DIGEST")
    for name in ("base", "needs_cache_salt"):
        if name in f and not isinstance(f[name], bool):
            raise _Bad(name, "must be true or false")
    if f.get("base") and a is not None:
        raise _Bad("base", "contradicts adapter: give one")
    _string(f, "cache_salt", "a non-empty string")
    doc = f[docs[0]]
    if docs[0] == "text" and (not isinstance(doc, str) or not doc):
        raise _Bad("text", "must be a non-empty string")
    if docs[0] == "tokens" and (not isinstance(doc, list) or not doc or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in doc)):
        raise _Bad("tokens", "must be a non-empty list of token ids (integers in [0, 2**32))")
    if docs[0] == "messages" and (not isinstance(doc, list) or not doc or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in doc)):
        raise _Bad("messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
    if docs[0] == "keys" and (not isinstance(doc, list) or not doc or not all(
            isinstance(k, str) and _KEY_HEX.fullmatch(k) for k in doc)):
        raise _Bad("keys", "must be a non-empty list of chunk keys (96 hex digits each)")


def parse_manifest(text: str, name: str, cache_salt: str | None = None, need_label: bool = False,
                   salt_given: bool = True) -> list[ManifestEntry]:
    """The entries of the manifest ``text`` (read from ``name``); a usage error names the
    first problem, its entry and field. ``cache_salt`` is ``--cache-salt``: it must be
    given exactly when an entry needs one it does not hold (a salt from the environment,
    ``salt_given`` false, may also go unused). ``need_label``: every document entry must
    have a label (``warm --pin``; an entry of keys without one is warmed, not pinned)."""
    def bad(where: str, message: str) -> CommandError:
        return CommandError("usage", f"manifest {name}: {where}: {message}")

    try:
        top = json.loads(text)
    except ValueError as exc:
        raise CommandError("usage", f"manifest {name} is not valid JSON: {exc}") from None
    if isinstance(top, dict):
        unknown = sorted(set(top) - {"version", "documents"})
        if unknown:
            raise bad(unknown[0], "unknown field (a manifest has version and documents)")
        version = top.get("version", MANIFEST_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise bad("version", "must be a positive integer")
        if version > MANIFEST_VERSION:
            raise bad("version", f"{version} is newer than this lmctl reads ({MANIFEST_VERSION}); upgrade lmctl")
        if "documents" not in top:
            raise bad("documents", "missing (the list of documents)")
        top = top["documents"]
    if not isinstance(top, list):
        raise bad("documents", f"must be a list of entries, not {type(top).__name__}")
    entries = []
    for i, f in enumerate(top):
        try:
            _check_entry(f)
        except _Bad as exc:
            raise bad(f"documents[{i}]" + (f".{exc.field}" if exc.field else ""), str(exc)) from None
        if need_label and "label" not in f and "keys" not in f:  # keys alone: a drain's unpinned chunks
            raise bad(f"documents[{i}].label", "missing: --pin pins each document under its label")
        if f.get("needs_cache_salt") and "cache_salt" not in f and cache_salt is None:
            raise bad(f"documents[{i}].needs_cache_salt", "this document was pinned with a cache salt, which a "
                      "manifest never holds: pass --cache-salt SALT")
        entries.append(ManifestEntry(i, dict(f)))
    if cache_salt is not None and salt_given and not any(
            e.fields.get("needs_cache_salt") and "cache_salt" not in e.fields for e in entries):
        raise CommandError("usage", f"--cache-salt applies to the entries of manifest {name} marked "
                                    "needs_cache_salt, and it has none")
    return entries


def dump_manifest(documents: list[dict[str, Any]]) -> str:
    """A manifest's text: one entry a line, so that it diffs and greps well."""
    lines = ",\n".join(" " + json.dumps(d, ensure_ascii=False) for d in documents)
    return f'{{"version": {MANIFEST_VERSION}, "documents": [\n{lines}\n]}}\n' if documents else \
        f'{{"version": {MANIFEST_VERSION}, "documents": []}}\n'


def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, mode 0600 (a manifest holds the
    pinned documents themselves)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CommandError("failed", f"cannot write manifest {path}: {exc.strerror}") from None


# -- pin --export-manifest -----------------------------------------------------------------
#: selectors that export takes (the rest pick stored chunks, not pins)
EXPORT_SELECTORS = ("label", "model", "adapter", "base")
OPTION = {"keys": "--key", "doc": "a document", "older_than": "--older-than", "salt": "--cache-salt",
          "pinned": "--pinned/--unpinned"}


def _options(keys: list[str]) -> str:
    return ", ".join(OPTION.get(k, "--" + k) for k in sorted(keys))


def export(term: Terminal, sel: dict[str, Any], path: str, dry_run: bool) -> None:
    """``pin --export-manifest``: the manifest of the selection's pins, written to ``path``."""
    other = [k for k in sel if k not in EXPORT_SELECTORS]
    if other:
        raise CommandError("usage", f"pin --export-manifest takes --label, --model, --adapter and --base, not "
                                    f"{_options(other)}")
    r = term.call("export", sel, long=True)
    documents = list(r.get("chunks") or [])  # entries stream as listing rows do
    text = dump_manifest(documents)
    for i, d in enumerate(documents):  # what warm --manifest will read back
        try:
            _check_entry(d)
        except _Bad as exc:
            raise CommandError("failed", f"the daemon exported a bad entry, documents[{i}].{exc.field}: "
                                         f"{exc}") from None
    if path == "-" and not dry_run:
        term.echo(text, end="")
        return
    if not dry_run:
        write_private(path, text)
    out = {"manifest": path, "entries": len(documents),
           "documents": sum(1 for d in documents if "keys" not in d),
           "keys": sum(1 for d in documents if "keys" in d), "chunks": r["pinned"],
           "needs_cache_salt": sum(1 for d in documents if d.get("needs_cache_salt")), "dry_run": dry_run}
    term.emit(out, _show_export)


def _show_export(term: Terminal, r: dict[str, Any]) -> None:
    salted = (f"; {r['needs_cache_salt']} need --cache-salt to be warmed (salts are never exported)"
              if r["needs_cache_salt"] else "")
    keyed = f", {r['keys']} of chunk keys (pinned without a document lmctl recorded)" if r["keys"] else ""
    term.say(f"{'would write' if r['dry_run'] else 'wrote'} {r['manifest']}: {r['documents']} "
             f"document(s){keyed}, {r['chunks']} pinned chunk(s){salted}")


# -- warm --manifest ---------------------------------------------------------------------------
def not_warmed(term: Terminal, r: dict[str, Any], allow: bool, estimate: bool) -> bool:
    """Whether a warm left selected chunks cold (in no tier, or unchecked: the remote tier did
    not answer) and that fails the command: it says so on stderr (a person's output) and the
    caller exits 1, unless ``allow`` (--allow-missing). ``estimate``: a dry run with a prefill
    to come, which may store what is missing now: never a failure."""
    cold = r["missing"] + r["unchecked"]
    if not cold or allow or estimate:
        return False
    if not term.json:
        why = " and ".join(x for x in (f"{r['missing']} in no tier" if r["missing"] else "",
                                       f"{r['unchecked']} not checked (the remote tier did not answer)"
                                       if r["unchecked"] else "") if x)
        print(f"lmctl: {cold} selected chunk(s) {'would not be' if r['dry_run'] else 'were not'} warmed ({why}); "
              "exit 1 (--allow-missing accepts that)", file=term.err)
    return True


ROW_COUNTS = ("chunks", "found", "moved", "fetched", "already", "prefilled", "missing", "unchecked", "bytes",
              "in_tier")


def _target(term: Terminal, to: str | None) -> str:
    """``--to``, else dram where the store has it, else its default tier."""
    if to is not None:
        return to
    settings = term.call("config")["settings"]
    return "dram" if "dram" in settings["tiers"] else str(settings["default_tier"])


@contextmanager
def _progress(term: Terminal) -> Iterator[Callable[[int, int, str], None]]:
    if term.json:
        yield lambda done, total, what: None
    else:
        with term.progress() as update:
            yield update


def warm_manifest(term: Terminal, path: str, sel: dict[str, Any], to: str | None, endpoint: str | None,
                  pin: bool, dry_run: bool, allow_missing: bool = False) -> bool:
    """``warm --manifest``: warm every entry; an entry that fails is reported and the others
    still run. Whether every entry succeeded and (unless ``allow_missing``) every chunk was
    warmed: none is missing, or unchecked because the remote tier did not answer."""
    other = [k for k in sel if k != "salt"]
    if other:
        raise CommandError("usage", f"--manifest takes its selectors from the manifest: drop {_options(other)}")
    salt = sel.get("salt") or os.environ.get(SALT_ENV) or None  # --cache-salt(-file), else the environment's
    entries = parse_manifest(_read(path, "manifest"), path, salt, need_label=pin, salt_given="salt" in sel)
    base = endpoint_base(endpoint) if endpoint else None
    tier = _target(term, to)
    rows: list[dict[str, Any]] = []
    n = len(entries)
    with _progress(term) as update:
        for e in entries:
            name = e.label or f"documents[{e.index}]"

            def step(done: int, total: int, what: str, i: int = e.index, name: str = name) -> None:
                update(i, n, f"{i + 1}/{n} {name}: {what} {done}/{total}")

            step(0, 0, "warming")
            rows.append(_warm_entry(term, e, salt, tier, base, pin, dry_run, step))
        if not dry_run:  # what is in the tier at the end: a later entry may have pushed out an earlier one's
            for e, row in zip(entries, rows, strict=True):
                if row["error"] is None:
                    update(e.index, n, f"{e.index + 1}/{n}: counting what stayed in {tier}")
                    row["in_tier"] = _in_tier_now(term, e, salt, tier, row["in_tier"])
        update(n, n, "done")
    out: dict[str, Any] = {"manifest": path, "to": tier, "dry_run": dry_run, "entries": rows}
    for k in ROW_COUNTS:
        out[k] = sum(r[k] for r in rows)
    out["failed"] = sum(1 for r in rows if r["error"] is not None)
    term.emit(out, _show_warm_manifest)
    cold = not_warmed(term, out, allow_missing, estimate=dry_run and endpoint is not None)
    return out["failed"] == 0 and not cold


def _in_tier_now(term: Terminal, e: ManifestEntry, cache_salt: str | None, tier: str, before: int) -> int:
    """How many of an entry's chunks are in ``tier`` now: those a dry-run warm would find
    there already (``before``, what its warm reported, if that cannot be asked)."""
    try:
        return int(term.call("warm", {**e.request(cache_salt), "to": tier, "dry_run": True})["skipped"])
    except (RemoteError, CommandError):
        return before


def _warm_entry(term: Terminal, e: ManifestEntry, cache_salt: str | None, tier: str, endpoint: str | None, pin: bool,
                dry_run: bool, progress: Callable[[int, int, str], None]) -> dict[str, Any]:
    """Warm one entry: its report row (``error`` set when it failed)."""
    f = e.fields
    row: dict[str, Any] = {"index": e.index, "label": e.label, "model": f.get("model"), "adapter": f.get("adapter"),
                           "document": e.kind, **dict.fromkeys(ROW_COUNTS, 0), "pinned": None, "error": None}
    sel = e.request(cache_salt)
    try:
        found_before = None
        if endpoint is not None and e.kind != "keys":
            # what a tier holds before the prefill; a model no engine recorded yet holds nothing
            if sel.get("model") is not None and sel["model"] not in term.call("names")["models"]:
                found_before, missing = 0, 1
            else:
                before = term.call("warm", {**sel, "to": tier, "dry_run": True})
                found_before, missing = before["chunks"] + before["skipped"], before["missing"]
            if missing:
                prefill(term, sel, endpoint, dry_run)
        r = term.call("warm", {**sel, "to": tier, "dry_run": dry_run}, progress=progress)
        found = r["chunks"] + r["skipped"]
        row.update(chunks=found + r["missing"] + r["unchecked"], found=found if found_before is None else found_before,
                   moved=r["chunks"], fetched=r["fetched"], already=r["skipped"], missing=r["missing"],
                   unchecked=r["unchecked"], in_tier=r["in_tier"] or 0,
                   prefilled=0 if found_before is None else max(0, found - found_before), bytes=r["bytes"])
        if pin and e.label is not None:
            row["pinned"] = term.call("pin", {**sel, "label": e.label, "dry_run": dry_run})["added"]
    except (RemoteError, CommandError) as exc:
        row["error"] = {"code": exc.code, "message": " ".join(str(exc).split())}
    return row


def _show_warm_manifest(term: Terminal, r: dict[str, Any]) -> None:
    from .terminal import human, printable

    rows = [[str(x["index"]), x["label"] or "-", x["document"], str(x["chunks"]), str(x["found"]), str(x["moved"]),
             str(x["fetched"]), str(x["prefilled"]), str(x["missing"]),
             "failed" if x["error"] else "ok" if not x["missing"] + x["unchecked"] else "partial"]
            for x in r["entries"]]
    term.table(None, ["entry", "label", "document", "chunks", "found", "moved", "from remote", "prefilled", "missing",
                      "status"], rows, {"chunks", "found", "moved", "from remote", "prefilled", "missing"})

    def entries(n: int) -> str:
        return f"{n} entr{'y' if n == 1 else 'ies'}"

    term.say(f"{'would warm' if r['dry_run'] else 'warmed'} {entries(len(r['entries']))} into {r['to']}: "
             f"{r['moved']} chunk(s) moved ({r['fetched']} from remote, {human(r['bytes'])}), "
             f"{r['already']} already there, {r['prefilled']} prefilled, {r['missing']} missing"
             + (f"; remote tier did not answer ({r['unchecked']} chunk(s) not checked)" if r["unchecked"] else "")
             + (f"; {entries(r['failed'])} failed" if r["failed"] else "")
             + f"; {r['in_tier']} chunk(s) of the manifest {'would be' if r['dry_run'] else 'are'} in {r['to']}"
             + (" then" if r["dry_run"] else " now"))
    for x in r["entries"]:
        if x["error"]:
            print(f"lmctl: documents[{x['index']}]: {printable(x['error']['message'])}", file=term.err)

