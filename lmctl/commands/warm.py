"""``lmctl warm`` and ``lmctl drain``: chunks brought into a fast tier before traffic, and pushed to the
shared tier before scale-down."""

from typing import Annotated, Any

import typer

from ..completion import complete_values
from ..selectors import with_selectors
from ..terminal import CommandError, ExitStatus, Terminal, human
from .base import DryRun, Partial, in_tier_now

WARM_KEYS = ("chunks", "bytes", "bytes_before", "bytes_after", "skipped", "missing", "unchecked", "fetched",
             "dry_run", "to", "left", "room", "in_tier", "prefill")

AllowMissing = Annotated[bool, typer.Option(
    "--allow-missing", help="exit 0 even when selected chunks could not be warmed (in no tier, or the remote "
                            "tier did not answer)")]


@with_selectors
def warm(ctx: typer.Context, sel: dict[str, Any], endpoint: Annotated[str | None, typer.Option(
        help="also prefill the document through this OpenAI-compatible server (http://host:port)")] = None,
         to: Annotated[str | None, typer.Option(
             help="the local tier to bring chunks into: dram or nvme [default: dram; with --manifest, the "
                  "default tier where there is no dram]", autocompletion=complete_values("warm --to"))] = None,
         manifest: Annotated[str | None, typer.Option(
             metavar="FILE", help="warm every document of a manifest (pin --export-manifest writes one; "
                                  "'-': stdin)")] = None,
         pin_: Annotated[bool, typer.Option("--pin", help="with --manifest: also pin each entry under its label")]
         = False, allow_missing: AllowMissing = False, partial: Partial = False, dry_run: DryRun = False) -> None:
    """Before a restart or traffic shift: bring chunks (or a manifest's) into dram; --endpoint prefills the rest.

    \b
    Examples:
      lmctl warm --label contracts
      lmctl warm --manifest contracts.json --to nvme
      lmctl warm --model smollm2 --messages lease.json --endpoint http://127.0.0.1:8000
    """
    from ..manifest import not_warmed, warm_manifest
    from ..prefill import prefill

    term = Terminal.of(ctx)

    def body() -> None:
        if manifest is not None:
            if not warm_manifest(term, manifest, sel, to, endpoint, pin_, dry_run, allow_missing):
                raise typer.Exit(ExitStatus.ERROR)
            return
        if pin_:
            raise CommandError("usage", "--pin goes with --manifest (to pin a document, use lmctl pin)")
        out: dict[str, Any] = {}
        if endpoint:
            out["prefill"] = prefill(term, sel, endpoint, dry_run)
            if to is None and "dram" not in term.call("status")["store"]["tiers"]:
                # prefill only: the chunks stay where the engine wrote them
                out.update({"chunks": 0, "bytes": 0, "bytes_before": 0, "bytes_after": 0, "skipped": 0,
                            "missing": 0, "unchecked": 0, "fetched": 0, "dry_run": dry_run, "to": None,
                            "left": 0, "room": None, "in_tier": None})
        if "to" not in out:
            out.update(term.call("warm", {**sel, "dry_run": dry_run, **({"to": to} if to else {}),
                                          **({"partial": True} if partial else {})}, long=True))
        term.emit({k: out[k] for k in sorted(out, key=WARM_KEYS.index)}, _show_warm)
        if not_warmed(term, out, allow_missing, estimate=dry_run and endpoint is not None):
            raise typer.Exit(ExitStatus.ERROR)

    term.run(body)


def drain(ctx: typer.Context, manifest: Annotated[str, typer.Option(
        metavar="FILE", help="write the manifest of what went to FILE, for the replacement's warm --manifest")],
          budget: Annotated[str | None, typer.Option(
              help="copy at most SIZE of stored bytes: 2GiB, 500MiB (a unit is required)")] = None,
          deadline: Annotated[str | None, typer.Option(
              help="stop copying after DURATION: 90s, 5m, 1h (a unit is required)")] = None,
          dry_run: DryRun = False) -> None:
    """Before scale-down: copy this instance's chunks to the remote tier, pinned then hottest first, with a report.

    The local copies stay. Exit 1 when pinned entries were left behind (budget, deadline, the
    remote tier refused them) or the remote tier refused chunks; 130 on Ctrl-C, with a manifest
    of what went.

    \b
    Examples:
      lmctl drain --manifest drain.json --budget 20GiB --deadline 5m
      lmctl drain --manifest drain.json --dry-run
      lmctl warm --manifest drain.json   (on the replacement)
    """
    from ..drain import drain as run_drain

    term = Terminal.of(ctx)

    def body() -> None:
        if not run_drain(term, manifest, budget, deadline, dry_run):
            raise typer.Exit(ExitStatus.ERROR)

    term.run(body)


def _show_warm(term: Terminal, r: dict[str, Any]) -> None:
    if "prefill" in r:
        p = r["prefill"]
        term.say(f"prefill: {p['hit_tokens_before']} -> {p['hit_tokens_after']} of {p['total_tokens']} tokens cached")
    if r["to"] is None:
        term.say("no dram tier in this store: the chunks stay where the engine wrote them")
        return
    # the bytes of chunks still in the remote tier are unknown until they are fetched
    unknown = r["fetched"] if r["dry_run"] else 0
    size = (f"{human(r['bytes'])} from local tiers and {unknown} from the remote tier (its sizes are known once "
            "fetched)" if unknown and unknown < r["chunks"] else
            "all from the remote tier (sizes known once fetched)" if unknown else human(r["bytes"]))
    fetched = f" ({r['fetched']} from the remote tier)" if r["fetched"] and not r["dry_run"] else ""
    term.say(f"{'would bring' if r['dry_run'] else 'brought'} {r['chunks']} chunk(s) into {r['to']}: {size}{fetched}"
             + (f"; {r['skipped']} already there" if r["skipped"] else "")
             + (f"; {r['missing']} in no tier" if r["missing"] else "")
             + (f"; remote tier did not answer ({r['unchecked']} chunk(s) not checked)" if r["unchecked"] else "")
             + in_tier_now(r))
