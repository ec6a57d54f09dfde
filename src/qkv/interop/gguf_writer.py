"""A Llama-shaped qkv DecoderLM → a GGUF file that llama.cpp runs (the inverse of gguf_reader.py).

What llama.cpp's convert_hf_to_gguf.py does for a LlamaForCausalLM, from qkv's tensors:
- the tensors under llama.cpp's names, fp32 or fp16 (norms and other 1-D tensors stay fp32, as
  llama.cpp's converter keeps them), no output.weight when the head is tied to the embedding;
- W_q and W_k rows permuted inside every head from rotate-half pairs (x0, x1, …, y0, y1, …) to
  adjacent pairs (x0, y0, x1, y1, …), the layout llama.cpp's rotary kernel expects (`_permute`);
- the tokenizer as llama.cpp's "gpt2" BPE: tokens, token types, merges, and a pre-tokenizer name
  whose split regex is the one qkv's tokenizer uses, so that both cut text into the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from qkv.errors import QkvError
from qkv.extras import require
from qkv.interop import llama
from qkv.interop.gguf_reader import _DIGIT_SPLIT_PRE, _GLOBAL, _GPT2_PRE, _LAYER
from qkv.interop.hf_io import export_mapped
from qkv.io.files import atomic_path
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tokenizers import ByteBPETokenizer

DTYPES = ("float32", "float16", "q8_0", "q4_0", "q4_1")  # the last three: llama.cpp's blocks of 32 weights
# llama.cpp pre-tokenizer names qkv can vouch for: each splits text with GPT-2's regex, digit by digit or not.
_PRE = {False: (_GPT2_PRE,), True: _DIGIT_SPLIT_PRE}
# HF config.json key → the tokenizer.ggml.* key llama.cpp reads the id from.
_TOKEN_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unk_token_id": "unknown_token_id",
    "pad_token_id": "padding_token_id",
}
_HF_TO_GGUF = {hf: gg for gg, hf in _GLOBAL.items()} | {hf: gg for gg, hf in _LAYER.items()}


def _gguf_name(hf_name: str) -> str:
    """The llama.cpp name of an HF Llama tensor name (model.layers.3.self_attn.q_proj.weight → blk.3.attn_q.weight)."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in _HF_TO_GGUF:
        return f"{_HF_TO_GGUF[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # "model", "layers", "3", "self_attn.q_proj"
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{kind}"


def _permute(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's per-head row permutation: rotate-half pairs (two halves) → interleaved (adjacent) pairs."""
    head_dim = w.shape[0] // n_heads
    # convert_hf_to_gguf.py: reshape(n_heads, 2, D/2, …).swapaxes(1, 2); gguf_reader._unpermute is its inverse.
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _splits_digits(tokenizer: ByteBPETokenizer) -> bool:
    """Whether a GPT-2-style tokenizer cuts digits apart before GPT-2's regex (SmolLM2, StarCoder); else a QkvError."""
    config = json.loads(tokenizer.hf_tokenizer.to_str())
    if config["model"].get("type") != "BPE" or not tokenizer.cuts_like_gpt2():
        raise QkvError("GGUF export needs a byte-level BPE tokenizer with GPT-2's pre-tokenizer (as llama.cpp's gpt2)")
    return (config.get("pre_tokenizer") or {}).get("type") == "Sequence"  # cuts_like_gpt2: Digits, then ByteLevel


def _vocab(tokenizer: ByteBPETokenizer, n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id (padded to the model's vocabulary), their llama.cpp token types, and the merges in order."""
    gguf = require("gguf", "hf", "writing .gguf files")
    tok = tokenizer.hf_tokenizer
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if by_id and max(by_id) >= n_vocab:
        raise QkvError(f"the tokenizer has token id {max(by_id)}, beyond the model's vocabulary of {n_vocab}")
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:  # the model's embedding has rows no token uses: llama.cpp needs a token per row
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:  # llama.cpp matches control and user-defined tokens whole, before BPE, as HF does
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.NORMAL))
    # tokenizer.json spells merges "a b" (tokenizers < 0.20) or ["a", "b"]; GGUF wants "a b".
    merges = json.loads(tok.to_str())["model"].get("merges", [])
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def _pre_tokenizer(tokenizer: ByteBPETokenizer, pre: str | None) -> str:
    """The tokenizer.ggml.pre name: `pre` if it splits text as the tokenizer does, else a QkvError; None → inferred."""
    digits = _splits_digits(tokenizer)
    if pre is None:
        return _PRE[digits][0]
    if pre not in _PRE[digits]:
        kind, names = "splits digits apart" if digits else "keeps digit runs together", ", ".join(_PRE[digits])
        raise QkvError(f"pre-tokenizer {pre!r} does not match the tokenizer, which {kind}: use one of {names}")
    return pre


def save_gguf(
    model: DecoderLM,
    path: str | Path,
    tokenizer: ByteBPETokenizer,
    dtype: str = "float32",
    chat_template: str | None = None,
    name: str = "qkv",
    pre: str | None = None,
    token_ids: Mapping[str, int | None] | None = None,
) -> Path:
    """Write a Llama-shaped DecoderLM and its tokenizer as one GGUF file that llama.cpp loads; returns the path.

    dtype: "float32" or "float16" for the matrices (norms stay fp32), or q8_0, q4_0, q4_1: llama.cpp's block
    formats, quantised by gguf-py (matrices whose width is not a multiple of 32 stay float32).
    pre: llama.cpp's pre-tokenizer name ("gpt-2", or "smollm" and the like for tokenizers that split digits); None
    infers it from the tokenizer.
    token_ids: bos_token_id / eos_token_id / unk_token_id / pad_token_id (None: not given), as config.json
    names them; eos defaults to the tokenizer's, bos to eos (GPT-2's convention: <|endoftext|> starts and
    ends a text), unk and pad to none.
    """
    if not isinstance(model, DecoderLM):
        raise QkvError(f"GGUF export writes decoder-only LMs, not a {type(model).__name__}")
    problems = llama.export_problems(model.cfg)
    if problems:
        raise QkvError(f"GGUF export writes Llama-shaped DecoderLMs; this one is not: {', '.join(problems)}")
    if dtype not in DTYPES:
        raise QkvError(f"GGUF dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf = require("gguf", "hf", "writing .gguf files")
    pre_name = _pre_tokenizer(tokenizer, pre)
    ids = _token_ids(tokenizer, token_ids, model.embed.vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # a reader (or a crash) never sees half a file
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        _add_metadata(writer, model.cfg, dtype, name)
        _add_tokenizer(writer, tokenizer, model.embed.vocab_size, pre_name, ids, chat_template)
        for hf_name, array in _tensors(model, dtype):
            kind = gguf.GGMLQuantizationType[dtype.upper()] if dtype.startswith("q") and array.ndim > 1 else None
            if kind is not None and array.shape[-1] % 32 == 0:
                writer.add_tensor(_gguf_name(hf_name), gguf.quants.quantize(array, kind), raw_dtype=kind)
            else:
                writer.add_tensor(_gguf_name(hf_name), array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _token_ids(tokenizer: ByteBPETokenizer, token_ids: Mapping[str, int | None] | None,
               vocab_size: int) -> dict[str, int]:  # fmt: skip
    """The special-token ids to write: those given, eos defaulting to the tokenizer's and bos to eos."""
    # None means "not given": an absent bos is one llama.cpp invents (id 11 for BPE vocabularies), so eos is better.
    given = {k: v for k, v in (token_ids or {}).items() if v is not None}
    ids: dict[str, Any] = {"eos_token_id": tokenizer.eos_id, **given}
    ids.setdefault("bos_token_id", ids["eos_token_id"])
    unknown = sorted(set(ids) - set(_TOKEN_KEYS))
    if unknown:
        raise QkvError(f"unknown token id key(s) {', '.join(unknown)}; use {', '.join(_TOKEN_KEYS)}")
    # One int each: GGUF has no place for a list (some config.json files give several eos ids).
    bad = {k: v for k, v in ids.items() if v is not None and not (isinstance(v, int) and 0 <= v < vocab_size)}
    if bad:
        raise QkvError(f"token ids {bad} are not ids in the vocabulary of {vocab_size}")
    return {k: int(v) for k, v in ids.items() if v is not None}


def _add_metadata(writer: Any, cfg: DecoderLMConfig, dtype: str, name: str) -> None:
    """The model's shape, under llama.cpp's llama.* keys."""
    gguf = require("gguf", "hf", "writing .gguf files")
    writer.add_type("model")  # not an adapter
    writer.add_name(name)
    hf = llama.config_to_hf(cfg)  # the same numbers, under llama.cpp's names
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_rope_freq_base(hf["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_dimension_count(hf["head_dim"])
    writer.add_vocab_size(hf["vocab_size"])
    file_type = {"float16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type.get(dtype, "ALL_F32")))


def _add_tokenizer(writer: Any, tokenizer: ByteBPETokenizer, vocab_size: int, pre_name: str, ids: dict[str, int],
                   chat_template: str | None) -> None:  # fmt: skip
    """The tokenizer as llama.cpp's "gpt2" BPE, its special ids and the chat template."""
    tokens, types, merges = _vocab(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{_TOKEN_KEYS[key]}", value)
    # qkv never adds bos/eos when encoding; llama.cpp must not either, or the two see different prompts.
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _tensors(model: DecoderLM, dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor under its HF Llama name, as the array to write (W_q and W_k rows permuted for llama.cpp)."""
    hf = llama.config_to_hf(model.cfg)
    for hf_name, tensor in export_mapped(model, llama.name_map(model.cfg)).items():
        if ".q_proj." in hf_name:
            tensor = _permute(tensor, hf["num_attention_heads"])
        elif ".k_proj." in hf_name:
            tensor = _permute(tensor, hf["num_key_value_heads"])
        array = tensor.detach().cpu().float().numpy()
        # llama.cpp multiplies 1-D tensors (norm weights, biases) in fp32; matrices take the chosen dtype.
        f16 = dtype == "float16" and array.ndim > 1
        yield hf_name, array.astype(np.float16 if f16 else np.float32, copy=False)  # no fp32 copy
