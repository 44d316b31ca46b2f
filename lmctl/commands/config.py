"""``lmctl config``: show or change the store's settings through the daemon."""

import json
from typing import Annotated, Any

import typer

from ..completion import REMOTE_SETTINGS, STORE_SETTINGS, TIER_SETTINGS, complete_values
from ..terminal import CommandError, Terminal, human, printable
from .base import request

config_app = typer.Typer(help="Show or change the store's settings through the daemon.", no_args_is_help=True)


@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """The store's settings (tiers, capacities, pin budgets, codec, ...).

    \b
    Examples:
      lmctl config show
      lmctl --json config show | jq .settings.tiers
    """
    request(ctx, "config", {}, _show_settings)


SETTINGS_HELP = (f"Keys: {', '.join(STORE_SETTINGS)}; {', '.join(f'tiers.TIER.{k}' for k in TIER_SETTINGS)} (TIER: "
                 f"dram or nvme; naming a tier that is not configured adds it, tiers.TIER=none removes an empty "
                 f"one); "
                 f"{', '.join(f'remote.{k}' for k in REMOTE_SETTINGS)} (remote.url=none removes the remote tier). "
                 "Sizes need a unit (500GiB, 1TB), durations too (90s, 12h, 7d).")


@config_app.command("set", epilog=SETTINGS_HELP)
def config_set(ctx: typer.Context, pairs: Annotated[list[str], typer.Argument(
        metavar="KEY=VALUE", help="e.g. tiers.nvme.capacity=500GiB codec=zstd-shuffle",
        autocompletion=complete_values("KEY=VALUE"))], dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="check the settings and say what a smaller capacity would evict; change nothing")]
        = False) -> None:
    """Change store settings (validated, recorded in the store, applied at once).

    \b
    Examples:
      lmctl config set tiers.nvme.capacity=200GiB --dry-run
      lmctl config set tiers.nvme.capacity=500GiB
      lmctl config set codec=zstd-shuffle codec_level=3 retire_after_s=12h
    """
    request(ctx, "config", lambda: {"set": _changes(pairs), **({"dry_run": True} if dry_run else {})},
            lambda term, r: _show_config_dry_run(term, r) if r.get("dry_run") else
            None if term.quiet else _show_settings(term, r))


def _show_config_dry_run(term: Terminal, r: dict[str, Any]) -> None:
    term.say(f"would change {', '.join(r['changed'])} (nothing applied)")
    for name, e in r["evicts"].items():
        cap = ("" if e["capacity"] == e["capacity_before"] else
               f" (capacity {human(e['capacity_before'])} -> {human(e['capacity'])})")
        if e["chunks"]:
            verb = f"move {e['chunks']} chunk(s), {human(e['bytes'])} to {e['moves_to']}" if e["moves_to"] else \
                f"evict {e['chunks']} chunk(s), {human(e['bytes'])}"
            term.say(f"tier {name}: would {verb} at once{cap}")
        elif cap:
            term.say(f"tier {name}: nothing would be evicted{cap}")


def _changes(pairs: list[str]) -> dict[str, str]:
    changes: dict[str, str] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise CommandError("usage", f"{p!r} is not KEY=VALUE (e.g. tiers.nvme.capacity=500GiB)")
        if k.strip() in changes:
            raise CommandError("usage", f"{k.strip()} is set twice ({k.strip()}={changes[k.strip()]}, {p}): "
                                        "give it once")
        changes[k.strip()] = v.strip()
    return changes


def _show_settings(term: Terminal, r: dict[str, Any]) -> None:
    """A row per setting, by the name ``config set`` takes (``remote.url``, ``tiers.nvme.capacity``),
    sizes and durations with their units (``--json`` gives bytes and seconds)."""
    from ..completion import flatten

    rows = [[k, setting_text(k, v)] for k, v in flatten(r["settings"]).items()]
    term.table(None, ["setting", "value"], rows)
    if r.get("changed"):
        term.say("changed: " + ", ".join(r["changed"]))
    for note in r.get("notes") or []:
        print(f"lmctl: warning: {printable(note)}", file=term.err)


def setting_text(name: str, value: Any) -> str:
    """A setting's value as an operator writes it: ``64.0 GiB``, ``1h``, ``none``."""
    from ..units import format_duration

    if value is None:
        return "none"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value if isinstance(value, str) else json.dumps(value)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("capacity", "segment_bytes", "piece_bytes") or (leaf == "pin_budget" and value > 1):
        return human(value)
    if leaf.endswith("_s"):
        return format_duration(value)
    return f"{value:g}" if isinstance(value, float) else str(value)
