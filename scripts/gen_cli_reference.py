"""Regenerate the command reference at the end of docs/cli.md from the CLI itself.

``python scripts/gen_cli_reference.py`` rewrites it; ``--check`` only says whether it is
stale (exit 1), as the test that keeps the docs and the app equal does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from lmctl.cli import app
from lmctl.selectors import SELECTOR_NAMES

START, END = "<!-- generated: lmctl reference -->\n", "<!-- end generated -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def reference_markdown() -> str:
    """The command reference: a row per command, its options (the shared selectors as one link)."""
    root: Any = typer.main.get_command(app)
    out = ["| command | options |", "|---|---|"]

    def walk(prefix: str, group: Any) -> None:
        for name, cmd in group.commands.items():
            full = f"{prefix} {name}".strip()
            if hasattr(cmd, "commands"):
                walk(full, cmd)
                continue
            opts = []
            names = {p.name for p in cmd.params}
            shared = set(SELECTOR_NAMES) <= names
            for p in cmd.params:
                if shared and p.name in SELECTOR_NAMES:
                    continue
                if getattr(p, "param_type_name", "") == "option":
                    flags = "/".join(list(p.opts) + list(p.secondary_opts))
                    opts.append(f"`{flags}`" + (" (required)" if p.required else ""))
                elif getattr(p, "param_type_name", "") == "argument":
                    opts.append(f"`{(p.metavar or p.name).upper()}`")
            if shared:
                opts.append("[selectors](#selectors)")
            summary = (cmd.help or "").strip().splitlines()[0] if cmd.help else ""
            out.append(f"| `lmctl {full}`: {summary} | {', '.join(opts)} |")

    walk("", root)
    return "\n".join(out) + "\n"


def documented(doc: str) -> str:
    """The reference as docs/cli.md has it now."""
    return doc[doc.index(START) + len(START) : doc.index(END)]


def main(argv: list[str]) -> int:
    doc = DOC.read_text()
    if "--check" in argv:
        stale = documented(doc) != reference_markdown()
        print(f"{DOC.name}: the reference is {'stale: run scripts/gen_cli_reference.py' if stale else 'current'}")
        return 1 if stale else 0
    a = doc.index(START) + len(START)
    DOC.write_text(doc[:a] + reference_markdown() + doc[doc.index(END) :])
    print(f"updated {DOC.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
