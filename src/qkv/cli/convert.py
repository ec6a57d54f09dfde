"""`qkv convert SRC DST`: a Hugging Face model (directory or .gguf) → a qkv directory, or back to HF.

    qkv convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2/      # qkv run directory, then:
    qkv generate smollm2/ --prompt "The capital of France is" --temperature 0
    qkv convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf/ --to hf   # dequantised fp32 HF checkpoint

--to qkv (default) writes config.json + model.safetensors under qkv's own tensor names + the
tokenizer; decoder-only models become a run directory that `qkv generate` and `qkv eval` read.
--to hf writes what transformers' from_pretrained reads (GPT-2 and Llama families only).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from qkv.errors import QkvError


def register(sub: Any) -> None:
    """Add the `convert` sub-command to the `qkv` parser."""
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face model (directory or .gguf) to a qkv directory or back to HF",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(handler=_cmd_convert)
    p.add_argument("src", help="a Hugging Face model directory (config.json + safetensors) or a .gguf file")
    p.add_argument("dst", help="the directory to write (must not exist, or be empty)")
    p.add_argument(
        "--to",
        choices=("qkv", "hf"),
        default="qkv",
        help="qkv: a qkv model directory (default); hf: a Hugging Face directory (GPT-2, Llama)",
    )


def _cmd_convert(args: argparse.Namespace) -> int:
    """Read SRC once, build the qkv model, write DST."""
    from qkv.interop import export_family, family_of, from_hf, read_checkpoint, save_hf, tokenizer_from_hf
    from qkv.interop.qkv_dir import save_qkv
    from qkv.models import DecoderLM

    dst = Path(args.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QkvError(f"{dst} already exists and is not empty; choose a new output directory")
    ckpt = read_checkpoint(args.src)  # read once: a GGUF file is dequantised here
    family = family_of(ckpt.config)
    model = from_hf(ckpt)
    tokenizer = tokenizer_from_hf(ckpt)
    if args.to == "qkv":
        save_qkv(model, dst, tokenizer, source=str(args.src))
    elif isinstance(model, DecoderLM) and export_family(model):  # export_family refuses before writing
        ids = {k: ckpt.config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        save_hf(model, dst, tokenizer, token_ids=ids)
    else:
        raise QkvError(f"--to hf writes GPT-2 and Llama models; {family.name} converts to qkv only")
    n_params = sum(p.numel() for p in model.parameters())
    kind = "Hugging Face" if args.to == "hf" else "qkv"
    note = "" if tokenizer is not None else " (no tokenizer found)"
    print(f"{args.src}: {family.name}, {n_params / 1e6:.1f}M parameters → {kind} directory {dst}{note}")
    if args.to == "qkv" and isinstance(model, DecoderLM) and tokenizer is not None:
        print(f"try: qkv generate {dst} --prompt 'Once upon a time' --temperature 0 --max-new-tokens 40")
    return 0
