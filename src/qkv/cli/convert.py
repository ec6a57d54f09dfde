"""`qkv convert SRC DST`: a Hugging Face model (directory or .gguf) → a qkv directory, or back to HF.

    qkv convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2/      # qkv run directory, then:
    qkv generate smollm2/ --prompt "The capital of France is" --temperature 0
    qkv convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf/ --to hf   # dequantised fp32 HF checkpoint
    qkv convert opus-mt-de-en/ marian-copy/ --to hf                    # MarianMT through qkv's Transformer

--to qkv (default) writes config.json + model.safetensors under qkv's own tensor names + the
tokenizer; decoder-only models become a run directory that `qkv generate` and `qkv eval` read.
--to hf writes what transformers' from_pretrained reads: GPT-2 and Llama language models, and
MarianMT translation models (config.json, model.safetensors, generation_config.json, tokenizer).
SRC may also be a qkv directory (a run, or --to qkv's output), to write it --to hf.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id")


def register(sub: Any) -> None:
    """Add the `convert` sub-command to the `qkv` parser."""
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face model (directory or .gguf) to a qkv directory or back to HF",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(handler=_cmd_convert)
    p.add_argument(
        "src",
        help="a Hugging Face model directory (config.json + safetensors), a .gguf file, or a qkv "
        "directory (for --to hf)",
    )
    p.add_argument("dst", help="the directory to write (must not exist, or be empty)")
    p.add_argument(
        "--to",
        choices=("qkv", "hf"),
        default="qkv",
        help="qkv: a qkv model directory (default); hf: a Hugging Face directory (GPT-2, Llama, Marian)",
    )


@dataclass
class _Source:
    """What SRC holds: the model, its tokenizer, its family's name, and the HF files' settings."""

    model: Any
    tokenizer: Any
    name: str
    exportable: bool  # False: a family that converts to qkv only
    token_ids: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] | None = None  # a Marian source's generation_config.json


def _read(src: Path) -> _Source:
    """Read SRC once (a GGUF file is dequantised here): a Hugging Face checkpoint, or a qkv directory."""
    from qkv.interop import family_of, from_hf, marian, read_checkpoint, read_marian_tokenizer, tokenizer_from_hf
    from qkv.interop.marian_tokenizer import read_tokenizer
    from qkv.interop.qkv_dir import is_qkv_dir, load_qkv
    from qkv.io.files import load_json

    if is_qkv_dir(src):
        return _Source(load_qkv(src), read_tokenizer(src), "qkv", exportable=True)  # a fine-tuned Marian's too
    ckpt = read_checkpoint(src)
    family = family_of(ckpt.config)
    model = from_hf(ckpt)
    if family is not marian.FAMILY:
        ids = {k: ckpt.config.get(k) for k in _TOKEN_IDS[:3]}
        return _Source(model, tokenizer_from_hf(ckpt), family.name, family.config_to_hf is not None, ids)
    generation = src / marian.GENERATION_FILE
    return _Source(model, read_marian_tokenizer(src), family.name, True, {k: ckpt.config.get(k) for k in _TOKEN_IDS},
                   load_json(generation) if generation.is_file() else None)  # fmt: skip


def _translation_ids(source: _Source) -> dict[str, Any]:
    """A qkv translation run's <pad> <s> </s> as config.json's ids (none for another tokenizer)."""
    from qkv.translation.run import specials_of

    try:
        sp = specials_of(source.tokenizer)
    except QkvError:
        return {}
    return {"pad_token_id": sp.pad, "decoder_start_token_id": sp.bos, "eos_token_id": sp.eos,
            "forced_eos_token_id": sp.eos}  # fmt: skip


def _write_hf(source: _Source, dst: Path) -> None:
    """Write SRC's model as a Hugging Face directory, or say in one line why it has none."""
    from qkv.interop import export_family, save_hf
    from qkv.interop.marian_tokenizer import MarianTokenizer
    from qkv.models import DecoderLM, Transformer

    model = source.model
    if not source.exportable:
        raise QkvError(f"--to hf writes GPT-2, Llama and Marian models; {source.name} converts to qkv only")
    if not isinstance(model, (DecoderLM, Transformer)):
        raise QkvError(f"--to hf writes GPT-2, Llama and Marian models, not a {type(model).__name__}")
    export_family(model)  # refuses, naming what keeps the model from each family, before anything is written
    ids = source.token_ids
    if isinstance(model, Transformer) and source.name == "qkv" and not isinstance(source.tokenizer, MarianTokenizer):
        ids = _translation_ids(source)
    save_hf(model, dst, source.tokenizer, token_ids=ids, generation=source.generation)


def _cmd_convert(args: argparse.Namespace) -> int:
    """Read SRC once, build the qkv model, write DST."""
    from qkv.interop.marian_tokenizer import MarianTokenizer
    from qkv.interop.qkv_dir import save_qkv
    from qkv.models import DecoderLM

    dst = Path(args.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QkvError(f"{dst} already exists and is not empty; choose a new output directory")
    source = _read(Path(args.src))
    model, tokenizer = source.model, source.tokenizer
    if args.to == "qkv" and source.name == "qkv":
        raise QkvError(f"{args.src} is a qkv directory already; convert it --to hf")
    if args.to == "qkv":
        qkv_tokenizer = None if isinstance(tokenizer, MarianTokenizer) else tokenizer  # Marian's stays in SRC
        save_qkv(model, dst, qkv_tokenizer, source=str(args.src))
    else:
        _write_hf(source, dst)
    n_params = sum(p.numel() for p in model.parameters())
    kind = "Hugging Face" if args.to == "hf" else "qkv"
    note = "" if tokenizer is not None else " (no tokenizer found)"
    if args.to == "qkv" and isinstance(tokenizer, MarianTokenizer):
        note = " (the Marian tokenizer is not copied: `qkv translate` reads the MarianMT directory itself)"
    print(f"{args.src}: {source.name}, {n_params / 1e6:.1f}M parameters → {kind} directory {dst}{note}")
    if args.to == "qkv" and isinstance(model, DecoderLM) and tokenizer is not None:
        print(f"try: qkv generate {dst} --prompt 'Once upon a time' --temperature 0 --max-new-tokens 40")
    if args.to == "hf" and isinstance(tokenizer, MarianTokenizer):
        print(f"try: qkv translate {dst} 'Wie geht es dir?'")
    return 0
