"""Byte-level BPE tokenizer (GPT-2 style), trained and run by Hugging Face `tokenizers`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers as hf  # Hugging Face's package, not this one (qkv.tokenizers)

from qkv.errors import QkvError
from qkv.io.files import atomic_write_json, load_json
from qkv.tokenizers.base import (
    CONFIG_FILE,
    ENDOFTEXT,
    TOKENIZER_FILE,
    Tokenizer,
    check_bpe_vocab,
)
from qkv.tokenizers.byte_level import byte_decoder, tiktoken_engine

# 256 byte tokens + at least one special token; above the upper bound is surely a typo (GPT-4 uses ~100k).


class ByteBPETokenizer(Tokenizer):
    """Byte-pair encoding over UTF-8 bytes: any text encodes (no unknown tokens) and decodes exactly."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: hf.Tokenizer, eos_token: str = ENDOFTEXT) -> None:
        """Wrap a trained Hugging Face tokenizer (use train() or load() to get one)."""
        self._tok = hf_tokenizer
        self._eos_token = eos_token  # pretrained vocabularies name their own (SmolLM2: <|im_end|>)
        self._ordinary: Any = None  # the engine of encode_ordinary, made on first use
        self._added_tokens: dict[int, Any] | None = None  # _added's, read on first use

    @classmethod
    def train(
        cls, texts: str | Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (ENDOFTEXT,)
    ) -> ByteBPETokenizer:
        """Learn merges on a text (or texts: documents, or pieces of one cut between pre-tokens) until the
        vocabulary (bytes + specials + merges) has `vocab_size` tokens."""
        check_bpe_vocab(vocab_size)
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not any(texts):
            raise QkvError("cannot train a BPE tokenizer on empty text")
        tok = hf.Tokenizer(hf.models.BPE())
        # No prefix space: encoding must not change the text, so decode(encode(t)) == t exactly.
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,  # a pair seen once is noise, not a pattern worth a token
            special_tokens=list(special_tokens),
            # Start from all 256 bytes, not just those in `text`, so unseen characters still encode.
            initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, directory: Path) -> ByteBPETokenizer:
        """Read a tokenizer written by save() (Hugging Face's tokenizer.json)."""
        path = Path(directory) / TOKENIZER_FILE
        load_json(path, "tokenizer file")  # clear errors for a missing file or broken JSON before HF sees it
        try:
            tok = hf.Tokenizer.from_file(str(path))
        except Exception as err:  # HF raises a bare Exception for schema errors
            raise QkvError(f"{path} is not a valid Hugging Face tokenizer file: {err}") from err
        config = Path(directory) / CONFIG_FILE
        eos = load_json(config, "tokenizer file").get("eos_token", ENDOFTEXT) if config.is_file() else ENDOFTEXT
        return cls(tok, eos if isinstance(eos, str) else ENDOFTEXT)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (may be below the requested size on small texts)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-text token (<|endoftext|> unless built with another), or None if absent."""
        return self._tok.token_to_id(self._eos_token)

    @property
    def hf_tokenizer(self) -> hf.Tokenizer:
        """The underlying Hugging Face tokenizer."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; a literal <|endoftext|> in the text becomes the special token."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with special-token strings as plain text; GPT-2's vocabulary runs on tiktoken."""
        if self._ordinary is None:
            fast = tiktoken_engine(self.fingerprint(), self._tok.get_vocab(with_added_tokens=False))
            if fast is not None:
                self._ordinary = fast.encode_ordinary
            else:  # the same tokenizer without its special tokens: "<|endoftext|>" in a text is just text
                config = json.loads(self._tok.to_str())
                config["added_tokens"] = [t for t in config.get("added_tokens", []) if not t.get("special")]
                plain = hf.Tokenizer.from_str(json.dumps(config))
                self._ordinary = lambda text: plain.encode(text, add_special_tokens=False).ids
        return [self._ordinary(text) for text in texts]

    def _added(self) -> dict[int, Any]:
        """Added tokens (specials, and words matched as written) by id, read once."""
        if self._added_tokens is None:
            self._added_tokens = self._tok.get_added_tokens_decoder()
        return self._added_tokens

    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (<|endoftext|>, <|im_start|>, …)."""
        return frozenset(i for i, token in self._added().items() if token.special)

    def piece(self, token: int) -> bytes:
        """The bytes token `token` stands for: in a byte-level BPE, part of a character's UTF-8 where the token
        splits one (which decode alone cannot show); an added token's text as written."""
        added = self._added().get(token)
        if added is not None:
            return added.content.encode("utf-8")
        if not isinstance(self._tok.decoder, hf.decoders.ByteLevel) or not 0 <= token < self.vocab_size:
            return super().piece(token)
        alphabet, piece = byte_decoder(), self._tok.id_to_token(token) or ""
        # One character per byte; a piece outside that alphabet decodes as its own UTF-8, as HF's decoder does.
        return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode("utf-8")

    def token_bytes(self) -> list[int]:
        """UTF-8 bytes of each token's text, 0 for special tokens; for byte-level BPEs (GPT-2's byte alphabet)."""
        decoder = self._tok.decoder
        if not isinstance(decoder, hf.decoders.ByteLevel):
            raise QkvError(f"bits per byte needs the bytes of text each token stands for, which this BPE (decoder "
                           f"{type(decoder).__name__ if decoder else None}, not GPT-2's byte-level one) does not say; "
                           "compare such models by validation loss, on one tokenizer")  # fmt: skip
        # Special tokens are matched in the text as written, before bytes are mapped, and stand for no text.
        special = self.special_ids()
        return [0 if i in special else len(self.piece(i)) for i in range(self.vocab_size)]

    def cuts_like_gpt2(self) -> bool:
        """True for a byte-level BPE with GPT-2's pre-tokenizer (digits split apart first, or not) and no
        normalizer: qkv's own BPEs, GPT-2's, SmolLM2's; not for SentencePiece-style (Metaspace) tokenizers."""
        config = json.loads(self._tok.to_str())
        pre = config.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        *first, last = steps or [{}]
        byte_level = last.get("type") == "ByteLevel" and last.get("use_regex") and not last.get("add_prefix_space")
        digits = all(s.get("type") == "Digits" and s.get("individual_digits") for s in first)
        return bool(byte_level and digits and config.get("normalizer") is None)

    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical JSON (vocabulary, merges, pre-tokenizer, special tokens) and eos."""
        canonical = json.dumps([json.loads(self._tok.to_str()), self._eos_token], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included, so decoding is the exact inverse of encoding."""
        ids = [int(i) for i in ids]  # also accepts tensors and numpy arrays
        size = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= size):
            bad = next(i for i in ids if not 0 <= i < size)
            raise QkvError(f"token id {bad} is out of range for a vocabulary of {size} tokens")
        return self._tok.decode(ids, skip_special_tokens=False)

    def save(self, directory: Path) -> None:
        """Write HF's tokenizer.json plus tokenizer_config.json recording {"kind": "bpe"}."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / TOKENIZER_FILE))
        extra = {} if self._eos_token == ENDOFTEXT else {"eos_token": self._eos_token}
        atomic_write_json(directory / CONFIG_FILE, {"kind": self.kind, **extra})
