"""What every `qkv` sub-command shares: a parser that errs in one line, and KEY=VALUE parsing."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from typing import Any, NoReturn

# What every command that reads a model takes (qkv.tasks.load reads them all).
MODEL_HELP = "a run of `qkv train`, a .gguf file, a Hugging Face directory or a `qkv convert` directory"
CHECKPOINTS = ("best", "last")  # a run's weights: the best evaluation's, or the last checkpoint's


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors on one line and takes options before or after positionals."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse intermixed options and positionals, except in parsers with sub-commands."""
        # Plain argparse stops filling optional positionals at the first option: `qkv translate RUN --beam 1
        # "Satz"` would call "Satz" unrecognised.
        nested = any(a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in self._actions)
        if self._intermixing or nested:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def error(self, message: str) -> NoReturn:
        """Print `qkv <cmd>: error: …` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def key_value(text: str) -> tuple[str, Any]:
    """Parse KEY=VALUE, VALUE as a Python literal when it is one (3, 0.1, True), else a string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip(), value
