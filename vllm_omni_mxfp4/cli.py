"""The ``vllm-omni-mxfp4`` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand adds its own sub-parser."""
    parser = argparse.ArgumentParser(prog="vllm-omni-mxfp4", description=__doc__)
    parser.add_subparsers(dest="command", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args)) if hasattr(args, "func") else 2


if __name__ == "__main__":
    sys.exit(main())
