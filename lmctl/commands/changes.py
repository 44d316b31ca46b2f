"""The commands that change where chunks are or whether they stay: ``pin``, ``unpin``, ``evict``,
``move``, ``compress``."""

from typing import Annotated, Any

import typer

from ..completion import complete_values
from ..selectors import with_selectors
from ..terminal import Terminal, human
from .base import DryRun, NoHeaders, Output, Partial, chunk_id, formats, in_tier_now, keys_only, mutate, request


@with_selectors
def pin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False,
        export_manifest: Annotated[str | None, typer.Option(
            metavar="FILE", help="pin nothing: write the documents the selection's pins were made from "
                                 "(typically --label L) to FILE ('-': stdout), for warm --manifest")] = None) -> None:
    """Pin chunks or a document under --label (durable; never evicted). Works before it is served.

    \b
    Examples:
      lmctl pin --label contracts --model smollm2 --messages lease.json
      lmctl pin --label ops --key 48c937a7583e21f2 --dry-run
      lmctl pin --export-manifest contracts.json --label contracts
    """
    if export_manifest is not None:
        from ..manifest import export

        term = Terminal.of(ctx)
        term.run(lambda: export(term, sel, export_manifest, dry_run))
        return
    mutate(ctx, "pin", sel, dry_run, lambda r: (
        f"{'would pin' if r['dry_run'] else 'pinned'} {r['chunks']} chunk(s) under {r['label']!r} "
        f"({r['stored']} stored now, {r['added']} new pin reference(s))"))


@with_selectors
def unpin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False) -> None:
    """Remove a label's pins (all of them, or those a selector picks).

    \b
    Examples:
      lmctl unpin --label contracts --dry-run
      lmctl unpin --label contracts --messages lease.json
    """
    mutate(ctx, "unpin", sel, dry_run, lambda r: (
        f"{'would remove' if r['dry_run'] else 'removed'} {r['removed']} pin reference(s) of {r['label']!r}"))


@with_selectors
def evict(ctx: typer.Context, sel: dict[str, Any], force: Annotated[bool, typer.Option(
        "--force", help="evict pinned chunks too")] = False, dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="list what would go (keys and sizes) and evict nothing")] = False,
          output: Output = None, no_headers: NoHeaders = False) -> None:
    """Remove chunks from the store (never pinned ones unless --force); --dry-run lists what would go.

    \b
    Examples:
      lmctl evict --older-than 7d --unpinned --dry-run
      lmctl evict --older-than 7d --unpinned --dry-run -o name > old.keys
      lmctl evict --adapter civil@3f9a51c2
    """
    term = formats(ctx, output, no_headers)
    if output is not None and not dry_run:
        raise typer.Exit(term.report("usage", f"-o {output} lists what --dry-run would evict: add --dry-run"))

    def line(r: dict[str, Any]) -> str:
        return (f"{'would evict' if r['dry_run'] else 'evicted'} {r['chunks']} chunk(s), {human(r['bytes'])}"
                + (f"; {r['skipped_pinned']} pinned chunk(s) kept" if r["skipped_pinned"] else "")
                + (f"; {r['pinned_removed']} of them pinned ({'would be' if r['dry_run'] else 'were'} removed by "
                   "--force; their pins stay and protect them when stored again)" if r["pinned_removed"] else ""))

    def show(term: Terminal, r: dict[str, Any]) -> None:
        if r["dry_run"]:
            _show_victims(term, r["keys"], r["chunks"])
        term.say(line(r))

    # a table shows the first rows; scripts (-o name|tsv, --json) get them all
    rows = (1 << 40) if term.json or output in ("name", "tsv") else VICTIM_ROWS + 1
    request(ctx, "evict", {**sel, "force": force, "dry_run": dry_run, **({"list": rows} if dry_run else {})},
            show, long=True)


#: rows of a dry run's table at most (``-o name`` and ``-o tsv`` list them all)
VICTIM_ROWS = 1000


def _show_victims(term: Terminal, rows: list[dict[str, Any]], total: int) -> None:
    """What ``evict --dry-run`` would evict: a table, TSV, or keys (``-o name``)."""
    if term.output == "name":
        keys_only(term, [x["key"] for x in rows])
        return
    if term.output == "tsv":
        term.table(None, ["key", "tier", "bytes", "pins"], [[x["key"], x["tier"], x["bytes"], x["pins"]]
                                                            for x in rows])
        return
    wide = term.output == "wide"
    term.table(None, ["key" if wide else "chunk hash", "tier", "bytes", "pins"],
               [[x["key"] if wide else chunk_id(x["key"]), x["tier"], human(x["bytes"]), str(x["pins"])]
                for x in rows[:VICTIM_ROWS]], {"bytes", "pins"})
    if total > VICTIM_ROWS:
        term.say(f"... and {total - VICTIM_ROWS} more (-o name or -o tsv lists them all)")


@with_selectors
def move(ctx: typer.Context, sel: dict[str, Any], to: Annotated[str, typer.Option(
        help="destination tier: dram, nvme or remote", autocompletion=complete_values("--to"))],
         partial: Partial = False, dry_run: DryRun = False) -> None:
    """Move chunks to another tier (refused when the selection exceeds a local tier's room).

    \b
    Examples:
      lmctl move --to dram --label contracts
      lmctl move --to dram --model smollm2 --partial
      lmctl move --to remote --base --older-than 1d --dry-run
    """
    mutate(ctx, "move", {**sel, "to": to, **({"partial": True} if partial else {})}, dry_run, lambda r: (
        f"{'would move' if r['dry_run'] else 'moved'} {r['chunks']} chunk(s), {human(r['bytes'])} to {r['to']}"
        + (f" ({r['skipped']} already there)" if r["skipped"] else "") + in_tier_now(r)), long=True)


@with_selectors
def compress(ctx: typer.Context, sel: dict[str, Any],
             level: Annotated[int | None, typer.Option(help="zstd level, 1-19 [default: 1]")] = None,
             codec: Annotated[str, typer.Option(help="zstd-shuffle, zstd or raw",
                                                autocompletion=complete_values("--codec"))] = "zstd-shuffle",
             dry_run: DryRun = False) -> None:
    """Recompress chunks and report the bytes saved.

    \b
    Examples:
      lmctl compress --older-than 1d --dry-run
      lmctl compress --label contracts --level 3
      lmctl compress --codec raw --model smollm2
    """
    if codec == "raw" and level is not None:
        term = Terminal.of(ctx)
        raise typer.Exit(term.report("usage", f"--level {level} means nothing for --codec raw (raw chunks are not "
                                              "compressed): drop --level, or give --codec zstd-shuffle or zstd"))
    args = {**sel, "codec": codec, **({"level": level if level is not None else 1} if codec != "raw" else {})}
    mutate(ctx, "compress", args, dry_run, _compressed, long=True)


def _compressed(r: dict[str, Any]) -> str:
    saved = r["bytes_saved"]
    dry = r["dry_run"]
    change = (f"{'would save' if dry else 'saved'} {human(saved)}" if saved >= 0
              else f"{'would grow by' if dry else 'grew by'} {human(-saved)}")
    skipped = f"; {r['skipped']} already {r['codec']} at that level" if r["skipped"] else ""
    if dry:
        return (f"would recompress {r['chunks']} chunk(s): {human(r['bytes_before'])} -> about "
                f"{human(r['bytes_after'])} (estimated), {change}{skipped}")
    return (f"recompressed {r['chunks']} chunk(s): {human(r['bytes_before'])} -> {human(r['bytes_after'])}, "
            f"{change}{skipped}")
