"""The `learner` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="learner", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("run", help="Train a LoRA adapter with asynchronous GRPO (the embedded default when given no arguments).", description="Train a LoRA adapter with asynchronous GRPO (the embedded default when given no arguments).")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    # The spine ships the command's shape; its body arrives with its own issue.
    print(f"learner {args.command}: not implemented yet in this version of spotgrpo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
