"""`qkv convert SRC DST`: a Hugging Face model (directory or .gguf) → a qkv directory, or back to HF or GGUF.

    qkv convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2/      # qkv run directory, then:
    qkv generate smollm2/ --prompt "The capital of France is" --temperature 0
    qkv convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf/ --to hf   # dequantised fp32 HF checkpoint
    qkv convert opus-mt-de-en/ marian-copy/ --to hf                    # MarianMT through qkv's Transformer
    qkv convert runs/my-lora/ tuned.gguf --to gguf                     # a fine-tuned run, merged, for llama.cpp
    qkv convert runs/my-lora/ adapter/ --to peft                       # its adapters for Hugging Face PEFT
    qkv convert adapter/ merged/ --base SmolLM2.gguf                   # a PEFT adapter merged onto its base

--to qkv (default) writes config.json + model.safetensors under qkv's own tensor names + the
tokenizer; decoder-only models become a run directory that `qkv generate` and `qkv eval` read.
--to hf writes what transformers' from_pretrained reads: GPT-2 and Llama language models, and
MarianMT translation models (config.json, model.safetensors, generation_config.json, tokenizer).
--to gguf writes one llama.cpp file (Llama-shaped language models; f32, or f16 with --dtype float16).
SRC may also be a qkv directory (a run, or --to qkv's output): a LoRA run is written merged, its
adapters folded into its base's weights, except --to peft, which writes the adapters alone. A PEFT
adapter directory (adapter_config.json) is read merged onto its base (--base, or the one it names).
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
        help="convert a model between formats: a Hugging Face directory, a .gguf file or a run → a qkv directory, "
             "a Hugging Face directory, a .gguf file, or a LoRA run's PEFT adapters",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(handler=_cmd_convert)
    p.add_argument("src", help="a Hugging Face model directory (config.json + safetensors), a .gguf file, a run of "
                               "`qkv train` or a `qkv convert` directory")  # fmt: skip
    p.add_argument("dst", help="the directory to write (must not exist, or be empty); a .gguf name writes a GGUF file")
    p.add_argument("--to", choices=("qkv", "hf", "gguf", "peft"),
                   help="qkv: a qkv model directory; hf: a Hugging Face directory (GPT-2, Llama, BART, Marian); "
                        "gguf: a llama.cpp file; peft: a LoRA run's adapters (default: gguf for a DST named *.gguf, "
                        "else qkv)")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "float16", "q8_0", "q4_0", "q4_1"), default="float32",
                   help="--to gguf: the matrices' type; q8_0, q4_0 and q4_1 are llama.cpp's blocks of 32 weights with "
                        "a scale each (8 or 4 bits a weight, about 4× or 7× smaller than float32)")  # fmt: skip
    p.add_argument("--base", help="a PEFT adapter's base checkpoint (default: adapter_config.json's)")


@dataclass
class _Source:
    """What SRC holds: the model, its tokenizer, its family's name, and the HF files' settings."""

    model: Any
    tokenizer: Any
    name: str
    exportable: bool  # False: a family that converts to qkv only
    token_ids: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] | None = None  # a Marian source's generation_config.json
    metadata: dict[str, Any] = field(default_factory=dict)  # special ids, chat template, GGUF pre-tokenizer


def _metadata(directory: Path) -> dict[str, Any]:
    """The special token ids and chat template of the checkpoint a fine-tuned run started from, if any."""
    from qkv.chat import template_source
    from qkv.io.files import load_json

    base = load_json(directory / "config.json").get("base") or {}
    template = template_source(directory)  # a chat run's own (--chat-template), else its checkpoint's
    return {**dict(base.get("metadata") or {}), **({"chat_template": template} if template else {})}


def _read(src: Path, base: str | None = None) -> _Source:
    """Read SRC once (a GGUF file is dequantised here): a Hugging Face checkpoint, or a qkv directory."""
    from qkv.finetune import load_lm_dir, peft_model
    from qkv.finetune.peft import ADAPTER_CONFIG
    from qkv.interop import family_of, from_hf, marian, read_checkpoint, read_marian_tokenizer, tokenizer_from_hf
    from qkv.interop.marian_tokenizer import read_tokenizer
    from qkv.interop.qkv_dir import is_qkv_dir
    from qkv.io.files import load_json

    if is_qkv_dir(src):  # a fine-tuned Marian's too; a LoRA run's adapters merged onto its base
        return _Source(load_lm_dir(src), read_tokenizer(src), "qkv", True, metadata=_metadata(src))
    if (src / ADAPTER_CONFIG).is_file():
        merged = peft_model(src, base)
        return _Source(merged.model, merged.tokenizer, "PEFT adapter", True, metadata=merged.reference["metadata"])
    ckpt = read_checkpoint(src)
    family = family_of(ckpt.config)
    model = from_hf(ckpt)
    if family is not marian.FAMILY:  # an encoder–decoder's (BART's) decoder start and forced eos too
        ids = {k: ckpt.config.get(k) for k in (_TOKEN_IDS if family.exports == "transformer" else _TOKEN_IDS[:3])}
        metadata = {k: ckpt.config[k] for k in ("chat_template", "gguf_pre_tokenizer") if ckpt.config.get(k)}
        return _Source(model, tokenizer_from_hf(ckpt), family.name, family.config_to_hf is not None, ids,
                       metadata=metadata)  # fmt: skip
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
        raise QkvError(f"--to hf writes GPT-2, Llama, BART and Marian models; {source.name} converts to qkv only")
    if not isinstance(model, (DecoderLM, Transformer)):
        raise QkvError(f"--to hf writes GPT-2, Llama, BART and Marian models, not a {type(model).__name__}")
    export_family(model)  # refuses, naming what keeps the model from each family, before anything is written
    ids = source.token_ids or {k: v for k, v in source.metadata.items() if k in _TOKEN_IDS}
    if isinstance(model, Transformer) and source.name == "qkv" and not isinstance(source.tokenizer, MarianTokenizer):
        ids = _translation_ids(source)
    save_hf(model, dst, source.tokenizer, token_ids=ids, generation=source.generation)


def _write_gguf(source: _Source, dst: Path, dtype: str) -> None:
    """Write SRC's language model as one GGUF file for llama.cpp (its tokenizer, ids and chat template with it)."""
    from qkv.interop.gguf_writer import save_gguf
    from qkv.models import DecoderLM
    from qkv.tokenizers import ByteBPETokenizer

    if not isinstance(source.model, DecoderLM) or not isinstance(source.tokenizer, ByteBPETokenizer):
        raise QkvError("--to gguf writes decoder-only language models with a byte-level BPE tokenizer")
    meta = {**source.token_ids, **source.metadata}
    ids = {k: meta.get(k) for k in _TOKEN_IDS[:3]}
    save_gguf(source.model, dst, source.tokenizer, dtype, meta.get("chat_template"), dst.stem,
              meta.get("gguf_pre_tokenizer"), ids)  # fmt: skip


def _write_peft(src: Path, dst: Path) -> None:
    """Write a LoRA run's adapters (not merged) as a PEFT adapter directory."""
    from qkv.finetune import is_lora_run, load_lora_run, lora_of, save_peft
    from qkv.io.run_dir import read_run_config

    if not is_lora_run(src):
        raise QkvError(f"--to peft writes a LoRA run's adapters; {src} is not a LoRA run (train with --lora-rank)")
    stored = read_run_config(src)
    spec = lora_of(stored["training"])
    assert spec is not None
    save_peft(load_lora_run(src, stored, merge=False), dst, spec, stored["base"]["path"])


def _check_destination(dst: Path, to: str) -> None:
    """DST must be new (or an empty directory); a GGUF file's name must end in .gguf."""
    if to == "gguf":
        if dst.suffix.lower() != ".gguf":
            raise QkvError(f"--to gguf writes one file: give DST a .gguf name, e.g. {dst.name or 'model'}.gguf")
        if dst.exists():
            raise QkvError(f"{dst} already exists; choose a new file name")
    elif dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QkvError(f"{dst} already exists and is not empty; choose a new output directory")


def _cmd_convert(args: argparse.Namespace) -> int:
    """Read SRC once, build the qkv model, write DST."""
    from qkv.finetune import is_lora_run
    from qkv.interop.marian_tokenizer import MarianTokenizer
    from qkv.interop.qkv_dir import save_qkv
    from qkv.models import DecoderLM

    dst = Path(args.dst)
    is_gguf = dst.suffix.lower() == ".gguf"
    if args.to is None:
        args.to = "gguf" if is_gguf else "qkv"
    elif is_gguf and args.to != "gguf":
        raise QkvError(f"DST {dst} is named like a GGUF file but --to {args.to} writes a directory; name it "
                       f"{dst.with_suffix('')} or use --to gguf")  # fmt: skip
    _check_destination(dst, args.to)
    if args.to == "peft":
        _write_peft(Path(args.src), dst)
        print(f"{args.src}: LoRA adapters → PEFT adapter directory {dst} (adapter_config.json, "
              "adapter_model.safetensors)")  # fmt: skip
        return 0
    source = _read(Path(args.src), args.base)
    model, tokenizer = source.model, source.tokenizer
    if args.to == "qkv" and source.name == "qkv" and not is_lora_run(args.src):  # a LoRA run: merged, standalone
        raise QkvError(f"{args.src} is a qkv directory already; convert it --to hf or --to gguf")
    if args.to == "qkv":
        qkv_tokenizer = None if isinstance(tokenizer, MarianTokenizer) else tokenizer  # Marian's stays in SRC
        save_qkv(model, dst, qkv_tokenizer, source=str(args.src))
    elif args.to == "gguf":
        _write_gguf(source, dst, args.dtype)
    else:
        _write_hf(source, dst)
    if args.to != "gguf" and source.metadata.get("chat_template"):  # (a GGUF file holds it in its metadata)
        from qkv.chat import ChatTemplate

        ChatTemplate(source.metadata["chat_template"]).save(dst)  # chat_template.jinja, as transformers writes it
    n_params = sum(p.numel() for p in model.parameters())
    kind = {"hf": "Hugging Face directory", "gguf": f"GGUF file ({args.dtype})", "qkv": "qkv directory"}[args.to]
    note = "" if tokenizer is not None else " (no tokenizer found)"
    if args.to == "qkv" and isinstance(tokenizer, MarianTokenizer):
        note = " (the Marian tokenizer is not copied: `qkv translate` reads the MarianMT directory itself)"
    print(f"{args.src}: {source.name}, {n_params / 1e6:.1f}M parameters → {kind} {dst}{note}")
    if args.to == "qkv" and isinstance(model, DecoderLM) and tokenizer is not None:
        print(f"try: qkv generate {dst} --prompt 'Once upon a time' --temperature 0 --max-new-tokens 40")
    if args.to == "hf" and isinstance(tokenizer, MarianTokenizer):
        print(f"try: qkv translate {dst} 'Wie geht es dir?'")
    return 0
