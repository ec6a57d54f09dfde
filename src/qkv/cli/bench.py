"""`qkv bench NAME [options]`: run one of the repository's benchmark scripts (qkv.bench loads them)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qkv.bench import BENCHMARKS, load_benchmark  # qkv.bench itself is light: the scripts load on demand


def register(sub: Any) -> None:
    """Add `qkv bench NAME [args...]` to the `qkv` sub-parsers."""
    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS),
                       description="Run benchmarks/NAME.py; options after NAME go to the benchmark "
                                   "(qkv bench NAME --help lists them).")  # fmt: skip
    p.set_defaults(handler=_cmd_bench)
    p.add_argument("name", metavar="NAME", help=" | ".join(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own options")


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark's main(argv); its own usage errors keep their exit code (2)."""
    module = load_benchmark(args.name)
    argv0 = sys.argv[0]
    sys.argv[0] = f"qkv bench {args.name}"  # the script's argparse names itself after argv[0] in usage and errors
    try:
        code = module.main(list(args.args))
    except SystemExit as e:  # argparse inside the script: --help (0) or a bad option (2), message already printed
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv[0] = argv0
    return int(code or 0)
