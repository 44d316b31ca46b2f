"""Write tests/slow.txt, the tests the fast lane (`scripts/test.sh --fast`) leaves out, from
the output of a whole run with `--durations=0`:

    .venv/bin/python -m pytest -q --durations=0 > durations.txt
    .venv/bin/python scripts/slow_tests.py durations.txt [--over 1.5]

A test is slow when its setup, call and teardown took `--over` seconds or more together
(parametrized cases are added up under their test's name). Whole modules that start an
engine are left out by tests/conftest.py itself (SLOW_MODULES), listed or not.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"([\d.]+)s (?:setup|call|teardown)\s+(tests/[^:\s]+\.py)::([^\s\[]+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("durations")
    ap.add_argument("--over", type=float, default=1.5)
    args = ap.parse_args()
    took: collections.Counter[str] = collections.Counter()
    for line in Path(args.durations).read_text().splitlines():
        m = LINE.match(line.strip())
        if m:
            took[f"{m.group(2)}::{m.group(3)}"] += float(m.group(1))
    slow = sorted(k for k, v in took.items() if v >= args.over)
    head = ("# Tests the fast lane leaves out (scripts/test.sh --fast): each took "
            f"{args.over:g} s or more in a whole run.\n# Made by scripts/slow_tests.py from a run "
            "with --durations=0; rerun it when the fast lane grows slow.\n")
    (ROOT / "tests" / "slow.txt").write_text(head + "".join(f"{k}\n" for k in slow))
    print(f"{len(slow)} slow tests of {len(took)}, {sum(took[k] for k in slow):.0f} s of "
          f"{sum(took.values()):.0f} s")


if __name__ == "__main__":
    main()
