"""`qkv translate`, and the translation halves of `qkv train translate` and `qkv eval`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.errors import QkvError

if TYPE_CHECKING:
    from qkv.translation.run import TranslationRun

# `qkv train` options that only mean something for the language model.
_LM_ONLY = ("data", "tokenizer", "block_size", "batch_size", "grad_accum", "eval_tokens",
            "dtype", "compile", "sample_tokens")  # fmt: skip
# `qkv train` option → TranslateConfig field.
_SHARED = {"bpe_vocab_size": "vocab_size", "batch_tokens": "batch_tokens", "label_smoothing": "label_smoothing",
           "max_steps": "max_steps", "max_time": "max_time", "lr": "lr", "min_lr": "min_lr",
           "schedule": "schedule", "warmup_steps": "warmup_steps",
           "weight_decay": "weight_decay", "grad_clip": "grad_clip", "eval_interval": "eval_interval",
           "device": "device", "seed": "seed", "out_dir": "out_dir", "resume": "resume"}  # fmt: skip


def cmd_train_translate(args: argparse.Namespace) -> int:
    """`qkv train translate`: train German → English, then print where the run is."""
    from qkv.translation.config import DEFAULT_MODEL, TranslateConfig
    from qkv.translation.trainer import train_translation

    given = [n for n in _LM_ONLY if getattr(args, n, None) not in (None, [], False)]
    if given:
        names = ", ".join("--" + n.replace("_", "-") for n in given)
        raise QkvError(f"{names}: language-model option(s), not used by `qkv train translate`")
    settings: dict[str, Any] = {f: getattr(args, a) for a, f in _SHARED.items() if getattr(args, a, None) is not None}
    overrides = {k: getattr(args, k) for k in ("d_model", "n_heads", "dropout") if getattr(args, k) is not None}
    if args.n_layers is not None:
        overrides.update(n_encoder_layers=args.n_layers, n_decoder_layers=args.n_layers)
    overrides.update(dict(args.model))  # any TransformerConfig field
    if overrides:
        settings["model"] = {**DEFAULT_MODEL, **overrides}
    if args.resume:
        from qkv.training.run import read_run_config

        if not args.out_dir:
            raise QkvError("--resume needs --out-dir: the run directory to continue")
        # The run's own step and time budgets unless the command line extends them.
        stored = read_run_config(Path(args.out_dir))["training"]
        settings.setdefault("max_steps", stored.get("max_steps"))
        settings.setdefault("max_time", stored.get("max_time"))
    result = train_translation(TranslateConfig(**settings))
    print(f"\nval loss {result.val_loss:.4f}, val BLEU {result.val_bleu:.2f} (best {result.best_val_bleu:.2f}) after "
          f"{result.step} steps, {result.elapsed_s:.0f} s — run saved in {result.run_dir}")  # fmt: skip
    print(f"more: qkv translate {result.run_dir} 'Wie geht es dir?'   |   qkv eval {result.run_dir}")
    return 130 if result.interrupted else 0


def add_penalty_options(p: argparse.ArgumentParser) -> None:
    """--length-penalty and --coverage-penalty (beam search's α and β), shared by `qkv translate` and `qkv eval`."""
    p.add_argument("--length-penalty", type=float, metavar="ALPHA", help="beam: GNMT's α (default: the run's, 0.6)")
    p.add_argument("--coverage-penalty", type=float, metavar="BETA",
                   help="beam: GNMT's β, the cost of unattended source tokens (default: the run's, 0.2)")  # fmt: skip


def _with_penalties(run: TranslationRun, args: argparse.Namespace) -> TranslationRun:
    """The run, decoding with the penalties given on the command line instead of its own (checked by the config)."""
    given = {n: getattr(args, n) for n in ("length_penalty", "coverage_penalty") if getattr(args, n) is not None}
    if given:
        run.config = dataclasses.replace(run.config, **given)
    return run


def cmd_eval_translate(args: argparse.Namespace) -> int:
    """`qkv eval` on a translation run: test-split BLEU and chrF, greedy and beam."""
    from qkv.training.trainer import resolve_device
    from qkv.translation.corpus import split_de_en
    from qkv.translation.metrics import corpus_bleu, corpus_chrf
    from qkv.translation.run import load_translation

    run = _with_penalties(load_translation(args.run_dir, args.checkpoint, resolve_device(args.device)), args)
    test = split_de_en().test
    sources, references = [de for de, _ in test], [en for _, en in test]
    for beam in sorted({1, args.beam}):
        hyps = run.translate(sources, beam, args.batch_size)
        name = "greedy" if beam == 1 else f"beam {beam}"
        print(f"test {name:>7}: BLEU {corpus_bleu(hyps, references):5.2f}  chrF {corpus_chrf(hyps, references):5.2f}  "
              f"({len(test)} sentences, {args.checkpoint} weights)")  # fmt: skip
    return 0


def _sentences(args: argparse.Namespace) -> list[str]:
    """The sentences to translate: the argument, or one per line of --input (a file or '-' for stdin)."""
    if (args.sentence is None) == (args.input is None):
        raise QkvError("give one sentence to translate or --input FILE (or '-' for stdin), not both or neither")
    if args.sentence is not None:
        lines = [args.sentence]
    elif args.input == "-":
        lines = sys.stdin.read().splitlines()
    else:
        path = Path(args.input)
        if not path.is_file():
            raise QkvError(f"input file {path} does not exist")
        lines = path.read_text(encoding="utf-8").splitlines()
    sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise QkvError("nothing to translate: the sentence is empty")
    return sentences


def cmd_translate(args: argparse.Namespace) -> int:
    """Print one translation per input sentence; optionally write cross-attention maps."""
    from qkv.training.trainer import resolve_device
    from qkv.translation.run import load_translation

    if args.beam < 1:
        raise QkvError(f"--beam must be ≥ 1, got {args.beam}")
    sentences = _sentences(args)
    run = _with_penalties(load_translation(args.run_dir, args.checkpoint, resolve_device(args.device)), args)
    for line in run.translate(sentences, args.beam):
        print(line)
    if args.attention_maps:
        from qkv.translation.attention_maps import save_cross_attention_maps

        paths = save_cross_attention_maps(run, sentences[0], Path(args.attention_maps), args.beam)
        print(f"cross-attention maps: {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    """Add `qkv translate` to the command's sub-parsers."""
    p = sub.add_parser("translate", help="translate German sentences with a run from `qkv train translate`")
    p.set_defaults(handler=cmd_translate)
    p.add_argument("run_dir", help="a run directory written by `qkv train translate`")
    p.add_argument("sentence", nargs="?", help="a German sentence (or use --input)")
    p.add_argument("--input", help="a file with one sentence per line, or '-' for stdin")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy; default 4)")
    add_penalty_options(p)
    p.add_argument("--attention-maps", metavar="OUTDIR", help="write one cross-attention PNG per layer here")
    p.add_argument("--checkpoint", default="best", help="best or last")
    p.add_argument("--device", default="auto")
