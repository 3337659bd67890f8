"""`python -m csa2 <command>`: `inspect` (layer plan and memory table) and `convert` (released checkpoints)."""

from __future__ import annotations

import argparse
import sys

from csa2 import plan_report
from csa2.checkpoints import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csa2")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_report.add_command(sub)
    convert.add_command(sub)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
