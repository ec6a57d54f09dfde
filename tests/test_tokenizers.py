"""Tests for qkv.tokenizers: char and byte-level BPE round trips, saving/loading, and error messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from qkv.data import load_shakespeare
from qkv.errors import QkvError
from qkv.tokenizers import (
    ENDOFTEXT,
    ByteBPETokenizer,
    CharTokenizer,
    load_tokenizer,
)

UNICODE_TEXT = "Héllo, wörld! 🎉 naïve café\r\n\ttabs  and   spaces \u2014 end <|endoftext|> after\n\n"


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return load_shakespeare()


@pytest.fixture(scope="module")
def bpe(shakespeare: str) -> ByteBPETokenizer:
    return ByteBPETokenizer.train(shakespeare[:200_000], vocab_size=512)


# ---- char ------------------------------------------------------------------------------------------


def test_char_round_trip_on_shakespeare(shakespeare: str) -> None:
    tok = CharTokenizer.from_text(shakespeare)
    assert tok.kind == "char" and tok.vocab_size == 78 and tok.eos_id is None
    assert tok.chars == sorted(set(shakespeare))
    start = time.perf_counter()
    ids = tok.encode_tensor(shakespeare)
    assert time.perf_counter() - start < 1.0  # vectorised: ~10 ms in practice
    assert ids.dtype == torch.int64 and ids.shape == (len(shakespeare),)
    assert ids.tolist() == tok.encode(shakespeare)
    assert int(ids.min()) == 0 and int(ids.max()) == 77
    assert tok.decode(ids.tolist()) == shakespeare


def test_char_ids_follow_sorted_alphabet() -> None:
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"]
    assert tok.encode("hello") == [3, 2, 4, 4, 5]
    assert tok.decode([7, 5, 6, 4, 1]) == "world"
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_char_unknown_characters_are_named(shakespeare: str) -> None:
    tok = CharTokenizer.from_text(shakespeare)
    with pytest.raises(QkvError) as err:
        tok.encode("Thou art 🎉 a café\tlover")
    message = str(err.value)
    assert "'é'" in message and "'🎉'" in message and "'\\t'" in message  # reprs of each character
    assert "'a'" not in message  # known characters are not listed
    assert "training text" in message and "\n" not in message


def test_char_decode_rejects_out_of_range_id() -> None:
    with pytest.raises(QkvError, match="token id 5 is out of range"):
        CharTokenizer.from_text("abc").decode([0, 5])


def test_char_rejects_empty_text() -> None:
    with pytest.raises(QkvError, match="empty"):
        CharTokenizer.from_text("")


def test_char_save_load(tmp_path: Path) -> None:
    tok = CharTokenizer.from_text(UNICODE_TEXT)
    tok.save(tmp_path / "tok")
    saved = json.loads((tmp_path / "tok" / "tokenizer.json").read_text(encoding="utf-8"))
    assert saved == {"kind": "char", "chars": tok.chars}
    loaded = load_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, CharTokenizer) and loaded.chars == tok.chars
    assert loaded.decode(loaded.encode(UNICODE_TEXT)) == UNICODE_TEXT


# ---- byte-level BPE --------------------------------------------------------------------------------


def test_bpe_round_trip(bpe: ByteBPETokenizer, shakespeare: str) -> None:
    assert bpe.kind == "bpe" and bpe.vocab_size == 512
    sample = shakespeare[-50_000:]  # not seen in training
    ids = bpe.encode(sample)
    assert len(ids) < 0.6 * len(sample)  # merges actually compress English (~1.85 chars per token)
    assert bpe.decode(ids) == sample
    tensor = bpe.encode_tensor(sample)
    assert tensor.dtype == torch.int64 and tensor.tolist() == ids


def test_bpe_round_trips_any_unicode(bpe: ByteBPETokenizer) -> None:
    # Byte-level: characters never seen in training still encode (as raw bytes) and decode exactly.
    ids = bpe.encode(UNICODE_TEXT)
    assert max(ids) < bpe.vocab_size
    assert bpe.decode(ids) == UNICODE_TEXT


def test_bpe_eos_id(bpe: ByteBPETokenizer) -> None:
    assert bpe.eos_id is not None and 0 <= bpe.eos_id < bpe.vocab_size
    assert bpe.encode(ENDOFTEXT) == [bpe.eos_id]  # the literal text becomes the single special token
    assert bpe.decode([bpe.eos_id]) == ENDOFTEXT


def test_bpe_save_load(bpe: ByteBPETokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"kind": "bpe"}
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteBPETokenizer)
    assert loaded.vocab_size == bpe.vocab_size and loaded.eos_id == bpe.eos_id
    assert loaded.encode(UNICODE_TEXT) == bpe.encode(UNICODE_TEXT)


@pytest.mark.parametrize("size", [0, 100, 256, 10**9])
def test_bpe_rejects_bad_vocab_size(size: int) -> None:
    with pytest.raises(QkvError, match=f"vocab size must be between 257 .*got {size}$"):
        ByteBPETokenizer.train("some text", vocab_size=size)


# ---- load_tokenizer ------------------------------------------------------------------------------------


def test_fingerprints_tell_tokenizers_apart_and_survive_saving(tmp_path: Path) -> None:
    """Equal fingerprints for the same tokenizer saved and loaded back; different ones for different vocabularies."""
    text = "to be or not to be, that is the question " * 20
    tokenizers = [CharTokenizer.from_text(text), CharTokenizer.from_text(text + "!"), ByteBPETokenizer.train(text, 300),
                  ByteBPETokenizer.train(text, 270)]  # fmt: skip
    for i, tokenizer in enumerate(tokenizers):
        tokenizer.save(tmp_path / str(i))
        assert load_tokenizer(tmp_path / str(i)).fingerprint() == tokenizer.fingerprint()
    assert len({t.fingerprint() for t in tokenizers}) == len(tokenizers)


def test_load_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope")


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match=r"tokenizer file not found.*tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_load_malformed_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"kind": "char", "chars": [')
    with pytest.raises(QkvError, match=r"not valid JSON \(line 1: .*, column 28\)"):
        load_tokenizer(tmp_path)


def test_load_unknown_kind(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"kind": "word", "words": []}')
    with pytest.raises(QkvError, match=r"unknown tokenizer kind 'word'.*expected one of: char, bpe"):
        load_tokenizer(tmp_path)


def test_load_char_file_missing_chars(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"kind": "char"}')
    with pytest.raises(QkvError, match="not a char tokenizer file"):
        load_tokenizer(tmp_path)


def test_load_bpe_without_config_or_with_broken_file(bpe: ByteBPETokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(QkvError, match=r"tokenizer_config\.json is missing"):
        load_tokenizer(tmp_path)
    bpe.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 42}')
    with pytest.raises(QkvError, match="not a valid Hugging Face tokenizer file"):
        load_tokenizer(tmp_path)


def test_which_tokenizers_cut_like_gpt2() -> None:
    """Text cut where GPT-2's pre-tokenizer splits keeps its tokens for byte-level BPEs with that pre-tokenizer
    (digits split first or not) and for characters; not for SentencePiece-style or normalizing tokenizers."""
    import tokenizers as hf

    from qkv.tokenizers.gpt2 import byte_level_bpe

    vocab, merges = {"a": 0, "b": 1, "ab": 2}, [("a", "b")]
    assert ByteBPETokenizer.train("to be or not to be " * 20, 300).cuts_like_gpt2()
    assert ByteBPETokenizer(byte_level_bpe(vocab, merges, split_digits=True)).cuts_like_gpt2()
    assert CharTokenizer.from_text("ab").cuts_like_gpt2()
    metaspace = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=merges))
    metaspace.pre_tokenizer = hf.pre_tokenizers.Metaspace()
    normalizing = byte_level_bpe(vocab, merges)
    normalizing.normalizer = hf.normalizers.NFKC()
    assert not ByteBPETokenizer(metaspace).cuts_like_gpt2()
    assert not ByteBPETokenizer(normalizing).cuts_like_gpt2()
