"""Regenerate the command reference at the end of docs/cli.md from the CLI itself."""

from pathlib import Path

from lmctl.cli import reference_markdown

START, END = "<!-- generated: lmctl reference -->\n", "<!-- end generated -->"
doc_path = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
doc = doc_path.read_text()
a = doc.index(START) + len(START)
b = doc.index(END)
doc_path.write_text(doc[:a] + reference_markdown() + doc[b:])
print(f"updated {doc_path.name}")
