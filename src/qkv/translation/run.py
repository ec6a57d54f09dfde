"""A translator: an encoder–decoder Transformer with its tokenizer and beam-search settings, text in, text out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from qkv.errors import QkvError
from qkv.models import Transformer
from qkv.tokenizers import Tokenizer
from qkv.tokenizers.bpe import ByteBPETokenizer
from qkv.translation.batching import Specials, source_tensor
from qkv.translation.decoding import COVERAGE_PENALTY, LENGTH_PENALTY, beam_search, check_penalties, greedy_decode
from qkv.translation.hf_beam import EarlyStopping, check_early_stopping, hf_generate

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: trained first, so they come first
BeamScoring = Literal["gnmt", "hf"]
BEAM_SCORINGS = ("gnmt", "hf")


class TextCodec(Protocol):
    """What a translator needs of a tokenizer: a qkv Tokenizer, or a checkpoint's own (MarianMT's SentencePiece)."""

    def encode(self, text: str) -> list[int]:
        """Source token ids of `text`, without </s>."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of target token ids."""
        ...


def train_tokenizer(texts: list[str], vocab_size: int) -> ByteBPETokenizer:
    """One byte-level BPE vocabulary for both languages, with <pad> <s> </s> as ids 0 1 2."""
    trained = ByteBPETokenizer.train("\n".join(texts), vocab_size, special_tokens=SPECIAL_TOKENS)
    return ByteBPETokenizer(trained.hf_tokenizer, eos_token="</s>")


def specials_of(tokenizer: Tokenizer) -> Specials:
    """The special ids of a translation tokenizer (checked, so a foreign tokenizer fails clearly)."""
    if getattr(tokenizer, "kind", None) == "marian":  # qkv.interop's MarianTokenizer
        pad, eos = getattr(tokenizer, "pad_id"), tokenizer.eos_id  # noqa: B009 (pad_id: Marian's, not a Tokenizer's)
        assert eos is not None  # MarianTokenizer checks its </s> when it loads
        return Specials(pad=pad, bos=pad, eos=eos)  # OPUS-MT starts the decoder with <pad> (decoder_start_token_id)
    if not isinstance(tokenizer, ByteBPETokenizer):
        raise QkvError("a translation run needs its byte-level BPE tokenizer")
    ids = [tokenizer.hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1, 2]:
        raise QkvError(f"tokenizer lacks the special tokens {', '.join(SPECIAL_TOKENS)} as ids 0, 1, 2")
    return Specials(pad=0, bos=1, eos=2)


@dataclass
class Translator:
    """Greedy or beam-search translation of sentences, scored as GNMT (α, β) or as transformers' generate."""

    model: Transformer
    tokenizer: TextCodec
    specials: Specials
    length_penalty: float = LENGTH_PENALTY  # GNMT's α; with beam_scoring "hf", transformers' exponent
    coverage_penalty: float = COVERAGE_PENALTY  # GNMT's β (beam_scoring "hf" has none)
    beam_scoring: BeamScoring = "gnmt"
    # The next three are transformers' generation settings (beam_scoring "hf"); max_len applies to both.
    early_stopping: EarlyStopping = False
    max_len: int | None = None  # output tokens allowed; None: 1.5 × each source + 10 (hf: the batch's longest)
    forced_eos: bool = False  # the last allowed token is </s> (forced_eos_token_id)

    def __post_init__(self) -> None:
        """Refuse unknown scorings, negative GNMT penalties and bad lengths by name."""
        if self.beam_scoring not in BEAM_SCORINGS:
            raise QkvError(f"unknown beam scoring {self.beam_scoring!r}; choose one of: {', '.join(BEAM_SCORINGS)}")
        if self.beam_scoring == "gnmt":
            check_penalties(self.length_penalty, self.coverage_penalty)
        check_early_stopping(self.early_stopping)
        if self.max_len is not None and self.max_len < 1:
            raise QkvError(f"the maximum output length must be ≥ 1, got {self.max_len}")

    @property
    def device(self) -> torch.device:
        """Where the model's weights live."""
        return next(self.model.parameters()).device

    def encode_sources(self, sentences: list[str]) -> torch.Tensor:
        """(B, S) padded source ids."""
        return source_tensor([self.tokenizer.encode(s) for s in sentences], self.specials).to(self.device)

    def decode_ids(self, src: torch.Tensor, beam_size: int = 1) -> list[list[int]]:
        """Output ids for sources (B, S): beam_size 1 = greedy, else beam search scored as beam_scoring says."""
        if self.beam_scoring == "hf":
            return hf_generate(self.model, src, self.specials, beam_size, self.length_penalty, self.early_stopping,
                               self.max_len, self.forced_eos)  # fmt: skip
        if beam_size == 1:
            return greedy_decode(self.model, src, self.specials, self.max_len)
        return beam_search(self.model, src, self.specials, beam_size, self.length_penalty, max_len=self.max_len,
                           coverage_penalty=self.coverage_penalty)  # fmt: skip

    def translate(self, sentences: list[str], beam_size: int = 1, batch_size: int = 64) -> list[str]:
        """Translations of the sentences; beam_size 1 = greedy: batch_size at a time, each sentence's slot taken by
        the next as soon as it ends (qkv's engine); beam search goes batch by batch."""
        if not sentences:
            return []
        if beam_size == 1 and self.beam_scoring == "gnmt":
            src = self.encode_sources(sentences)
            ids = greedy_decode(self.model, src, self.specials, self.max_len, slots=batch_size)
            return [self.tokenizer.decode(t).strip() for t in ids]
        out: list[str] = []
        for i in range(0, len(sentences), batch_size):
            ids = self.decode_ids(self.encode_sources(sentences[i : i + batch_size]), beam_size)
            out.extend(self.tokenizer.decode(t).strip() for t in ids)
        return out


def rescored(
    translator: Translator,
    scoring: BeamScoring | None,
    length_penalty: float | None = None,
    coverage_penalty: float | None = None,
) -> Translator:
    """The translator with another beam scoring (None: keep its own), given penalties or that scoring's defaults."""
    scoring = translator.beam_scoring if scoring is None else scoring
    if scoring == "hf" and coverage_penalty is not None:
        raise QkvError("--coverage-penalty is GNMT's; --beam-scoring hf has no coverage penalty")
    if scoring == translator.beam_scoring:
        return translator
    alpha = length_penalty if length_penalty is not None else (1.0 if scoring == "hf" else LENGTH_PENALTY)
    beta = coverage_penalty if coverage_penalty is not None else (0.0 if scoring == "hf" else COVERAGE_PENALTY)
    return dataclasses.replace(translator, beam_scoring=scoring, length_penalty=alpha, coverage_penalty=beta)
