"""MarianMT (the OPUS-MT translation models) ↔ qkv's encoder–decoder Transformer.

Marian's models are the paper's Transformer with these choices: sinusoidal positions laid out as
[sin | cos] (sinusoid_layout="halves"), post-norm LayerNorms (ε 1e-5), SiLU ("swish") feed-forward
layers, token embeddings × √d_model, one vocabulary shared by encoder, decoder and the tied output
layer, an output bias (final_logits_bias), and <pad> as the decoder's start token. How transformers
decodes them (beams, length penalty, maximum length, </s> forced at the end) is generation_config.json's
to say: `generation_settings` reads it. The tokenizer is qkv.interop.marian_tokenizer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qkv.errors import QkvError
from qkv.interop.bart import seq2seq_config, seq2seq_export_problems, seq2seq_name_map, side_to_hf
from qkv.interop.hf_io import Family, NameMap, hf_value, mismatches, unsupported
from qkv.io.files import load_json
from qkv.models import TransformerConfig
from qkv.positional import SinusoidalPositionsConfig

NAME = "Marian"
GENERATION_FILE = "generation_config.json"
NORM_EPS = 1e-5  # nn.LayerNorm's default: Marian's config has no ε


def is_marian_dir(directory: str | Path) -> bool:
    """Whether a directory is a Hugging Face MarianMT checkpoint (config.json's model_type)."""
    config = Path(directory) / "config.json"
    return config.is_file() and load_json(config).get("model_type") == "marian"


def _refuse_variants(hf: dict[str, Any]) -> None:
    """One line for each Marian variant that qkv's Transformer cannot express."""
    for flag in ("normalize_before", "layernorm_embedding", "add_final_layer_norm"):  # pre-norm, embedding norms
        if hf.get(flag):
            raise unsupported(NAME, flag, True)
    for flag in ("static_position_embeddings", "share_encoder_decoder_embeddings"):  # learned positions; 2 tables
        if hf.get(flag, True) is False:
            raise unsupported(NAME, flag, False)
    vocab, decoder_vocab = hf_value(hf, "vocab_size", NAME), hf.get("decoder_vocab_size")
    if decoder_vocab not in (None, vocab):
        raise unsupported(NAME, "decoder_vocab_size≠vocab_size", (vocab, decoder_vocab))


def config_from_hf(hf: dict[str, Any], tensor_names: Collection[str]) -> TransformerConfig:
    """TransformerConfig for a MarianMT config.json."""
    _refuse_variants(hf)
    return seq2seq_config(hf, NAME, SinusoidalPositionsConfig(layout="halves"), embedding_norm=False,
                          pad_id=hf_value(hf, "pad_token_id", NAME))  # fmt: skip


def name_map(cfg: TransformerConfig) -> NameMap:
    """Where each Transformer tensor lives in a MarianMTModel checkpoint: BART's names, no positions (computed)."""
    return seq2seq_name_map(cfg)


def export_problems(cfg: TransformerConfig) -> list[str]:
    """What keeps a Transformer config from being a MarianMT (empty: it is one)."""
    problems = seq2seq_export_problems(cfg)
    return problems + mismatches(cfg, {"embedding.positions": SinusoidalPositionsConfig(layout="halves"),
                                       "embedding.norm": None})  # fmt: skip


def config_to_hf(cfg: TransformerConfig) -> dict[str, Any]:
    """config.json for a MarianMTModel with the Transformer's shape (the token ids are added by the caller)."""
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": cfg.src_vocab_size,
        "decoder_vocab_size": cfg.tgt_vocab_size,
        "d_model": cfg.d_model,
        **side_to_hf(cfg, silu="swish"),
        "max_position_embeddings": cfg.max_positions,
        "scale_embedding": cfg.embedding.scale,
        "static_position_embeddings": True,
        "normalize_before": False,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_encoder_decoder": True,
        "pad_token_id": cfg.pad_id,
    }


def token_ids(cfg: TransformerConfig, given: dict[str, int | None], eos: int | None) -> dict[str, int | None]:
    """config.json's token ids: those given, else <pad> as the decoder's start (Marian's way) and `eos`."""
    ids: dict[str, int | None] = {"pad_token_id": cfg.pad_id, "decoder_start_token_id": cfg.pad_id,
                                  "eos_token_id": eos, "forced_eos_token_id": eos, "bos_token_id": None}  # fmt: skip
    # Every key is written: MarianConfig's defaults (58100, 0) are opus-mt-en-de's ids, not this model's.
    return ids | {k: v for k, v in given.items() if k in ids}


def generation_config(ids: dict[str, int | None], max_length: int) -> dict[str, Any]:
    """generation_config.json as OPUS-MT's: 4 beams, <pad> banned, up to max_length tokens, </s> forced last."""
    pad = ids["pad_token_id"]
    return {"bad_words_ids": [[pad]], "num_beams": 4, "max_length": max_length,
            **{k: v for k, v in ids.items() if v is not None}}  # fmt: skip


@dataclass(frozen=True)
class GenerationSettings:
    """How transformers' generate decodes a Marian checkpoint (its defaults where the files say nothing)."""

    pad: int
    start: int  # decoder_start_token_id: <pad> for OPUS-MT
    eos: int
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    max_length: int = 20  # decoder tokens, the start token included
    forced_eos: bool = False  # forced_eos_token_id = eos: the last allowed token is </s>


def generation_settings(directory: str | Path) -> GenerationSettings:
    """generation_config.json's settings (else config.json's, which older checkpoints carry), checked."""
    directory = Path(directory)
    config = load_json(directory / "config.json")
    path = directory / GENERATION_FILE
    gen = load_json(path) if path.is_file() else config
    value = {key: gen.get(key, config.get(key)) for key in ("pad_token_id", "decoder_start_token_id", "eos_token_id")}
    pad, eos = value["pad_token_id"], value["eos_token_id"]
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    if not isinstance(pad, int) or not isinstance(eos, int):
        raise QkvError(f"{directory}: a Marian model needs one pad_token_id and one eos_token_id, got {pad!r}, {eos!r}")
    start = value["decoder_start_token_id"]
    forced = gen.get("forced_eos_token_id")
    if forced not in (None, eos, [eos]):
        raise unsupported(NAME, "forced_eos_token_id", forced)
    early_stopping = hf_value(gen, "early_stopping", NAME, False)
    if early_stopping not in (True, False, "never"):
        raise unsupported(NAME, "early_stopping", early_stopping)
    banned = gen.get("bad_words_ids")
    if banned not in (None, [[pad]]):  # qkv's decoders never emit <pad>, and ban nothing else
        raise unsupported(NAME, "bad_words_ids", banned)
    return GenerationSettings(
        pad=pad,
        start=start if isinstance(start, int) else pad,
        eos=eos,
        num_beams=int(hf_value(gen, "num_beams", NAME, 1)),  # transformers' defaults where the files say nothing
        length_penalty=float(hf_value(gen, "length_penalty", NAME, 1.0)),
        early_stopping=early_stopping,
        max_length=int(hf_value(gen, "max_length", NAME, 20)),
        forced_eos=forced is not None,
    )


FAMILY = Family(
    name=NAME,
    model_types=("marian",),
    config_from_hf=config_from_hf,
    name_map=name_map,
    aliases=(("model.", ""),),  # MarianModel checkpoints lack the "model." prefix
    # Tied copies of model.shared (older checkpoints store them), and the fixed sinusoids some checkpoints carry.
    ignored=(r"(^|\.)(encoder|decoder)\.embed_(tokens|positions)\.weight$", r"^lm_head\.weight$"),
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    exports="transformer",
)
