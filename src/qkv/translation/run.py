"""A translation run directory (the language model's format, model_type "transformer") and loading it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.config import TransformerConfig
from qkv.errors import QkvError
from qkv.models import Transformer
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.tokenizers.bpe import ByteBPETokenizer
from qkv.training.checkpoint import atomic_write_json
from qkv.training.run import CONFIG_FILE, FORMAT, load_run_weights, read_run_config
from qkv.translation.batching import Specials, source_tensor
from qkv.translation.config import TranslateConfig
from qkv.translation.decoding import beam_search, greedy_decode

MODEL_TYPE = "transformer"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: trained first, so they come first


def train_tokenizer(texts: list[str], vocab_size: int) -> ByteBPETokenizer:
    """One byte-level BPE vocabulary for both languages, with <pad> <s> </s> as ids 0 1 2."""
    trained = ByteBPETokenizer.train("\n".join(texts), vocab_size, special_tokens=SPECIAL_TOKENS)
    return ByteBPETokenizer(trained.hf_tokenizer, eos_token="</s>")


def specials_of(tokenizer: Tokenizer) -> Specials:
    """The special ids of a translation tokenizer (checked, so a foreign tokenizer fails clearly)."""
    if not isinstance(tokenizer, ByteBPETokenizer):
        raise QkvError("a translation run needs its byte-level BPE tokenizer")
    ids = [tokenizer.hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1, 2]:
        raise QkvError(f"tokenizer lacks the special tokens {', '.join(SPECIAL_TOKENS)} as ids 0, 1, 2")
    return Specials(pad=0, bos=1, eos=2)


def write_translation_config(
    directory: Path, model_cfg: TransformerConfig, cfg: TranslateConfig, tokenizer: Tokenizer
) -> None:
    """config.json (model_type "transformer") and the tokenizer."""
    tokenizer.save(directory)
    atomic_write_json(
        directory / CONFIG_FILE,
        {
            "format": FORMAT,
            "model_type": MODEL_TYPE,
            "task": "translate de-en",
            "model": model_cfg.to_dict(),
            "training": cfg.to_dict(),
            "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size},
        },
    )


def model_type(run_dir: str | Path) -> str:
    """The run's model_type ("decoder_lm" for runs that predate the field)."""
    return str(read_run_config(Path(run_dir)).get("model_type", "decoder_lm"))


@dataclass
class TranslationRun:
    """A trained translation model with its tokenizer and config."""

    model: Transformer
    tokenizer: Tokenizer
    config: TranslateConfig
    specials: Specials
    directory: Path

    @property
    def device(self) -> torch.device:
        """Where the model's weights live."""
        return next(self.model.parameters()).device

    def encode_sources(self, sentences: list[str]) -> torch.Tensor:
        """(B, S) padded source ids for German sentences."""
        return source_tensor([self.tokenizer.encode(s) for s in sentences], self.specials).to(self.device)

    def decode_ids(self, src: torch.Tensor, beam_size: int = 1) -> list[list[int]]:
        """Output ids for sources (B, S): beam_size 1 = greedy, else beam search with the config's α and β."""
        if beam_size == 1:
            return greedy_decode(self.model, src, self.specials)
        cfg = self.config
        return beam_search(
            self.model, src, self.specials, beam_size, cfg.length_penalty, coverage_penalty=cfg.coverage_penalty
        )

    def translate(self, sentences: list[str], beam_size: int = 1, batch_size: int = 64) -> list[str]:
        """English translations; beam_size 1 = greedy, else beam search with the config's α and β."""
        out: list[str] = []
        for i in range(0, len(sentences), batch_size):
            ids = self.decode_ids(self.encode_sources(sentences[i : i + batch_size]), beam_size)
            out.extend(self.tokenizer.decode(t).strip() for t in ids)
        return out


def load_translation(
    run_dir: str | Path, checkpoint: str = "best", device: str | torch.device = "cpu"
) -> TranslationRun:
    """Load a translation run's model (best or last weights) and tokenizer, in eval mode."""
    directory = Path(run_dir)
    config = read_run_config(directory)
    if config.get("model_type", "decoder_lm") != MODEL_TYPE:
        raise QkvError(f"{directory} holds a {config.get('model_type', 'decoder_lm')} run, not a translation model")
    model = Transformer(TransformerConfig.from_dict(config["model"]))
    load_run_weights(model, directory, checkpoint)
    tokenizer = load_tokenizer(directory)
    cfg = TranslateConfig.from_dict(config["training"])
    return TranslationRun(model.to(device).eval(), tokenizer, cfg, specials_of(tokenizer), directory)
