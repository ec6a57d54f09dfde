"""A translator: an encoder–decoder Transformer with its tokenizer and beam-search settings, text in, text out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.errors import QkvError
from qkv.models import Transformer
from qkv.tokenizers import Tokenizer
from qkv.tokenizers.bpe import ByteBPETokenizer
from qkv.translation.batching import Specials, source_tensor
from qkv.translation.decoding import beam_search, check_penalties, greedy_decode

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


@dataclass
class Translator:
    """Greedy or beam-search translation of sentences (beam search with GNMT's α and β)."""

    model: Transformer
    tokenizer: Tokenizer
    specials: Specials
    length_penalty: float = 0.6  # GNMT's α
    coverage_penalty: float = 0.2  # GNMT's β

    def __post_init__(self) -> None:
        """Refuse negative penalties by name."""
        check_penalties(self.length_penalty, self.coverage_penalty)

    @property
    def device(self) -> torch.device:
        """Where the model's weights live."""
        return next(self.model.parameters()).device

    def encode_sources(self, sentences: list[str]) -> torch.Tensor:
        """(B, S) padded source ids."""
        return source_tensor([self.tokenizer.encode(s) for s in sentences], self.specials).to(self.device)

    def decode_ids(self, src: torch.Tensor, beam_size: int = 1) -> list[list[int]]:
        """Output ids for sources (B, S): beam_size 1 = greedy, else beam search with α and β."""
        if beam_size == 1:
            return greedy_decode(self.model, src, self.specials)
        return beam_search(self.model, src, self.specials, beam_size, self.length_penalty,
                           coverage_penalty=self.coverage_penalty)  # fmt: skip

    def translate(self, sentences: list[str], beam_size: int = 1, batch_size: int = 64) -> list[str]:
        """Translations of the sentences; beam_size 1 = greedy."""
        out: list[str] = []
        for i in range(0, len(sentences), batch_size):
            ids = self.decode_ids(self.encode_sources(sentences[i : i + batch_size]), beam_size)
            out.extend(self.tokenizer.decode(t).strip() for t in ids)
        return out
