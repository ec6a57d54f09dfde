"""The `qkv` command: train, prepare, generate, eval, translate, chat, convert, lab, interpret, explore, bench.

Every user mistake ends in one line on stderr and exit code 2, never a traceback. Building the parser
imports no heavy package (torch loads when a command runs), so `qkv --help` answers at once. The
library never imports this package: it is the entry point, nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import qkv
from qkv.cli import bench, chat, convert, explore, interpret, lab, prepare, runs, sae, serve, train
from qkv.cli.common import Parser, key_value
from qkv.errors import QkvError

__all__ = ["build_parser", "key_value", "main"]


def torch_version() -> str:
    """The installed torch's version, read without importing torch (it takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    """The full `qkv` argument parser (`qkv train`'s options are built per task when it runs)."""
    parser = Parser(prog="qkv", description="qkv — the Transformer, complete.")
    parser.add_argument("--version", action="version", version=f"qkv {qkv.__version__} (torch {torch_version()})")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    commands = (train, prepare, runs, chat, serve, convert, lab, interpret, explore, bench)
    for command in commands:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `qkv` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    try:
        if command == "train":  # its options depend on the task, so it parses its own arguments
            return train.main(argv[1:])
        if argv[:3] == ["interpret", "sae", "train"]:  # `qkv train sae` with the model first
            return train.main(sae.train_argv(argv))
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return int(args.handler(args))
    except QkvError as e:
        print(f"qkv {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`qkv generate … | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0


if __name__ == "__main__":
    sys.exit(main())
