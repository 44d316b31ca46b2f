"""``lmctl inspect`` and ``lmctl ls``: statistics and paged listings, as tables, TSV or keys."""

import json
import shlex
import time
from typing import Annotated, Any

import typer

from ..completion import complete_values
from ..selectors import with_selectors
from ..terminal import Terminal, human
from .base import (
    NoHeaders,
    Output,
    chunk_id,
    formats,
    iso_time,
    keys_only,
    local_time,
    request,
    tiers_table,
    write_amplification,
)


@with_selectors
def inspect_(ctx: typer.Context, sel: dict[str, Any], output: Output = None, no_headers: NoHeaders = False) -> None:
    """Store statistics by tier, model, adapter and label, or one chunk's metadata (--key K).

    With selectors, the statistics of the chunks they pick.

    \b
    Examples:
      lmctl inspect
      lmctl inspect --label contracts -o tsv
      lmctl inspect --key 48c937a7583e21f2
    """
    term = formats(ctx, output, no_headers)
    if output == "name" and not sel.get("keys"):
        raise typer.Exit(term.report("usage", "-o name prints chunk keys: inspect without --key shows statistics; "
                                              "lmctl ls -o name lists the keys a selector picks"))
    request(ctx, "inspect", sel, _show_inspect)


def _show_inspect(term: Terminal, r: dict[str, Any]) -> None:
    if "chunk" in r and term.output == "name":
        keys_only(term, [r["chunk"].get("key")])
        return
    if "chunk" in r and term.output == "tsv":
        term.table(None, ["field", "value"], [[k, "" if v is None else v if isinstance(v, str) else json.dumps(v)]
                                              for k, v in r["chunk"].items()])
        return
    if "chunk" in r:
        now = time.time()

        def shown(k: str, v: Any) -> str:
            if k in ("created", "last_access") and isinstance(v, (int, float)):
                return local_time(v) + f" ({ago(now - v)} ago)"
            if k in ("bytes", "raw_bytes", "disk_bytes") and isinstance(v, int):
                return f"{human(v)} ({v} B)"
            if k == "labels" and isinstance(v, list):
                return ", ".join(map(str, v)) or "-"
            if v is None:
                return "-"
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        term.table(None, ["field", "value"], [[k, shown(k, v)] for k, v in r["chunk"].items()])
        return
    if term.output == "tsv":
        _inspect_tsv(term, r)
        return
    wide = term.output == "wide"
    if "scope" in r:
        term.say(f"selected: {r['chunks']} chunks, {human(r['bytes'])} on disk")
    else:
        term.say(f"{r['chunks']} chunks, {human(r['bytes'])}; write amplification {write_amplification(r)}")
    tiers_table(term, r["tiers"])
    if r["models"]:
        term.table("models (one row per checkpoint fingerprint)",
                   ["model", "fingerprint", "last used", "chunks", "bytes"],
                   [[m["model"], (m["fingerprint"] or "-")[:None if wide else 12]
                     + (" (retired)" if m["retired"] else ""),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(m["last_used"])) if m["last_used"] else "-",
                     str(m["chunks"]), human(m["bytes"])] for m in r["models"]], {"chunks", "bytes"})
    if r["adapters"]:
        term.table("by model and adapter", ["model", "adapter", "chunks", "bytes"],
                   [[a["model"], a["adapter"] or "(base)", str(a["chunks"]), human(a["bytes"])]
                    for a in r["adapters"]], {"chunks", "bytes"})
    if r["labels"]:
        term.table("labels", ["label", "chunks"], [[k, str(v)] for k, v in r["labels"].items()], {"chunks"})
    k = r["counters"]
    term.say(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}")


def _inspect_tsv(term: Terminal, r: dict[str, Any]) -> None:
    """``inspect -o tsv``: a section per table (tiers, models, adapters, labels), a blank line
    between two; each section's first column names what its rows count."""
    sections = [lambda: tiers_table(term, r["tiers"])]
    if r["models"]:
        sections.append(lambda: term.table(None, ["model", "fingerprint", "retired", "last_used", "chunks", "bytes"], [
            [m["model"], m["fingerprint"] or "", str(m["retired"]).lower(),
             iso_time(m["last_used"]) if m["last_used"] else "", m["chunks"], m["bytes"]] for m in r["models"]]))
    if r["adapters"]:
        sections.append(lambda: term.table(None, ["model", "adapter", "chunks", "bytes"], [
            [a["model"], a["adapter"] or "", a["chunks"], a["bytes"]] for a in r["adapters"]]))
    if r["labels"]:
        sections.append(lambda: term.table(None, ["label", "chunks"], [[k, v] for k, v in r["labels"].items()]))
    for i, show in enumerate(sections):
        if i:
            term.echo()
        show()


@with_selectors
def ls_(ctx: typer.Context, sel: dict[str, Any], limit: Annotated[int, typer.Option(
        help="rows per page (0: all, in key order)", min=0)] = 100,
        sort: Annotated[str, typer.Option(
            help="key, age (oldest first), access (least recently used first) or size (largest first)",
            autocompletion=complete_values("--sort"))] = "key",
        cursor: Annotated[str | None, typer.Option(
            help="continue a listing where the last page ended (its 'next')")] = None,
        output: Output = None, no_headers: NoHeaders = False) -> None:
    """List chunks matching a selector (all chunks without one), a page at a time.

    \b
    Examples:
      lmctl ls --label contracts
      lmctl ls --sort size --limit 10 -o wide
      lmctl ls --limit 0 --adapter civil -o name
    """
    formats(ctx, output, no_headers)
    request(ctx, "ls", {**sel, "limit": limit, "sort": sort, **({"cursor": cursor} if cursor else {})}, _show_ls)


def ago(seconds: float) -> str:
    """A duration the way a listing shows it: 45s, 12m, 3h, 9d."""
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


LS_TSV = ("key", "tier", "bytes", "tokens", "pins", "hits", "created", "last_access", "model", "adapter", "codec")


def _show_ls(term: Terminal, r: dict[str, Any]) -> None:
    if term.output == "name":
        keys_only(term, [x["key"] for x in r["chunks"]])
    elif term.output == "tsv":
        term.table(None, list(LS_TSV), [[iso_time(x[k]) if k in ("created", "last_access") else
                                         "" if x[k] is None else x[k] for k in LS_TSV] for x in r["chunks"]])
    if term.output in ("name", "tsv"):
        return
    now = time.time()
    wide = term.output == "wide"
    rows = [[x["key"] if wide else chunk_id(x["key"]), x["tier"], human(x["bytes"]), str(x["tokens"]), str(x["pins"]),
             str(x["hits"]), ago(now - x["created"]), ago(now - x["last_access"]) + " ago",
             x["adapter"] or "(base)", *([x["model"] or "-", x["codec"]] if wide else [])] for x in r["chunks"]]
    term.table(None, ["key" if wide else "chunk hash", "tier", "bytes", "tokens", "pins", "hits", "age",
                      "last access", "adapter", *(["model", "codec"] if wide else [])],
               rows, {"bytes", "tokens", "pins", "hits", "age", "last access"})
    more = f" (showing {len(r['chunks'])})" if r["truncated"] else ""
    term.say(f"{r['total']} chunk(s), {human(r['bytes'])}{more}")
    if r.get("next"):
        term.say(f"next page: {next_page(term, r['next'])}")


def next_page(term: Terminal, cursor: str) -> str:
    """The command line of the next page: this one (its selectors and sort) with ``--cursor``.
    A cache salt is a secret: the line names the option only."""
    words = term.line
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("--json", "--cursor", "--cache-salt") or w.startswith(("--cursor=", "--cache-salt=")):
            if w == "--cache-salt" or w.startswith("--cache-salt="):
                out += ["--cache-salt", "SALT"]
            i += 2 if w in ("--cursor", "--cache-salt") else 1
            continue
        out.append(w)
        i += 1
    line = shlex.join([*out, "--cursor", cursor])
    return line if term.keep_open else f"lmctl {line}"  # the shell's lines have no lmctl
