"""Tests for bits per byte: the definition against a plain loop and an independent byte count, the field training
writes and the line it prints, and qkv.evals.bpb on text files, data directories and the default text."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import model_cfg, one_thread, tiny_data, tiny_settings

from qkv.data import load_shakespeare
from qkv.data.cache import open_text, prepared
from qkv.data.options import TokenizerRecipe
from qkv.errors import QkvError
from qkv.evals.bpb import MAX_BLOCK, bpb_of, default_text, text_bpb
from qkv.evals.models import EvalModel
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tasks import train
from qkv.tasks.base import EvalOptions
from qkv.tasks.lm import LMRun
from qkv.tokenizers import ByteBPETokenizer, CharTokenizer, Tokenizer
from qkv.training import evaluate_loss, evaluate_sums

HEAD, TAIL = "Héllo, wörld! 🎉 naïve café — ", " 你好, “quotes”\n"
TEXT = HEAD + load_shakespeare()[:3000] + TAIL
BLOCK = 16


def _model(vocab_size: int, max_positions: int = BLOCK) -> DecoderLM:
    """A random one-layer model (its losses differ token by token, which is all the sums need)."""
    torch.manual_seed(0)
    cfg = model_cfg(DecoderLMConfig, vocab_size=vocab_size, max_positions=max_positions, n_layers=1,
                    d_model=32, n_heads=2,
                    dropout=0.0)  # fmt: skip
    return DecoderLM(cfg).eval()


def _plain_loop(model: DecoderLM, ids: list[int], sizes: list[int], block: int) -> tuple[float, int]:
    """Nats and bytes over the targets that stand for text: consecutive windows of `block` tokens, each target once,
    the cross-entropy of each position by plain torch."""
    nats, n_bytes = 0.0, 0
    for start in range(0, len(ids) - 1, block):
        y = torch.tensor(ids[start + 1 : start + block + 1])
        x = torch.tensor(ids[start : start + len(y)])
        with torch.no_grad():
            losses = F.cross_entropy(model(x[None])[0], y, reduction="none")
        for target, loss in zip(y.tolist(), losses.tolist(), strict=True):
            if sizes[target] > 0:
                nats, n_bytes = nats + loss, n_bytes + sizes[target]
    return nats, n_bytes


def _bpe() -> ByteBPETokenizer:
    return ByteBPETokenizer.train(load_shakespeare()[:100_000], vocab_size=400)


# ---- the definition ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_bits_per_byte_is_the_texts_nats_in_bits_over_its_bytes(kind: str) -> None:
    """Bytes = the text's UTF-8 length less the first token's (never predicted); the special token between two
    documents adds neither bytes nor loss; the mean loss is evaluate_loss's, every target included."""
    tok: Tokenizer = CharTokenizer.from_text(TEXT) if kind == "char" else _bpe()
    first, second = TEXT[:1500], TEXT[1500:]
    if isinstance(tok, ByteBPETokenizer):
        assert tok.eos_id is not None
        ids = [*tok.encode(first), tok.eos_id, *tok.encode(second)]
        first_bytes = len(tok.decode(ids[:1]).encode())
    else:
        ids, first_bytes = tok.encode(TEXT), len(TEXT[0].encode())
    assert first_bytes == 1 and len(TEXT.encode()) == 3060
    model, sizes = _model(tok.vocab_size), tok.token_bytes()
    data = torch.tensor(ids)
    sums = evaluate_sums(model, data, BLOCK, 3, token_bytes=torch.tensor(sizes))
    assert sums.text_bytes == len(TEXT.encode()) - first_bytes == 3059
    assert sums.targets == len(ids) - 1
    nats, n_bytes = _plain_loop(model, ids, sizes, BLOCK)
    assert n_bytes == sums.text_bytes
    assert sums.bits_per_byte() == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)
    assert sums.mean == evaluate_loss(model, data, BLOCK, 3)  # the validation loss keeps every digit
    assert evaluate_sums(model, data, BLOCK, 3).loss == sums.loss
    eos_loss = sums.loss - sums.text_loss
    assert eos_loss > 1 if kind == "bpe" else eos_loss == 0.0  # one special target: its loss is left out


def test_bits_per_byte_of_nothing_is_refused() -> None:
    tok = _bpe()
    assert tok.eos_id is not None
    sums = evaluate_sums(_model(tok.vocab_size), torch.tensor([tok.eos_id] * 3), BLOCK,
                         token_bytes=torch.tensor(tok.token_bytes()))  # fmt: skip
    assert sums.text_bytes == 0
    with pytest.raises(QkvError, match=r"^bits per byte needs text among the predicted tokens"):
        sums.bits_per_byte()


# ---- training: metrics.jsonl and the closing line ----------------------------------------------------------


def test_training_records_val_bpb_and_prints_it(tmp_path: Path) -> None:
    """Every evaluation writes val_bpb beside val_loss; the last one equals the plain loop on the run's validation
    split; the best weights still follow val_loss; the closing line and `qkv eval` show it."""
    settings = {**tiny_settings("lm", tiny_data(tmp_path / "data")), "tokenizer": "bpe", "vocab_size": 300,
                "final_eval_tokens": 0}  # the last evaluation over the whole split, as the plain loop reads it
    with one_thread():
        result = train(task="lm", verbose=False, **settings, out_dir=str(tmp_path / "run"))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6] and all(2 < r["val_bpb"] < 8 for r in rows)
    assert result.best == min(r["val_loss"] for r in rows)
    run = LMRun.load(result.run_dir, "last")
    val, tok = run.validation_data(), run.require_tokenizer()
    ids = val[0 : len(val)].tolist()
    assert ids[-1] == tok.eos_id  # the document's end-of-text token: a target that is not text
    nats, n_bytes = _plain_loop(run.model, ids, tok.token_bytes(), 32)
    text = load_shakespeare()[:20_000]
    assert n_bytes == len(text[18_000:].encode()) - len(tok.decode(ids[:1]).encode())  # the last 10 % of it
    assert rows[-1]["full_eval"] and rows[-1]["val_bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)
    line = result.summary().splitlines()[1]
    match = re.fullmatch(r"validation loss (\d\.\d{4}) \(perplexity \d+\.\d\d, (\d\.\d{3}) bits per byte\) after 6 "
                         r"steps, \d+ s of training and evaluation, \d+ s since the run began — run saved in .*",
                         line)  # fmt: skip
    assert match, line
    assert float(match.group(2)) == round(rows[-1]["val_bpb"], 3)
    (printed,) = run.evaluate(EvalOptions())
    assert re.fullmatch(rf"val loss \d\.\d{{4}}  perplexity \d+\.\d{{3}}  bits per byte {match.group(2)}  "
                        r"\([\d,]+ positions, block size 32, last weights\)", printed)  # fmt: skip


def test_a_tokenizer_that_cannot_say_its_bytes_trains_without_bpb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:  # fmt: skip
    def refuse(self: Tokenizer) -> list[int]:
        raise QkvError("bits per byte needs …")

    monkeypatch.setattr(CharTokenizer, "token_bytes", refuse)
    with one_thread():
        result = train(task="lm", verbose=False, **tiny_settings("lm", tiny_data(tmp_path / "data")),
                       out_dir=str(tmp_path / "run"))  # fmt: skip
    assert all("val_bpb" not in r for r in result.metrics) and set(result.final) == {"val_loss"}
    assert re.match(r"validation loss \d\.\d{4} \(perplexity \d+\.\d\d\) after 6 steps", result.summary().strip())
    (printed,) = LMRun.load(result.run_dir).evaluate(EvalOptions())
    assert "bits per byte" not in printed and printed.startswith("val loss ")


# ---- qkv.evals.bpb: a text file, a data directory, the default text ----------------------------------------


def test_a_text_file_is_scored_whole_special_strings_as_text(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    for tok in (CharTokenizer.from_text(TEXT + "<|endoftext|>"), _bpe()):
        text = TEXT + "<|endoftext|>" + TAIL  # a special token's string in a file is text like the rest
        path.write_text(text, encoding="utf-8")
        model = _model(tok.vocab_size)
        result = text_bpb(model, tok, path, BLOCK, 4)
        ids = tok.encode_ordinary([text])[0]
        assert result.bytes == len(text.encode()) - 1 and result.tokens == len(ids) - 1
        nats, n_bytes = _plain_loop(model, ids, tok.token_bytes(), BLOCK)
        assert result.bpb == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-6)
        assert result.loss == pytest.approx(nats / (len(ids) - 1), rel=1e-6)  # no special targets here
        assert (result.source, result.block_size) == (str(path), BLOCK)


def test_the_default_text_is_the_validation_split_of_a_default_run() -> None:
    """The characters a default `qkv train` holds out, token for token, scored as its evaluation scores them."""
    data = open_text(None)  # the embedded Shakespeare, char-level, split as `qkv train` splits it
    val = data.split("val")
    text = default_text()
    assert len(text) == len(val) == 113_076 and text.startswith("UCHIO.\n[To VINCE")
    assert data.tokenizer.encode(text) == val[0 : len(val)].tolist()
    model = _model(data.tokenizer.vocab_size, 32)
    result = text_bpb(model, data.tokenizer, None, 32, 32, max_tokens=20_000)
    sums = evaluate_sums(model, val, 32, 32, max_tokens=20_000, token_bytes=torch.tensor(data.tokenizer.token_bytes()))
    assert result.bpb == sums.bits_per_byte() and result.loss == sums.mean
    assert result.source == "the embedded Shakespeare's validation split"


def test_a_data_directory_is_scored_on_its_validation_split(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    directory = prepared(str(path), TokenizerRecipe("char"), "char")
    data = open_text(str(path))
    meta = json.loads((directory / "meta.json").read_text())
    val = data.split("val")
    result = text_bpb(_model(data.tokenizer.vocab_size), data.tokenizer, directory, BLOCK, 4)
    first = data.tokenizer.decode(val[0:1].tolist())
    assert result.bytes == meta["splits"]["val"]["text_bytes"] - len(first.encode()) == len(TEXT[2738:].encode()) - 1
    assert result.tokens == len(val) - 1 and result.source == f"{directory}'s validation split"
    other = CharTokenizer.from_text(TEXT + "§")
    with pytest.raises(QkvError) as err:
        text_bpb(_model(other.vocab_size), other, directory, BLOCK, 4, checkpoint="runs/x")
    assert str(err.value) == (f"{directory} was prepared with another tokenizer (char) than the model's; prepare it "
                              "with `qkv prepare INPUT --out DIR --tokenizer runs/x` or pass a text file")  # fmt: skip


def test_unusable_sources_are_refused_in_one_line(tmp_path: Path) -> None:
    tok = CharTokenizer.from_text(TEXT)
    model = _model(tok.vocab_size)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    expected = {
        "empty.txt": "is empty; bits per byte needs some text to score",
        "latin1.txt": "is not UTF-8 text: byte 0xe9 at byte offset 3; re-save it as UTF-8",
        "missing.txt": "not found; give a UTF-8 text file or a `qkv prepare` data directory",
    }
    for name, message in expected.items():
        with pytest.raises(QkvError) as err:
            text_bpb(model, tok, tmp_path / name, BLOCK, 4)
        assert str(err.value) == f"{tmp_path / name} {message}"
    with pytest.raises(QkvError, match=r"^bits per byte needs the bytes of text each token stands for"):
        text_bpb(model, _Silent(tok.chars), None, BLOCK, 4)


class _Silent(CharTokenizer):
    """A tokenizer of a kind that does not say its tokens' bytes."""

    kind = "silent"

    def token_bytes(self) -> list[int]:
        return Tokenizer.token_bytes(self)


def test_bpb_of_reads_windows_of_the_models_context_at_most_max_block(tmp_path: Path) -> None:
    """`qkv eval MODEL --bpb`: windows of max_positions tokens, capped at MAX_BLOCK; its line and JSON entry."""
    tok = CharTokenizer.from_text(TEXT)
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    for positions, block in ((BLOCK, BLOCK), (MAX_BLOCK * 2, MAX_BLOCK)):
        lm = EvalModel(_model(tok.vocab_size, positions), tok, "tiny", tmp_path / "bench.json")
        result = bpb_of(lm, str(path), 8)
        assert result.block_size == block and result.tokens == len(TEXT) - 1
        assert result == text_bpb(lm.model, tok, path, block, 8)
    entry = result.to_json()
    assert entry == {"bpb": result.bpb, "loss": result.loss, "tokens": 3042, "bytes": 3059, "source": str(path),
                     "block_size": MAX_BLOCK}  # fmt: skip
    assert re.fullmatch(r"bits per byte \d\.\d{3} \(loss \d\.\d{4} nats per token; 3,042 tokens, 3,059 bytes, "
                        rf"windows of 1,024 tokens\) on {re.escape(str(path))}", result.line())  # fmt: skip
