"""GGUF (llama.cpp's format) → a Hugging Face Llama checkpoint in memory: fp32 tensors, config, tokenizer.

Three things differ from a Hugging Face directory:
- tensors may be quantised (Q4_1, Q8_0, …): gguf.quants.dequantize turns them back into fp32;
- names and metadata are llama.cpp's (blk.0.attn_q.weight, llama.embedding_length): mapped below;
- llama.cpp's converter permutes the rows of W_q and W_k inside every head so that rotary pairs
  are adjacent (x0, y0, x1, y1, …, GPT-J style) instead of split into halves (x0, x1, …, y0, y1, …,
  the rotate-half style of HF and qkv). `_unpermute` undoes it; without it the model still runs
  but attends to garbage positions.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.extras import require
from qkv.interop.checkpoint import Checkpoint
from qkv.quantization import BLOCKS, Blocks

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp pre-tokenizer names whose regex is GPT-2's after splitting every digit apart.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_PRE = "gpt-2"  # llama.cpp's name for GPT-2's own regex ("gpt2" is the tokenizer model's name)
_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_end|>


def _import_gguf() -> Any:
    """The gguf package, or a QkvError saying how to get it."""
    return require("gguf", "hf", "reading .gguf files")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value: int/float/bool/str, or a list of them for arrays."""
    field = reader.fields.get(key)
    if field is None:
        return default
    gguf = _import_gguf()
    types = field.types

    def one(part: Any, kind: Any) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        # float32 metadata (1e-5 stored as 9.9999997e-06): its shortest float32 spelling is what was meant.
        return float(str(np.float32(value))) if kind == gguf.GGUFValueType.FLOAT32 else value

    if types[0] == gguf.GGUFValueType.ARRAY:
        return [one(field.parts[i], types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], types[0])


def _hf_name(name: str) -> str:
    """The HF Llama name of a llama.cpp tensor name (blk.3.attn_q.weight → model.layers.3.self_attn.q_proj.weight)."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    raise QkvError(f"GGUF tensor {name} has no Llama counterpart (rope_freqs and the like are not supported)")


def _unpermute(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's per-head row permutation: interleaved rotary pairs back to two halves."""
    head_dim = w.shape[0] // n_heads
    # llama.cpp did reshape(n_heads, 2, D/2, …).swapaxes(1, 2); the inverse swaps back.
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(reader: Any, names: Collection[str], n_vocab: int) -> dict[str, Any]:
    """An HF LlamaConfig dict from the llama.* metadata."""

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"llama.{key}", default)
        if value is None:
            raise QkvError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    if get("rope.dimension_count", hidden // heads) != hidden // heads:
        raise QkvError("GGUF llama.rope.dimension_count differs from the head size: partial rotary is not supported")
    scaling, factor = get("rope.scaling.type", "none"), get("rope.scaling.factor", 1.0)
    if scaling not in ("none", "linear") or factor != 1.0:
        raise QkvError(f"GGUF rope scaling {scaling!r} (factor {factor}) is not supported")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": get("vocab_size", n_vocab),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in names,  # no output.weight: the head reuses token_embd
        # Optional in llama.cpp's Llama: blk.N.attn_q.bias …, blk.N.ffn_up.bias … (llama.config_from_hf checks them).
        "attention_bias": any(".self_attn." in n and n.endswith(".bias") for n in names),
        "mlp_bias": any(".mlp." in n and n.endswith(".bias") for n in names),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        # Not LlamaConfig fields: kept so that writing the model back as GGUF (gguf_writer.py) loses nothing.
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "gguf_pre_tokenizer": _field(reader, "tokenizer.ggml.pre"),
        "sampling": _sampling(reader),  # the file's advice to whoever samples from it (qkv chat), if it has any
    }


def _sampling(reader: Any) -> dict[str, Any] | None:
    """general.sampling.temp, top_k and top_p, as the sampling the file recommends (None: it recommends none)."""
    found = {name: _field(reader, f"general.sampling.{key}") for name, key in
             (("temperature", "temp"), ("top_k", "top_k"), ("top_p", "top_p"))}  # fmt: skip
    return found if any(v is not None for v in found.values()) else None


def _tokenizer(reader: Any) -> Any:
    """The HF `tokenizers.Tokenizer` described by tokenizer.ggml.*, or None if it is not a byte-level BPE."""
    from qkv.tokenizers.byte_level import byte_level_bpe

    model, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in ("default", "gpt2", _GPT2_PRE, *_DIGIT_SPLIT_PRE):
        warnings.warn(f"GGUF tokenizer {model}/{pre} is not supported; loading the model without one", stacklevel=3)
        return None
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    return byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, specials, split_digits=pre in _DIGIT_SPLIT_PRE)


def _open(path: Path) -> Any:
    """A GGUFReader over a llama-architecture file (it maps the file: nothing is read until asked for)."""
    gguf = _import_gguf()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise QkvError(f"{path} is not a GGUF file (it does not start with GGUF's magic bytes)")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct.error … where the file stops short
        raise QkvError(f"{path} is incomplete or damaged: it ends before the data its header describes "
                       f"({path.stat().st_size:,} bytes); copy or download it again") from e  # fmt: skip
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise QkvError(f"GGUF architecture {arch!r} is not supported: qkv reads llama-architecture GGUF files")
    return reader


def _config_of(reader: Any, names: Collection[str]) -> dict[str, Any]:
    """The HF config of an open file whose tensors have these HF names."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return _config(reader, names, len(tokens.data) if tokens is not None else 0)


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """A GGUF file's HF config alone, read from its metadata without its tensors."""
    reader = _open(Path(path))
    return _config_of(reader, [_hf_name(t.name) for t in reader.tensors])


def read_gguf(path: str | Path, native: bool = False) -> Checkpoint:
    """A Llama-architecture GGUF file as an HF-named, HF-layout fp32 checkpoint with its tokenizer; with `native`,
    its block-quantised matrices stay quantised (Checkpoint.quantized) where qkv has their format."""
    gguf = _import_gguf()
    path = Path(path)
    reader = _open(path)
    n_heads = _field(reader, "llama.attention.head_count")
    n_kv_heads = _field(reader, "llama.attention.head_count_kv", n_heads)
    tensors: dict[str, Tensor] = {}
    quantized: dict[str, Blocks] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        # GGUF lists dims fastest-first (ggml order); numpy/torch want them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = n_heads if name.endswith("q_proj.weight") else n_kv_heads if name.endswith("k_proj.weight") else 0
        if native and t.tensor_type.name not in (*BLOCKS, "F32", "F16", "BF16"):
            raise QkvError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which qkv cannot run natively (it runs "
                           f"{', '.join(BLOCKS)}); pass --dtype float32 to dequantise the model instead")  # fmt: skip
        if native and t.tensor_type.name in BLOCKS and len(shape) == 2:
            with warnings.catch_warnings():  # read-only: the file's mapped bytes, which qkv only reads
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.asarray(t.data))
            rows = _unpermute(torch.arange(shape[0]), heads) if heads else None
            quantized[name] = Blocks(t.tensor_type.name, raw, (shape[0], shape[1]), rows)
            continue
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping makes dequantising 5x slower.
        array = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        # fp32 tensors come back as views of the read-only file: copy those, so the weights own their memory.
        array = array.astype(np.float32, copy=not array.flags.writeable)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        # llama.cpp's converter permutes the q/k biases (Llama with attention_bias) like the weights' rows.
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute(tensor, n_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute(tensor, n_kv_heads)
        tensors[name] = tensor
    config = _config_of(reader, [*tensors, *quantized])
    return Checkpoint(config, tensors, str(path), _tokenizer(reader), quantized)
