"""The `qkv` command: train, generate, eval.

Every user mistake ends in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from qkv.bench import register as _add_bench
from qkv.errors import QkvError
from qkv.interop.cli import register as _add_convert
from qkv.lab.cli import register as _add_lab
from qkv.training.config import DTYPES
from qkv.translation.cli import add_penalty_options
from qkv.translation.cli import register as _add_translate


class _Parser(argparse.ArgumentParser):
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


def _add_train(sub: Any) -> None:
    """`qkv train` and its options (defaults live in TrainConfig: the speed-tuned recipe)."""
    p = sub.add_parser("train", help="train a character- or BPE-level language model")
    p.set_defaults(handler=_cmd_train)
    p.add_argument("task", nargs="?", default="lm", choices=("lm", "translate"),
                   help="lm (default): the language model; translate: German → English (qkv.translation)")  # fmt: skip
    p.add_argument("--batch-tokens", type=int, help="translate: padded tokens per side per batch")
    p.add_argument("--label-smoothing", type=float, help="translate: label smoothing ε (default 0.1)")
    p.add_argument("--data", help="UTF-8 text file to train on (default: the embedded Shakespeare corpus)")
    p.add_argument("--tokenizer", help="char (default) or bpe (byte-level BPE trained on the train split)")
    p.add_argument("--vocab-size", type=int, dest="bpe_vocab_size", help="BPE vocabulary size (default 1024)")
    p.add_argument("--n-layers", type=int, help="decoder layers")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--n-heads", type=int, help="attention heads")
    p.add_argument("--dropout", type=float, help="dropout probability")
    p.add_argument("--model", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="any DecoderLMConfig field, e.g. --model positions=rotary --model norm=rms")  # fmt: skip
    p.add_argument("--block-size", type=int, help="context length in tokens")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimiser step")
    p.add_argument("--max-steps", type=int, help="optimiser steps (the schedule's length)")
    p.add_argument("--max-time", type=float, help="stop after this many seconds (checkpoint saved)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--min-lr", type=float, help="final learning rate (default: lr/20; translate: 0)")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps")
    p.add_argument("--schedule", help="cosine, linear, constant or inverse_sqrt")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices")
    p.add_argument("--grad-clip", type=float, help="max gradient norm (0 = off)")
    p.add_argument("--eval-interval", type=int, help="steps between evaluations/checkpoints")
    p.add_argument("--eval-tokens", type=int, help="val tokens read at periodic evals (default: all)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (autocast)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--nproc", type=int, help="train on N local processes (torch's elastic launcher, like torchrun)")
    p.add_argument("--strategy", help="with several processes: ddp (default) or fsdp (sharded parameters)")
    p.add_argument("--dist-timeout", type=float, help="seconds to wait for a dead or hung process (default 60)")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--out-dir", help="run directory (default runs/<data>-<tokenizer>-<time>)")
    p.add_argument("--resume", action="store_true", default=None, help="continue the run in --out-dir")
    p.add_argument("--sample-tokens", type=int, help="tokens to sample after training (0 = none)")


def _add_generate(sub: Any) -> None:
    """`qkv generate`."""
    p = sub.add_parser("generate", help="sample text from a trained run, streamed as it is produced")
    p.set_defaults(handler=_cmd_generate)
    p.add_argument("run_dir", help="a run directory written by `qkv train`")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--checkpoint", default="best", help="best or last")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations while decoding; bfloat16 reads half the bytes per token")  # fmt: skip


def _add_eval(sub: Any) -> None:
    """`qkv eval`."""
    p = sub.add_parser("eval", help="loss and perplexity over the whole validation split")
    p.set_defaults(handler=_cmd_eval)
    p.add_argument("run_dir", help="a run directory written by `qkv train`")
    p.add_argument("--checkpoint", default="best", help="best or last")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--beam", type=int, default=4, help="translation runs: beam size compared with greedy")
    add_penalty_options(p)


def build_parser() -> argparse.ArgumentParser:
    """The full `qkv` argument parser."""
    parser = _Parser(prog="qkv", description="qkv — the Transformer, complete.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    # Each command registers its own sub-parser and sets `handler`; feature rooms add theirs here.
    for register in (_add_train, _add_generate, _add_eval, _add_convert, _add_translate, _add_lab, _add_bench):
        register(sub)
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    """Train, report the full-validation loss, print a sample."""
    if args.task == "translate":
        from qkv.translation.cli import cmd_train_translate

        return cmd_train_translate(args)
    if args.batch_tokens is not None or args.label_smoothing is not None:
        raise QkvError("--batch-tokens and --label-smoothing are options of `qkv train translate`")
    from qkv.training import TrainConfig, load, perplexity, train

    names = ("data", "tokenizer", "bpe_vocab_size", "block_size", "batch_size", "grad_accum", "max_steps",
             "max_time", "lr", "min_lr", "warmup_steps", "schedule", "weight_decay", "grad_clip", "eval_interval",
             "eval_tokens", "device", "dtype", "compile", "seed", "out_dir", "resume", "sample_tokens", "strategy",
             "dist_timeout")  # fmt: skip
    settings = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    model = {k: getattr(args, k) for k in ("n_layers", "d_model", "n_heads", "dropout") if getattr(args, k) is not None}
    model.update(dict(args.model))
    if model:
        settings["model"] = model  # merged over the default recipe's model by TrainConfig
    if args.resume and not args.out_dir:
        raise QkvError("--resume needs --out-dir: the run directory to continue")
    cfg = TrainConfig(**settings)  # checked here, once, before any process is launched
    if args.nproc is not None:
        from qkv.training.distributed import launch

        if args.nproc < 1:
            raise QkvError(f"--nproc must be a positive integer, got {args.nproc}")
        argv = _without_nproc(args.argv)
        if cfg.out_dir is None:  # choose the timestamped default once, for all the processes
            from qkv.training.trainer import default_run_dir

            cfg.out_dir = str(default_run_dir(cfg))
            argv += ["--out-dir", cfg.out_dir]
        return launch(args.nproc, argv, cfg.out_dir)
    result = train(cfg)
    from qkv.training.distributed import is_main_process

    if not is_main_process():  # under torchrun, rank 0 reports for the run
        return 130 if result.interrupted else 0
    print(f"\nvalidation loss {result.val_loss:.4f} (perplexity {perplexity(result.val_loss):.2f}) "
          f"after {result.step} steps, {result.elapsed_s:.0f} s — run saved in {result.run_dir}")  # fmt: skip
    if cfg.sample_tokens > 0:
        run = load(result.run_dir)
        prompt = "\n" if "\n" in getattr(run.tokenizer, "chars", "\n") else ""
        print("\n--- sample " + "-" * 60)
        print(run.generate(prompt or run.tokenizer.decode([0]), cfg.sample_tokens, temperature=0.8, seed=cfg.seed))
        print("-" * 71)
    print(f"more: qkv generate {result.run_dir} --prompt 'ROMEO:'   |   qkv eval {result.run_dir}")
    return 130 if result.interrupted else 0


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line minus --nproc N (or an abbreviation of it): what each launched process runs."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token.startswith("--np") and "--nproc".startswith(token.split("=", 1)[0]):
            skip = "=" not in token
        else:
            out.append(token)
    return out


class _TextStream:
    """Text of a growing token sequence, piece by piece, decoding only the newest tokens (not O(T²))."""

    def __init__(self, decode: Callable[[list[int]], str], context: list[int]) -> None:
        self._decode = decode
        self._tail = context[-4:]  # a few printed tokens: SentencePiece-style decoders need the left context
        self._pending: list[int] = []  # tokens not printed yet

    def push(self, token: int) -> str:
        """Text that `token` completes ('' while a multi-byte character or a rewrite is incomplete)."""
        self._pending.append(token)
        return self._flush(final=False)

    def end(self) -> str:
        """Whatever is left, printed as is."""
        return self._flush(final=True)

    def _flush(self, final: bool) -> str:
        before, after = self._decode(self._tail), self._decode(self._tail + self._pending)
        if after.endswith("\ufffd") and not final:  # wait for the rest of the character
            return ""
        # A decoder that rewrites text it already printed (e.g. cleaning up spaces) cannot be undone on a
        # terminal: print what differs from the common prefix and go on.
        common = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after))
        )
        piece = after[common:]
        self._tail, self._pending = (self._tail + self._pending)[-4:], []
        return piece


def _cmd_generate(args: argparse.Namespace) -> int:
    """Stream samples to stdout."""
    from qkv.generation import stream
    from qkv.training import load
    from qkv.training.trainer import resolve_device

    if args.num_samples < 1:
        raise QkvError(f"--num-samples must be ≥ 1, got {args.num_samples}")
    run = load(args.run_dir, args.checkpoint, resolve_device(args.device))
    device = next(run.model.parameters()).device
    run.model.to(getattr(torch, args.dtype))  # the model only: token ids and the sampling stay as they are
    if args.prompt == "":
        raise QkvError("--prompt is empty; give at least one character to continue")
    prompt_ids = run.tokenizer.encode_tensor(args.prompt).to(device)
    ids = prompt_ids[None, :].repeat(args.num_samples, 1)  # (N, T): one row per sample
    gen = torch.Generator(device=device).manual_seed(args.seed) if args.seed is not None else None
    texts = [[] for _ in range(args.num_samples)]  # type: list[list[int]]
    streamed = _TextStream(run.tokenizer.decode, prompt_ids.tolist())  # sample 1, when it is the only one
    # stream() checks the sampling options now, before anything is printed.
    steps = stream(run.model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   run.tokenizer.eos_id, not args.no_cache, gen)  # fmt: skip
    if args.num_samples == 1:
        sys.stdout.write(args.prompt)
    for step in steps:
        for row, token in enumerate(step.tolist()):
            if token != run.tokenizer.eos_id:
                texts[row].append(token)
                if args.num_samples == 1:
                    sys.stdout.write(streamed.push(token))
                    sys.stdout.flush()
    if args.num_samples == 1:
        sys.stdout.write(streamed.end() + "\n")
    else:
        for row, tokens in enumerate(texts):
            print(f"--- sample {row + 1} ---\n{args.prompt}{run.tokenizer.decode(tokens)}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Print loss and perplexity over the whole validation split (BLEU/chrF on the test split for translation)."""
    from qkv.translation.run import model_type

    if model_type(args.run_dir) == "transformer":
        from qkv.translation.cli import cmd_eval_translate

        return cmd_eval_translate(args)
    if args.length_penalty is not None or args.coverage_penalty is not None:
        raise QkvError("--length-penalty and --coverage-penalty are for translation runs (beam search)")
    from qkv.training import evaluate_loss, load, perplexity
    from qkv.training.dataset import prepare_text_data
    from qkv.training.trainer import resolve_device

    run = load(args.run_dir, args.checkpoint, resolve_device(args.device))
    cfg = run.train_config
    data = prepare_text_data(cfg.data, cfg.tokenizer, cfg.bpe_vocab_size, run.tokenizer)
    device = next(run.model.parameters()).device
    block_size = cfg.block_size  # the windows training evaluated on, whatever max_positions the model allows
    loss = evaluate_loss(run.model, data.val_ids, block_size, args.batch_size, device)
    print(f"val loss {loss:.4f}  perplexity {perplexity(loss):.3f}  "
          f"({len(data.val_ids) - 1:,} positions, block size {block_size}, {args.checkpoint} weights)")  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `qkv` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for --nproc, which relaunches the command
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args))
    except QkvError as e:
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
