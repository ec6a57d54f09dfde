"""MarianMT (OPUS-MT) in qkv: tokenizer, logits, greedy and beam outputs, KV cache, export, `qkv translate`.

The checkpoint is a tiny random MarianMTModel with opus-mt's real settings (swish, √d_model embedding scale,
static [sin | cos] positions, shared embeddings, <pad> as decoder start, </s> = 0, <unk> = 1, <pad> last,
<pad> banned, a non-zero final_logits_bias), written by save_pretrained beside SentencePiece models trained
here on generated German and English sentences: nothing is downloaded. Its </s> bias is raised so that
outputs end at different lengths, some naturally and some at the maximum length.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import config, model_cfg
from transformers import MarianConfig, MarianMTModel, MarianTokenizer

from qkv import QkvError, Transformer, TransformerConfig
from qkv.cli import main as cli_main
from qkv.interop import from_hf, read_marian_tokenizer
from qkv.interop.qkv_dir import save_qkv
from qkv.positional import SinusoidalPositionsConfig
from qkv.translation.batching import Specials, source_tensor
from qkv.translation.decoding import greedy_decode
from qkv.translation.hf_beam import hf_beam_search, hf_generate
from qkv.translation.run import Translator

pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")  # MarianTokenizer's nudge

TOL = 1e-5
MAX_LENGTH = 24  # generation_config.json's max_length: the start token + 23 generated tokens
# The random model's init std, </s> bias and seed, picked so that greedy and beam outputs end at many lengths,
# some naturally (including at once) and some at MAX_LENGTH; test_outputs_match_generate checks that they still do.
INIT_STD, EOS_BIAS, MODEL_SEED = 0.6, 5.0, 1
SENTENCES = [
    "Der Hund sieht den Ball.",
    "Das Kind malt zwölf Äpfel!",
    "Ein alter Mann",
    "Die Stadt öffnet die Tür und sucht den großen Garten?",
    "Ω ☃ 日本",  # characters neither SentencePiece model has seen: <unk>
    "Unsere Lehrerin kauft ein Buch",
    "Mein Vater liebt die Katze.",
    "Der Zug findet einen Apfel",
]
_DE = (["Der Hund", "Die Katze", "Mein Vater", "Das Kind", "Unsere Lehrerin", "Ein alter Mann", "Die Stadt", "Der Zug",
        "Meine Schwester", "Der Bäcker", "Jede Woche", "Der Winter"],
       ["sieht", "liebt", "kauft", "findet", "öffnet", "sucht", "malt", "schreibt", "verkauft", "vergisst"],
       ["den Ball.", "das Haus.", "einen Apfel.", "die Tür.", "ein Buch!", "den großen Garten?", "zwölf Äpfel.",
        "einen langen Brief.", "das frische Brot.", "die weiße Straße."])  # fmt: skip
_EN = (["The dog", "The cat", "My father", "The child", "Our teacher", "An old man", "The city", "The train",
        "My sister", "The baker", "Every week", "The winter"],
       ["sees", "loves", "buys", "finds", "opens", "looks for", "paints", "writes", "sells", "forgets"],
       ["the ball.", "the house.", "an apple.", "the door.", "a book!", "the big garden?", "twelve apples.",
        "a long letter.", "the fresh bread.", "the white street."])  # fmt: skip


def _sentences(words: tuple[list[str], ...], n: int, rng: random.Random) -> list[str]:
    """n generated sentences: subject, verb, object."""
    return [" ".join(rng.choice(part) for part in words) for _ in range(n)]


def _spm(lines: list[str], path: Path) -> Any:
    """Train a small unigram SentencePiece model on the lines, write it to `path`, return it loaded."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=120,
                                   hard_vocab_limit=False, character_coverage=1.0, unk_id=1, eos_id=0, bos_id=-1,
                                   pad_id=-1, minloglevel=2, num_threads=1)  # fmt: skip
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _write_tokenizer(directory: Path) -> int:
    """source.spm, target.spm, vocab.json (</s> 0, <unk> 1, both models' pieces, <pad> last); the vocab size."""
    rng = random.Random(0)
    models = [_spm(_sentences(_DE, 400, rng), directory / "source.spm"),
              _spm(_sentences(_EN, 400, rng), directory / "target.spm")]  # fmt: skip
    pieces = dict.fromkeys(m.id_to_piece(i) for m in models for i in range(m.get_piece_size())
                           if not (m.is_control(i) or m.is_unknown(i)))  # fmt: skip
    vocab = {"</s>": 0, "<unk>": 1, **{p: i for i, p in enumerate(pieces, start=2)}}
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    config = {"tokenizer_class": "MarianTokenizer", "source_lang": "de", "target_lang": "en", "separate_vocabs": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return len(vocab)


def _marian_model(vocab_size: int, **shape: int) -> Any:
    """A random MarianMTModel with opus-mt's settings at a tiny size, its </s> bias raised (shape: per-side sizes)."""
    pad = vocab_size - 1
    cfg: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        activation_function="swish", scale_embedding=True, static_position_embeddings=True,
        share_encoder_decoder_embeddings=True, normalize_before=False, decoder_start_token_id=pad,
        pad_token_id=pad, eos_token_id=0, forced_eos_token_id=0, init_std=INIT_STD,
    )  # fmt: skip
    hf = MarianMTModel(MarianConfig(**{**cfg, **shape})).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_()
        hf.final_logits_bias[0, 0] = EOS_BIAS
    gen = hf.generation_config
    gen.bad_words_ids, gen.num_beams, gen.max_length = [[pad]], 4, MAX_LENGTH
    return hf


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MarianMT directory as save_pretrained writes it, with its tokenizer files."""
    directory = tmp_path_factory.mktemp("opus-mt-de-en")
    vocab_size = _write_tokenizer(directory)
    torch.manual_seed(MODEL_SEED)
    _marian_model(vocab_size).save_pretrained(directory)
    return directory


# Each side its own heads, feed-forward width and depth, as BART's and Marian's configs allow.
PER_SIDE = dict(encoder_layers=3, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=2,
                encoder_ffn_dim=48, decoder_ffn_dim=96)  # fmt: skip


@pytest.fixture(scope="module")
def per_side_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MarianMT directory whose encoder and decoder differ in heads, feed-forward widths and layer counts."""
    directory = tmp_path_factory.mktemp("opus-mt-per-side")
    vocab_size = _write_tokenizer(directory)
    torch.manual_seed(MODEL_SEED)
    _marian_model(vocab_size, **PER_SIDE).save_pretrained(directory)
    return directory


def _hf_tokenizer(directory: Path) -> Any:
    return MarianTokenizer.from_pretrained(directory)


def _hf_model(directory: Path) -> Any:
    return MarianMTModel.from_pretrained(directory).eval()


def _stripped(rows: torch.Tensor, eos: int, pad: int) -> list[list[int]]:
    """generate's output rows without the start token, cut at the first </s> (or filler)."""
    out = []
    for row in rows[:, 1:].tolist():
        ends = [i for i, t in enumerate(row) if t in (eos, pad)]
        out.append(row[: ends[0]] if ends else row)
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer and logits
# ---------------------------------------------------------------------------------------------


def test_tokenizer_matches_transformers(marian_dir: Path) -> None:
    """Source ids (unknown characters, special tokens' strings, a language code) and decoded text, as HF's."""
    ours, theirs = read_marian_tokenizer(marian_dir), _hf_tokenizer(marian_dir)
    assert ours is not None and (ours.eos_id, ours.unk_id, ours.pad_id) == (0, 1, ours.vocab_size - 1)
    texts = [*SENTENCES, "", "  zwei  Leerzeichen  ", "Der </s> Hund <unk> x<pad>y", ">>en<< Der Hund", "ΩΩ Hund"]
    for text in texts:
        assert ours.source_ids(text) == theirs(text).input_ids, text
    assert ours.unk_id in ours.source_ids(SENTENCES[4])
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, ours.vocab_size, (12,), generator=generator).tolist()
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids


def test_logits_match_transformers(marian_dir: Path) -> None:
    """Teacher-forced logits of a padded batch (decoder input starting with <pad>) within 1e-5 of MarianMTModel's."""
    hf, model, tokenizer = _hf_model(marian_dir), from_hf(marian_dir), _hf_tokenizer(marian_dir)
    assert isinstance(model, Transformer)
    cfg = model.cfg
    block = cfg.decoder.block
    assert cfg.embedding.positions == SinusoidalPositionsConfig(layout="halves") and cfg.output_bias
    assert (block.ffn.activation, block.norm_placement) == ("silu", "post")
    assert model.generator.bias is not None and model.generator.bias.abs().min() > 0
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    pad = cfg.pad_id
    tgt = torch.randint(0, pad, (len(SENTENCES), 9))
    tgt[:, 0] = pad  # Marian's decoder start
    with torch.no_grad():
        theirs = hf(**batch, decoder_input_ids=tgt).logits
        ours = model(batch.input_ids, tgt, batch.attention_mask.bool()[:, None, None, :])
    assert (ours - theirs).abs().max().item() <= TOL


def test_older_checkpoints_with_stored_copies_load_silently(marian_dir: Path, tmp_path: Path) -> None:
    """OPUS-MT uploads also store the tied embedding copies, lm_head and the fixed sinusoid tables: all ignored."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "legacy"
    shutil.copytree(marian_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    shared, sinusoids = tensors["model.shared.weight"], MarianMTModel.from_pretrained(marian_dir).model.encoder
    copies = {f"model.{side}.embed_tokens.weight": shared.clone() for side in ("encoder", "decoder")}
    copies |= {f"model.{side}.embed_positions.weight": sinusoids.embed_positions.weight.detach().clone()
               for side in ("encoder", "decoder")}  # fmt: skip
    save_file({**tensors, **copies, "lm_head.weight": shared.clone()}, directory / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unused tensor would be reported by a warning
        model = from_hf(directory)
    src, tgt = torch.tensor([[5, 6, 0]]), torch.tensor([[model.cfg.pad_id, 7]])
    with torch.no_grad():
        assert torch.equal(model(src, tgt), from_hf(marian_dir)(src, tgt))


# ---------------------------------------------------------------------------------------------
# Decoding: greedy and transformers' beam search
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("beams", "length_penalty", "early_stopping"),
                         [(1, 1.0, False), (4, 1.0, False), (4, 2.0, False), (4, -1.0, False), (4, 0.5, True),
                          (4, 2.0, True), (4, 1.0, "never")])  # fmt: skip
def test_outputs_match_generate(marian_dir: Path, beams: int, length_penalty: float, early_stopping: Any) -> None:
    """Token-identical to generate (do_sample False, <pad> banned, </s> forced last) on sources of different lengths."""
    hf, model, tokenizer = _hf_model(marian_dir), from_hf(marian_dir), _hf_tokenizer(marian_dir)
    assert isinstance(model, Transformer)
    pad, max_new = model.cfg.pad_id, MAX_LENGTH - 1
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, num_beams=beams, length_penalty=length_penalty, early_stopping=early_stopping,
                          do_sample=False, max_new_tokens=max_new)  # fmt: skip
    theirs = _stripped(out, 0, pad)
    sp, codec = Specials(pad=pad, bos=pad, eos=0), read_marian_tokenizer(marian_dir)
    assert codec is not None
    translator = Translator(model, codec, sp, length_penalty, 0.0, "hf", early_stopping, max_new, forced_eos=True)
    assert translator.decode_ids(batch.input_ids, beams) == theirs
    lengths = {len(t) for t in theirs}
    assert max_new - 1 in lengths and lengths - {0, max_new - 1}, lengths  # some end early, some at the limit


def test_kv_cache_equals_uncached_decoding(marian_dir: Path) -> None:
    """The encoder–decoder KV cache changes nothing: greedy and HF-scored beam search, cached or not."""
    model, tokenizer = from_hf(marian_dir), _hf_tokenizer(marian_dir)
    assert isinstance(model, Transformer)
    src = tokenizer(SENTENCES, return_tensors="pt", padding=True).input_ids
    sp = Specials(pad=model.cfg.pad_id, bos=model.cfg.pad_id, eos=0)
    cached, uncached = [
        (greedy_decode(model, src, sp, max_len=16, use_cache=use_cache),
         hf_beam_search(model, src, sp, 4, max_len=16, forced_eos=True, use_cache=use_cache))
        for use_cache in (True, False)
    ]  # fmt: skip
    assert cached == uncached
    assert all(sp.pad not in row for row in cached[0] + cached[1])  # <pad> is never emitted, though it starts


def test_pad_is_never_emitted_even_when_most_likely(marian_dir: Path) -> None:
    """With <pad> the most likely token everywhere, greedy and beam search still never emit it."""
    model = from_hf(marian_dir)
    assert isinstance(model, Transformer) and model.generator.bias is not None
    pad = model.cfg.pad_id
    with torch.no_grad():
        model.generator.bias[pad] = 100.0
    src = torch.tensor([[5, 6, 7, 0]])
    sp = Specials(pad=pad, bos=pad, eos=0)
    for out in (greedy_decode(model, src, sp, max_len=8), hf_generate(model, src, sp, 4, max_len=8)):
        assert len(out[0]) > 0 and pad not in out[0]


# ---------------------------------------------------------------------------------------------
# Export: qkv → MarianMT → qkv
# ---------------------------------------------------------------------------------------------


def _marian_shaped(vocab_size: int, **overrides: Any) -> Transformer:
    """A random qkv Transformer that Marian can express (different encoder and decoder depths)."""
    fields: dict[str, Any] = dict(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2,
        n_decoder_layers=1, positions="sinusoidal", sinusoid_layout="halves", activation="silu", norm_placement="post",
        share_embeddings=True, output_bias=True, pad_id=vocab_size - 1, max_positions=64, dropout=0.0, final_norm=False,
    )  # fmt: skip
    model = Transformer(model_cfg(TransformerConfig, **{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "generator.bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_qkv_to_marian_and_back_keeps_the_logits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qkv convert QKV_DIR --to hf` writes what MarianMTModel loads with the same logits; from_hf reads it back."""
    model = _marian_shaped(50)
    save_qkv(model, tmp_path / "qkv")
    assert cli_main(["convert", str(tmp_path / "qkv"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    written = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= written
    src, tgt = torch.randint(0, 49, (2, 7)), torch.randint(0, 49, (2, 5))
    tgt[:, 0] = 49
    hf, again = _hf_model(tmp_path / "hf"), from_hf(tmp_path / "hf")
    assert isinstance(again, Transformer) and again.cfg == model.cfg
    with torch.no_grad():
        ours = model(src, tgt)
        assert (hf(input_ids=src, decoder_input_ids=tgt).logits - ours).abs().max().item() <= TOL
        assert torch.equal(again(src, tgt), ours)
    capsys.readouterr()
    paper_cfg = model_cfg(TransformerConfig, src_vocab_size=50, tgt_vocab_size=50, d_model=16, n_heads=2,
                          n_encoder_layers=1, n_decoder_layers=1, norm_placement="pre")  # fmt: skip
    paper = Transformer(paper_cfg)
    save_qkv(paper, tmp_path / "paper")
    assert cli_main(["convert", str(tmp_path / "paper"), str(tmp_path / "hf2"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not Marian" in err
    assert "embedding.positions=SinusoidalPositionsConfig(layout='interleaved') (needs" in err
    assert "encoder.block.norm_placement='pre'" in err
    assert not (tmp_path / "hf2").exists() or not any((tmp_path / "hf2").iterdir())


def test_a_qkv_translation_model_exports_its_special_ids(tmp_path: Path) -> None:
    """A model with a qkv translation tokenizer (<pad> <s> </s> = 0 1 2) keeps <s> as decoder start in config.json,
    and transformers' generate with the written generation_config.json gives qkv's "hf" output."""
    from qkv.translation.run import train_tokenizer

    tokenizer = train_tokenizer(["Der Hund sieht den Ball.", "The dog sees the ball."] * 20, vocab_size=300)
    model = _marian_shaped(tokenizer.vocab_size, pad_id=0)
    save_qkv(model, tmp_path / "qkv", tokenizer)
    assert cli_main(["convert", str(tmp_path / "qkv"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text(encoding="utf-8"))
    ids = {k: config[k] for k in ("pad_token_id", "decoder_start_token_id", "eos_token_id", "forced_eos_token_id")}
    assert ids == {"pad_token_id": 0, "decoder_start_token_id": 1, "eos_token_id": 2, "forced_eos_token_id": 2}
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    sp = Specials(pad=0, bos=1, eos=2)
    src = source_tensor([tokenizer.encode("Der Hund sieht den Ball."), tokenizer.encode("Ball")], sp)  # padded
    with torch.no_grad():
        out = _hf_model(tmp_path / "hf").generate(input_ids=src, attention_mask=(src != 0).long(), num_beams=1)
    translator = Translator(
        model, tokenizer, Specials(pad=0, bos=1, eos=2), 1.0, 0.0, "hf", max_len=63, forced_eos=True
    )
    assert translator.decode_ids(src, 1) == _stripped(out, 2, 0)


def test_marian_through_qkv_is_the_same_directory(marian_dir: Path, tmp_path: Path) -> None:
    """MarianMT → qkv → MarianMT: same logits, generation settings and tokenizer files."""
    assert cli_main(["convert", str(marian_dir), str(tmp_path / "copy"), "--to", "hf"]) == 0
    for name in ("generation_config.json", "source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (tmp_path / "copy" / name).read_bytes() == (marian_dir / name).read_bytes(), name
    original, copy = _hf_model(marian_dir), _hf_model(tmp_path / "copy")
    src = _hf_tokenizer(tmp_path / "copy")(SENTENCES[:2], return_tensors="pt", padding=True)
    tgt = torch.full((2, 4), original.config.pad_token_id)
    with torch.no_grad():
        assert torch.equal(original(**src, decoder_input_ids=tgt).logits, copy(**src, decoder_input_ids=tgt).logits)


# ---------------------------------------------------------------------------------------------
# `qkv translate` and refusals
# ---------------------------------------------------------------------------------------------


def test_cli_translate_prints_what_generate_decodes(
    marian_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """generation_config.json's settings (4 beams, max_length, </s> forced) or --beam 1, as transformers prints."""
    hf, tokenizer = _hf_model(marian_dir), _hf_tokenizer(marian_dir)
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    capsys.readouterr()
    for options, settings in (([], {}), (["--beam", "1"], {"num_beams": 1})):
        with torch.no_grad():
            expected = tokenizer.batch_decode(hf.generate(**batch, **settings), skip_special_tokens=True)
        assert cli_main(["translate", str(marian_dir), "--input", str(sources), *options]) == 0
        assert capsys.readouterr().out.split("\n")[:-1] == expected
    assert cli_main(["translate", str(marian_dir), SENTENCES[0], "--beam-scoring", "gnmt"]) == 0
    assert cli_main(["translate", str(marian_dir), SENTENCES[0], "--coverage-penalty", "0.2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--beam-scoring hf has no coverage penalty" in err


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        ("config.json", {"normalize_before": True}, "normalize_before=True"),
        ("config.json", {"static_position_embeddings": False}, "static_position_embeddings=False"),
        ("config.json", {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 40},
         "share_encoder_decoder_embeddings=False"),
        ("config.json", {"layernorm_embedding": True}, "layernorm_embedding=True"),
        ("config.json", {"activation_function": "tanh"}, "activation='tanh'"),
        ("generation_config.json", {"bad_words_ids": [[5]]}, "bad_words_ids=[[5]]"),
    ],
)  # fmt: skip
def test_unsupported_variants_are_refused_in_one_line(
    marian_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str, change: dict[str, Any],
    message: str,
) -> None:  # fmt: skip
    directory = tmp_path / "variant"
    shutil.copytree(marian_dir, directory)
    config = json.loads((directory / file).read_text(encoding="utf-8"))
    (directory / file).write_text(json.dumps({**config, **change}), encoding="utf-8")
    if file == "config.json":
        with pytest.raises(QkvError, match=f"^Marian checkpoints with {message}"):
            from_hf(directory)
    capsys.readouterr()
    assert cli_main(["translate", str(directory), SENTENCES[0]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "not supported by qkv" in err


# ---------------------------------------------------------------------------------------------
# Fine-tuning: `qkv train translate --init-from MARIAN_DIR`
# ---------------------------------------------------------------------------------------------


def _parallel_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """n German–English pairs: the same subject, verb and object picked on both sides."""
    rng = random.Random(seed)
    picks = [[rng.randrange(len(part)) for part in _DE] for _ in range(n)]
    return [tuple(" ".join(words[i] for words, i in zip(side, p, strict=True)) for side in (_DE, _EN))  # type: ignore[misc]
            for p in picks]  # fmt: skip


def test_teacher_forced_loss_equals_transformers_with_labels(marian_dir: Path) -> None:
    """qkv's training batch of a Marian model (target pieces, <pad> start, padding) has transformers' loss."""
    from qkv.translation.batching import encode_pairs, make_batch
    from qkv.translation.run import specials_of
    from qkv.translation.step import batch_loss

    pairs = _parallel_pairs(6, seed=3)
    ours, theirs = read_marian_tokenizer(marian_dir), _hf_tokenizer(marian_dir)
    assert ours is not None
    encoded = theirs([de for de, _ in pairs], text_target=[en for _, en in pairs], return_tensors="pt", padding=True)
    for (_, en), labels in zip(pairs, theirs(text_target=[en for _, en in pairs]).input_ids, strict=True):
        assert [*ours.encode_target(en), ours.eos_id] == labels, en
        assert ours.encode_target(en) != ours.encode(en)  # the target side has its own SentencePiece model
    sp = specials_of(ours)
    assert (sp.pad, sp.bos, sp.eos) == (ours.pad_id, ours.pad_id, ours.eos_id)
    batch = make_batch(*zip(*encode_pairs(ours, pairs, 64), strict=True), sp)  # type: ignore[arg-type]
    labels = encoded["labels"].masked_fill(encoded["labels"] == sp.pad, -100)
    model = from_hf(marian_dir).eval()
    with torch.no_grad():
        expected = _hf_model(marian_dir)(**{k: v for k, v in encoded.items() if k != "labels"}, labels=labels).loss
        loss = batch_loss(model, batch, smoothing=0.0)
    assert abs(loss.item() - expected.item()) <= TOL


def test_init_from_a_marian_directory_fine_tunes_it(
    marian_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--init-from MARIAN_DIR starts at its weights with its tokenizer; the run translates, evaluates and resumes."""
    from qkv.tasks import load, train
    from qkv.training import Hooks

    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{de}\t{en}\n" for de, en in _parallel_pairs(120, seed=4)), encoding="utf-8")
    started: dict[str, torch.Tensor] = {}
    hooks = Hooks(on_model=lambda model: started.update({k: v.clone() for k, v in model.state_dict().items()}))
    run_dir = tmp_path / "tuned"
    cfg = config("translate", data=str(data), init_from=str(marian_dir), batch_size=300, max_steps=8, eval_interval=4,
                 lr=1e-3, warmup_steps=2, device="cpu", out_dir=str(run_dir))  # fmt: skip
    result = train(cfg, verbose=False, hooks=hooks)
    original = from_hf(marian_dir).state_dict()
    assert started.keys() == original.keys() and all(torch.equal(started[k], original[k]) for k in original)
    losses = [row["train_loss"] for row in result.metrics]
    assert losses[-1] < losses[0]  # it learns the pairs (120 of them: the few held out are too noisy to show it)
    tuned = load(run_dir, checkpoint="last")
    assert tuned.tokenizer.kind == "marian" and tuned.tokenizer.encode(SENTENCES[0]) == read_marian_tokenizer(
        marian_dir
    ).encode(SENTENCES[0])  # fmt: skip
    assert not torch.equal(tuned.model.generator.bias, original["generator.bias"])
    capsys.readouterr()
    assert cli_main(["translate", str(run_dir), SENTENCES[0], "--beam", "2"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli_main(["eval", str(run_dir), "--beam", "2"]) == 0
    assert "test  beam 2: BLEU" in capsys.readouterr().out
    assert cli_main(["train", "translate", "--resume", "--out-dir", str(run_dir), "--max-steps", "10"]) == 0
    assert load(run_dir, checkpoint="last").config.schedule.max_steps == 10
    # Back to a MarianMT directory, tokenizer included: transformers computes what qkv does.
    assert cli_main(["convert", str(run_dir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    batch = _hf_tokenizer(tmp_path / "hf")(SENTENCES[:3], return_tensors="pt", padding=True)
    tuned, pad = load(run_dir).model, read_marian_tokenizer(marian_dir).pad_id  # type: ignore[union-attr]
    tgt = torch.full((3, 1), pad)
    with torch.no_grad():
        theirs = _hf_model(tmp_path / "hf")(**batch, decoder_input_ids=tgt).logits
        ours = tuned(batch.input_ids, tgt, batch.attention_mask.bool()[:, None, None, :])
    assert (ours - theirs).abs().max().item() <= TOL


def test_per_side_shapes_load_fine_tune_and_export_with_transformers_logits(
    per_side_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Encoder 3 layers × 4 heads, FFN 48; decoder 1 layer × 2 heads, FFN 96: qkv reads each side as it is, with
    MarianMTModel's logits; `qkv train translate --init-from` fine-tunes it; the export loads in transformers with
    qkv's logits."""
    model = from_hf(per_side_dir)
    assert isinstance(model, Transformer)
    enc, dec = model.cfg.encoder, model.cfg.decoder
    assert (enc.n_layers, enc.block.attention.n_heads, enc.block.ffn.d_ff) == (3, 4, 48)
    assert (dec.n_layers, dec.block.attention.n_heads, dec.block.ffn.d_ff) == (1, 2, 96)
    batch = _hf_tokenizer(per_side_dir)(SENTENCES, return_tensors="pt", padding=True)
    tgt = torch.randint(0, model.cfg.pad_id, (len(SENTENCES), 9))
    tgt[:, 0] = model.cfg.pad_id
    mask = batch.attention_mask.bool()[:, None, None, :]
    with torch.no_grad():
        theirs = _hf_model(per_side_dir)(**batch, decoder_input_ids=tgt).logits
        assert (model(batch.input_ids, tgt, mask) - theirs).abs().max().item() <= TOL
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{de}\t{en}\n" for de, en in _parallel_pairs(120, seed=5)), encoding="utf-8")
    run_dir = tmp_path / "tuned"
    assert cli_main(["train", "translate", "--data", str(data), "--init-from", str(per_side_dir), "--batch-size",
                     "300", "--max-steps", "3", "--eval-interval", "3", "--lr", "1e-3", "--device", "cpu",
                     "--out-dir", str(run_dir)]) == 0  # fmt: skip
    assert cli_main(["convert", str(run_dir), str(tmp_path / "hf"), "--to", "hf"]) == 0
    capsys.readouterr()
    from qkv.tasks import load

    tuned = load(run_dir).model
    assert isinstance(tuned, Transformer) and tuned.cfg == model.cfg
    with torch.no_grad():
        ours = tuned(batch.input_ids, tgt, mask)
        assert (ours - model(batch.input_ids, tgt, mask)).abs().max().item() > 1e-3  # the weights moved
        exported = _hf_model(tmp_path / "hf")
        assert exported.config.decoder_attention_heads == 2 and exported.config.encoder_ffn_dim == 48
        assert (exported(**batch, decoder_input_ids=tgt).logits - ours).abs().max().item() <= TOL
