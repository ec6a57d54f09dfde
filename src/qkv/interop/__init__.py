"""Real checkpoints: Hugging Face models (and GGUF files) in, qkv models built from qkv's own blocks out.

    model = qkv.from_hf("path/to/hf-model")     # a directory with config.json + safetensors, or a .gguf
    qkv.save_hf(model, "out/")                  # GPT-2- and Llama-shaped DecoderLMs, Marian-shaped Transformers

Nothing here imports transformers: config.json is plain JSON, weights come from safetensors (pickle
is refused), and each family module maps the HF names and layouts onto qkv's. FAMILIES is keyed by
config.json's model_type; a new family is one module with a FAMILY plus one entry in _BUILTIN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.interop import bart, bert, deepseek, gpt2, llama, marian
from qkv.interop.hf_io import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    Checkpoint,
    Family,
    export_mapped,
    load_mapped,
    read_checkpoint,
    write_checkpoint,
    write_tokenizer,
)
from qkv.interop.marian_tokenizer import MarianTokenizer, is_marian_tokenizer_dir
from qkv.interop.quantized import materialise, place_quantized, skipped_init
from qkv.io.devices import release_freed_memory
from qkv.io.files import atomic_write_json, load_json
from qkv.models import DecoderLM, QkvConfig, QkvModel, Transformer, build_model, model_type_of
from qkv.tokenizers import ByteBPETokenizer, Tokenizer

FAMILIES: dict[str, Family] = {}  # config.json model_type → family


def register_family(family: Family) -> None:
    """Make from_hf read every model_type the family lists (and save_hf consider it for export)."""
    for model_type in family.model_types:
        FAMILIES[model_type] = family


_BUILTIN = (gpt2.FAMILY, llama.FAMILY, bert.FAMILY, bart.FAMILY, deepseek.FAMILY, marian.FAMILY)
for _family in _BUILTIN:
    register_family(_family)


def family_of(config: dict[str, Any]) -> Family:
    """The family that reads a config.json, by its model_type."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise QkvError(f"unsupported model_type {model_type!r}: qkv reads {known}")
    return FAMILIES[model_type]


def from_hf(source: str | Path | Checkpoint, native: bool = False) -> QkvModel:
    """A qkv model (eval mode, fp32) with the weights of an HF directory, a .gguf file or a read Checkpoint; with
    `native`, a GGUF file's quantised matrices stay quantised (for inference: qkv.quantization.GroupLinear)."""
    ckpt = source if isinstance(source, Checkpoint) else read_checkpoint(source, native)
    family = family_of(ckpt.config)
    cfg = family.config_from_hf(ckpt.config, [*ckpt.tensors, *ckpt.quantized])
    if not ckpt.quantized:
        model = build_model(cfg)
        load_mapped(model, ckpt, family, family.name_map(cfg))
        return model.eval()
    with torch.device("meta"), skipped_init():  # no float copy of the matrices that stay quantised, not even briefly
        model = build_model(cfg)
    name_map = family.name_map(cfg)
    done = place_quantized(model, ckpt, name_map)
    materialise(model)
    load_mapped(model, ckpt, family, name_map, done)
    release_freed_memory()  # the codes were decoded one matrix at a time: give the scratch back
    return model.eval().requires_grad_(False)


def config_of(source: str | Path) -> QkvConfig:
    """The model config of a .gguf file or a Hugging Face directory, read without the weights."""
    from safetensors import safe_open

    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from qkv.interop.gguf_reader import read_gguf_config

        config, names = read_gguf_config(path), []  # (a Llama's config needs no tensor names)
    else:
        if not (path / CONFIG_FILE).is_file():
            raise QkvError(f"{path} has no {CONFIG_FILE}: not a Hugging Face model directory")
        config = load_json(path / CONFIG_FILE)
        index = path / WEIGHTS_INDEX
        if index.is_file():
            names = list(load_json(index).get("weight_map") or {})
        else:
            with safe_open(str(path / WEIGHTS_FILE), "pt") as f:  # the header alone: the names, not the tensors
                names = list(f.keys())
    return family_of(config).config_from_hf(config, names)


def tokenizer_from_hf(source: str | Path | Checkpoint) -> ByteBPETokenizer | None:
    """The checkpoint's tokenizer (tokenizer.json, vocab.json + merges.txt, or GGUF metadata), or None.

    Its eos is config.json's eos_token_id. Passing a .gguf path reads (and dequantises) the whole file:
    pass the Checkpoint from read_checkpoint when the model is loaded too.
    """
    from qkv.tokenizers.gpt2 import read_vocab_files

    if not isinstance(source, Checkpoint) and Path(source).suffix.lower() == ".gguf":
        source = read_checkpoint(source)
    if isinstance(source, Checkpoint):
        directory, tok, config = Path(source.source), source.tokenizer, source.config
    else:
        directory, tok, config = Path(source), None, {}
        if (directory / "config.json").is_file():
            config = load_json(directory / "config.json")
    if tok is None and (directory / "tokenizer.json").is_file():
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    elif tok is None and (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        tok = read_vocab_files(directory / "vocab.json", directory / "merges.txt")
    if tok is None:
        return None
    eos_id = config.get("eos_token_id")
    eos = tok.id_to_token(eos_id) if isinstance(eos_id, int) else None
    return ByteBPETokenizer(tok, eos) if eos else ByteBPETokenizer(tok)


def tokenizer_of(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint: a qkv run or `qkv convert` directory, a Hugging Face directory or a .gguf."""
    from qkv.interop.marian_tokenizer import read_tokenizer
    from qkv.interop.qkv_dir import is_qkv_dir

    path = Path(path)
    if not path.exists():
        raise QkvError(f"checkpoint not found: {path}")
    tokenizer: Tokenizer | None = None
    if path.is_dir() and is_qkv_dir(path):
        tokenizer = read_tokenizer(path)
    elif path.is_dir() or path.suffix.lower() == ".gguf":
        tokenizer = read_marian_tokenizer(path) if path.is_dir() else None
        tokenizer = tokenizer or tokenizer_from_hf(path)
    if tokenizer is None:
        raise QkvError(f"{path} holds no tokenizer qkv reads (a qkv run, a Hugging Face directory with tokenizer.json "
                       "or vocab.json + merges.txt, or a .gguf file)")  # fmt: skip
    return tokenizer


def read_marian_tokenizer(directory: str | Path) -> MarianTokenizer | None:
    """The Marian tokenizer (source.spm, target.spm, vocab.json) of a directory, or None where it has none."""
    return MarianTokenizer(directory) if is_marian_tokenizer_dir(directory) else None


def export_family(model: DecoderLM | Transformer) -> Family:
    """The family a DecoderLM or Transformer can be written as, or a QkvError saying what keeps it from each."""
    reasons = []
    model_type = model_type_of(model)
    for family in dict.fromkeys(FAMILIES.values()):  # each family once, in registration order
        if family.config_to_hf is None or family.export_problems is None or family.exports != model_type:
            continue
        problems = family.export_problems(model.cfg)
        if not problems:
            return family
        reasons.append(f"not {family.name}: {', '.join(problems)}")
    raise QkvError(f"this {type(model).__name__} has no Hugging Face equivalent ({'; '.join(reasons)})")


def save_hf(
    model: DecoderLM | Transformer,
    directory: str | Path,
    tokenizer: ByteBPETokenizer | MarianTokenizer | None = None,
    token_ids: dict[str, int | None] | None = None,
    generation: dict[str, Any] | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ the tokenizer) that transformers' from_pretrained loads.

    token_ids: bos_token_id / eos_token_id / pad_token_id (and a Transformer's decoder_start_token_id and
    forced_eos_token_id) for config.json; a qkv model does not know them, so they default to None, except
    eos, which the tokenizer names when one is given, and a Transformer's pad and decoder start, its pad_id.
    generation: a Transformer's generation_config.json (default: OPUS-MT's settings).
    """
    if not isinstance(model, (DecoderLM, Transformer)):
        raise QkvError(f"save_hf writes decoder-only LMs and encoder–decoders, not a {type(model).__name__}")
    family = export_family(model)
    assert family.config_to_hf is not None
    config = family.config_to_hf(model.cfg)
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    eos = tokenizer.eos_id if tokenizer is not None else None
    if isinstance(model, Transformer):
        ids = marian.token_ids(model.cfg, token_ids or {}, eos)
        generation = generation or marian.generation_config(ids, model.cfg.context_length)
        config |= ids
    else:
        config |= {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None, **(token_ids or {})}
    tensors = export_mapped(model, family.name_map(model.cfg))
    directory = write_checkpoint(directory, config, tensors)
    if generation is not None:
        atomic_write_json(directory / marian.GENERATION_FILE, generation)
    if isinstance(tokenizer, MarianTokenizer):
        tokenizer.save(directory)
    elif tokenizer is not None:
        write_tokenizer(directory, tokenizer)
    return directory


__all__ = [
    "FAMILIES",
    "Checkpoint",
    "Family",
    "config_of",
    "export_family",
    "family_of",
    "from_hf",
    "read_checkpoint",
    "read_marian_tokenizer",
    "register_family",
    "save_hf",
    "tokenizer_from_hf",
    "tokenizer_of",
]
