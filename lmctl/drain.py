"""``lmctl drain``: before scale-down, copy this instance's chunks to the remote tier and write
the manifest the replacement's ``warm --manifest`` reads (docs/cli.md, drain).

The daemon copies (``drain`` request, ``lmctl/ops/drain.py``: pinned documents first, then by recent
hits, within the budget and deadline) and streams the manifest entries of what went as it
goes, each after its chunks are whole in the remote tier; this side collects them and writes
the manifest at the end, or, on Ctrl-C, the manifest of what it got so far: every chunk it
lists is in the remote tier.

Nothing here imports the store library.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .manifest import _Bad, _check_entry, dump_manifest, write_private
from .terminal import CommandError, Terminal, human, printable
from .units import format_duration, parse_duration

#: why a chunk stayed behind, for people
REASONS = {"budget": "over the budget", "deadline": "past the deadline", "refused": "refused by the remote tier",
           "unreadable": "with a local copy that failed its checksum", "gone": "evicted meanwhile"}
#: reasons that fail the command whatever they left (the others are the operator's limits)
FAILURES = ("refused", "unreadable")


def merge(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's entries: documents as they came, keys entries of one label and
    namespace merged into the first of them."""
    out: list[dict[str, Any]] = []
    at: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for e in entries:
        if "keys" not in e:
            out.append(e)
            continue
        group = (e.get("label"), e.get("model"), e.get("adapter"))
        if group in at:
            at[group]["keys"] = at[group]["keys"] + [k for k in e["keys"] if k not in at[group]["keys"]]
        else:
            at[group] = dict(e)
            out.append(at[group])
    return out


def _checked(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The daemon's entries, each one ``warm --manifest`` will read back."""
    for i, e in enumerate(entries):
        try:
            _check_entry(e)
        except _Bad as exc:
            raise CommandError("failed", f"the daemon sent a bad manifest entry, documents[{i}].{exc.field}: "
                                         f"{exc}") from None
    return entries


def _writable(path: str) -> None:
    """Refuse, before anything is copied, a manifest path that cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if path == "-":
        raise CommandError("usage", "--manifest -: stdout carries drain's report; name a file")
    if os.path.isdir(path):
        raise CommandError("usage", f"--manifest {path} is a folder: name a file")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise CommandError("usage", f"--manifest {path}: cannot write in {folder} (missing, or not writable)")


class _Interrupts:
    """Ctrl-C while armed raises ``KeyboardInterrupt`` once; any other (a second Ctrl-C, or
    ``timeout -s INT``, which signals the process and then its group) is ignored: the manifest
    of what went is written whole, and the command ends with its one line and exit 130."""

    def __init__(self) -> None:
        self.armed = True
        self.fired = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            self.fired = True
            raise KeyboardInterrupt


@contextmanager
def _interrupts(restore: bool) -> Iterator[_Interrupts]:
    """``_Interrupts`` as the SIGINT handler while the drain runs; after a Ctrl-C stopped it,
    it stays until the process exits (a moment later), unless ``restore`` (the shell, which
    goes on)."""
    handler = _Interrupts()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield handler
        return
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        if restore or not handler.fired:
            signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)


def drain(term: Terminal, path: str, budget: str | None, deadline: str | None, dry_run: bool) -> bool:
    """``lmctl drain``, its report shown; whether it succeeded (see ``_drain``)."""
    with _interrupts(restore=term.keep_open) as interrupts:
        return _drain(term, path, budget, deadline, dry_run, interrupts)


def _drain(term: Terminal, path: str, budget: str | None, deadline: str | None, dry_run: bool,
           interrupts: _Interrupts) -> bool:
    """``lmctl drain``, its report shown; whether it succeeded: not when it left pinned
    entries behind, or the remote tier refused chunks (or a local copy failed its checksum).
    Ctrl-C writes the manifest of what went and ends it with exit status 130."""
    args: dict[str, Any] = {"dry_run": dry_run}
    if budget is not None:
        from store.config import parse_unit_size
        from store.errors import StoreError

        try:
            parse_unit_size(budget, "--budget")  # here too: a typo is told before any daemon is asked
        except StoreError as exc:
            raise CommandError("usage", str(exc)) from None
        args["budget"] = budget
    if deadline is not None:
        try:
            args["deadline_s"] = parse_duration(deadline, unit_required=True)
        except ValueError as exc:
            raise CommandError("usage", f"--deadline {exc}") from None
    _writable(path)
    sink: dict[str, list[Any]] = {}
    try:
        r = term.call("drain", args, long=True, sink=sink)
        interrupts.armed = False  # the manifest is written whole, Ctrl-C or not
    except KeyboardInterrupt:
        interrupts.armed = False
        term.hang_up()  # which cancels the daemon's job between two chunks
        went = merge(_checked(list(sink.get("manifest") or [])))
        if not dry_run:
            write_private(path, dump_manifest(went))
        chunks = sum(len(e["keys"]) for e in went if "keys" in e)
        docs = sum(1 for e in went if "keys" not in e)
        done = "" if term.last_progress is None else f" after {term.last_progress[0]} of {term.last_progress[1]}"
        raise CommandError("interrupted", f"drain interrupted{done}; the daemon stops it between two chunks; "
                           + ("nothing written (--dry-run)" if dry_run else
                              f"{path} lists what went: {docs} document(s) and {chunks} more chunk(s), every one "
                              "whole in the remote tier")) from None
    entries = merge(_checked(list(r.pop("manifest", None) or [])))
    if not dry_run:
        write_private(path, dump_manifest(entries))
    out = {"manifest": path, **r, "entries": len(entries),
           "documents": sum(1 for e in entries if "keys" not in e)}
    term.emit(out, _show)
    failed = [x for x in FAILURES if x in r["left"]["reasons"]]
    if r["pinned_left"] or failed:
        if not term.json:
            why = []
            if r["pinned_left"]:
                why.append(f"{r['pinned_left']} pinned entr{'y' if r['pinned_left'] == 1 else 'ies'} left behind")
            why += [f"{r['left']['reasons'][x]['chunks']} chunk(s) {REASONS[x]}" for x in failed]
            print(f"lmctl: drain {'would leave' if dry_run else 'left'} work undone: {'; '.join(why)}; exit 1",
                  file=term.err)
        return False
    return True


def _show(term: Terminal, r: dict[str, Any]) -> None:
    dry = r["dry_run"]
    w, left = r["went"], r["left"]
    limits = ", ".join(x for x in (
        f"budget {human(r['budget'])}" if r["budget"] is not None else "",
        f"deadline {format_duration(r['deadline_s'])}" if r["deadline_s"] is not None else "") if x)
    if r["pinned"]:
        rows = [[printable(x["label"]), x["document"], str(x["chunks"]), str(x["went"]), str(x["left"]),
                 x["status"] if x["chunks"] else "not stored", REASONS.get(x["reason"] or "", "-")]
                for x in r["pinned"]]
        term.table("pinned", ["label", "document", "chunks", "went", "left", "status", "why"], rows,
                   {"chunks", "went", "left"})
    term.say(f"{'would copy' if dry else 'copied'} {w['chunks']} chunk(s), {human(w['bytes'])} to the remote tier "
             f"in {r['elapsed_s']:.1f} s ({w['documents']} pinned document(s), {w['pinned_chunks']} pinned "
             f"chunk(s)){' within ' + limits if limits else ''}; the local copies stay")
    if left["chunks"]:
        why = ", ".join(f"{x['chunks']} {REASONS[k]} ({human(x['bytes'])})" for k, x in left["reasons"].items())
        term.say(f"{'would leave' if dry else 'left'} {left['chunks']} chunk(s), {human(left['bytes'])} behind: {why}"
                 + (f"; {left['pinned_chunks']} of them pinned" if left["pinned_chunks"] else ""))
    else:
        term.say("nothing left behind")
    term.say(f"{'would write' if dry else 'wrote'} {r['manifest']}: {r['entries']} entr"
             f"{'y' if r['entries'] == 1 else 'ies'} ({r['documents']} document(s)); on the replacement: "
             f"lmctl warm --manifest {r['manifest']}")
