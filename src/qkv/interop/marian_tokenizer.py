"""MarianMT's tokenizer: two SentencePiece models and one vocabulary, used as transformers' MarianTokenizer uses them.

    source text → source.spm pieces → ids through vocab.json (a piece it lacks → <unk>) + </s>
    target text → target.spm pieces → ids the same way (target_vocab.json with separate vocabularies): labels
    target ids  → pieces through vocab.json (target_vocab.json with separate vocabularies) → text via target.spm

The SentencePiece models only cut text into pieces (and join them back): the ids are vocab.json's, the
vocabulary the model was trained with. As in transformers, the special tokens' strings in a text (</s>,
<unk>, <pad>) are those tokens, and a leading language code (">>fra<<", multilingual targets) is one
token. sentencepiece is imported only here, from the translate extra.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.extras import require
from qkv.io.files import load_json
from qkv.tokenizers.base import Tokenizer

SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"
VOCAB_FILE, TARGET_VOCAB_FILE = "vocab.json", "target_vocab.json"
CONFIG_FILE = "tokenizer_config.json"
SPIECE_UNDERLINE = "▁"  # SentencePiece's visible space


def is_marian_tokenizer_dir(directory: str | Path) -> bool:
    """Whether a directory holds a MarianTokenizer's files (source.spm, target.spm, vocab.json)."""
    return all((Path(directory) / name).is_file() for name in (SOURCE_SPM, TARGET_SPM, VOCAB_FILE))


def _token_name(value: Any, default: str) -> str:
    """A special token's string in tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else default


class MarianTokenizer(Tokenizer):
    """Source text → ids and target ids → text, as transformers' MarianTokenizer does it."""

    kind = "marian"

    def __init__(self, directory: str | Path) -> None:
        spm = require("sentencepiece", "translate", "Marian tokenizers")
        self.directory = Path(directory)
        if not is_marian_tokenizer_dir(self.directory):
            raise QkvError(f"{self.directory} lacks a Marian tokenizer ({SOURCE_SPM}, {TARGET_SPM} and {VOCAB_FILE})")
        config = load_json(self.directory / CONFIG_FILE) if (self.directory / CONFIG_FILE).is_file() else {}
        self.separate_vocabs = bool(config.get("separate_vocabs", False))
        self.vocab: dict[str, int] = load_json(self.directory / VOCAB_FILE, "vocabulary")
        self.target_vocab = load_json(self.directory / TARGET_VOCAB_FILE) if self.separate_vocabs else self.vocab
        self.pieces = {i: piece for piece, i in self.target_vocab.items()}  # target id → piece
        names = {key: _token_name(config.get(f"{key}_token"), f"<{key}>") for key in ("unk", "pad")}
        eos = _token_name(config.get("eos_token"), "</s>")
        for name in (eos, names["unk"], names["pad"]):
            if name not in self.vocab:
                raise QkvError(f"{self.directory / VOCAB_FILE} lacks the special token {name}")
        self.eos, self.unk, self.pad = eos, names["unk"], names["pad"]
        self.source_spm = spm.SentencePieceProcessor(model_file=str(self.directory / SOURCE_SPM))
        self.target_spm = spm.SentencePieceProcessor(model_file=str(self.directory / TARGET_SPM))
        specials = sorted((eos, self.unk, self.pad), key=len, reverse=True)  # longest first, as a trie matches
        self._special_split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")

    @property
    def vocab_size(self) -> int:
        """Entries in vocab.json (the source vocabulary)."""
        return len(self.vocab)

    @property
    def eos_id(self) -> int:
        """Id of </s>."""
        return self.vocab[self.eos]

    @property
    def unk_id(self) -> int:
        """Id of <unk>, which every piece missing from vocab.json becomes."""
        return self.vocab[self.unk]

    @property
    def pad_id(self) -> int:
        """Id of <pad>."""
        return self.vocab[self.pad]

    @staticmethod
    def _pieces(text: str, spm: Any) -> list[str]:
        """A text without special tokens as pieces of `spm`; a leading >>code<< stays one piece."""
        code = []
        end = text.find("<<")
        if text.startswith(">>") and end != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        return code + list(spm.encode(text, out_type=str))

    def _ids(self, text: str, spm: Any, vocab: dict[str, int]) -> list[int]:
        """Ids of `text` cut by `spm` and looked up in `vocab` (a piece it lacks → <unk>)."""
        ids = []
        for part in self._special_split.split(text):  # special tokens' strings are those tokens
            if part in (self.eos, self.unk, self.pad):
                ids.append(vocab[part])
            elif part:
                ids += [vocab.get(piece, vocab[self.unk]) for piece in self._pieces(part, spm)]
        return ids

    def encode(self, text: str) -> list[int]:
        """Source ids of `text`, without </s> (the translator appends it)."""
        return self._ids(text, self.source_spm, self.vocab)

    def encode_target(self, text: str) -> list[int]:
        """Target ids of `text`, without </s>: transformers' labels (text_target=), less their </s>."""
        return self._ids(text, self.target_spm, self.target_vocab)

    def source_ids(self, text: str) -> list[int]:
        """What the model reads for `text`: its ids and </s> (transformers' input_ids)."""
        return [*self.encode(text), self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of target ids, special tokens skipped (transformers' skip_special_tokens=True)."""
        skip = {self.eos_id, self.unk_id, self.pad_id}
        pieces = []
        for i in ids:
            if i in skip:
                continue
            piece = self.pieces.get(i)
            if piece is None and 0 <= i < self.target_spm.get_piece_size():
                piece = self.target_spm.id_to_piece(i)  # transformers' fallback for an id vocab.json lacks
            if piece:
                pieces.append(piece)
        return str(self.target_spm.decode_pieces(pieces)).replace(SPIECE_UNDERLINE, " ").strip()

    @classmethod
    def load(cls, directory: Path) -> MarianTokenizer:
        """The tokenizer whose files are in `directory`."""
        return cls(directory)

    def save(self, directory: str | Path) -> None:
        """Copy the tokenizer's files into `directory` (transformers' MarianTokenizer reads them there)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        names = (SOURCE_SPM, TARGET_SPM, VOCAB_FILE, CONFIG_FILE, TARGET_VOCAB_FILE)
        for name in names:
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, directory / name)

    def __repr__(self) -> str:
        """Short description."""
        return f"MarianTokenizer({str(self.directory)!r}, vocab_size={self.vocab_size})"


def read_tokenizer(directory: str | Path) -> Tokenizer | None:
    """A model or run directory's tokenizer: MarianMT's (source.spm, …), qkv's (tokenizer.json), or None."""
    from qkv.tokenizers import load_tokenizer
    from qkv.tokenizers.base import TOKENIZER_FILE

    if is_marian_tokenizer_dir(directory):
        return MarianTokenizer(directory)
    return load_tokenizer(Path(directory)) if (Path(directory) / TOKENIZER_FILE).is_file() else None
