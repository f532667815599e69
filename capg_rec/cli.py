"""The ``capg-rec`` command line: ``demo``, ``train``, ``reproduce``, ``bench``, ``validate``, ``log``."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from capg_rec import bench
from capg_rec.logs import cli as logs_cli
from capg_rec.train import cli as train_cli
from capg_rec.validate import cli as validate_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capg-rec", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cli.register(subparsers)
    bench.register(subparsers)
    validate_cli.register(subparsers)
    logs_cli.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args) or 0
    except KeyboardInterrupt:  # Ctrl-C: a message and the shell's code for it, not a traceback
        print(f"capg-rec {args.command}: interrupted{_resumable(args)}", file=sys.stderr)
        code = 130
    raise SystemExit(code)


def _resumable(args: argparse.Namespace) -> str:
    """What an interrupted ``train`` left to continue: its last checkpoint, or nothing yet."""
    if args.command != "train":
        return ""
    out = Path(args.out)
    if (out / "checkpoint.pt").is_file() or (out / "checkpoint.pt.prev").is_file():  # as --resume reads them
        return f"; continue from its last checkpoint with --resume --out {shlex.quote(args.out)}"
    return " before its first checkpoint: nothing to --resume, start it again"


if __name__ == "__main__":
    main()
