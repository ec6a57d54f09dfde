"""Translation: the corpus, the loss, decoding (greedy, beam, cache, padding), the toy tasks, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import config

from qkv.attention import MultiHeadAttention, record_attention
from qkv.cli import main
from qkv.io.files import load_safetensors
from qkv.models import Transformer
from qkv.tasks import load, train
from qkv.tasks.toy import SPECIALS, ToyTask, random_sequences
from qkv.training import TrainResult
from qkv.translation.batching import make_batch, source_tensor
from qkv.translation.corpus import (
    DE_EN_COUNT,
    DE_EN_SHA256,
    TEST_SIZE,
    VAL_SIZE,
    Splits,
    clean_side,
    load_de_en,
    pairs_to_tsv,
    parse_dictionary,
    split_de_en,
    tsv_sha256,
)
from qkv.translation.decoding import beam_search, gnmt_coverage_penalty, gnmt_length_penalty, greedy_decode
from qkv.translation.step import label_smoothed_loss

SP = SPECIALS


# ---------------------------------------------------------------------------------------------- corpus


def test_corpus_rules_on_synthetic_lines() -> None:
    lines = [
        "# Version :: devel\n",  # comment
        "Er kommt {vi} morgen. | Wie geht's dir? :: He is coming tomorrow. | How are you?\n",  # two pairs
        "Das ist gut [ugs.]; Das passt. :: That's fine [coll.]; That suits.\n",  # annotations, first alternative
        "Hund {m} | Hunde {pl} :: dog | dogs\n",  # not sentences
        "Ich gehe. :: I go.\n",  # fewer than 3 words
        "Eins zwei drei. | Vier fünf sechs. :: One two three.\n",  # sub-entry counts differ
        "Er kommt   morgen. :: He is coming tomorrow.\n",  # duplicate after collapsing whitespace
        "Wir sind da :: We are here.\n",  # German side has no final punctuation
        "Sind wir da? :: Are we   there?\n",
    ]
    assert parse_dictionary(lines) == [
        ("Er kommt morgen.", "He is coming tomorrow."),
        ("Wie geht's dir?", "How are you?"),
        ("Sind wir da?", "Are we there?"),
    ]
    assert parse_dictionary(["Das ist ja toll! [iron.] :: That's just great! {adj}\n"]) == [
        ("Das ist ja toll!", "That's just great!")
    ]
    assert clean_side(" Das {n} ist [ugs.] es.; Alternative. ") == "Das ist es."


def test_shipped_corpus_count_hash_and_split() -> None:
    pairs = load_de_en()
    assert len(pairs) == DE_EN_COUNT == 19767
    assert tsv_sha256(pairs_to_tsv(list(pairs))) == DE_EN_SHA256
    splits = split_de_en()
    assert (len(splits.tests["test"]), len(splits.val)) == (TEST_SIZE, VAL_SIZE) == (1000, 1000)
    assert len(splits.train) == DE_EN_COUNT - 2000
    assert not set(splits.tests["test"]) & set(splits.train) and not set(splits.val) & set(splits.train)
    assert split_de_en().tests["test"] == splits.tests["test"]  # deterministic


# ---------------------------------------------------------------------------------------------- loss


def test_label_smoothed_loss_matches_hand_computation() -> None:
    logits = torch.tensor([[[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 0.4], [9.0, 9.0, 9.0, 9.0]]])  # (1, 3, V=4)
    target = torch.tensor([[1, 3, 0]])  # the last position is padding (id 0): not counted
    eps, v = 0.1, 4
    by_hand = []
    for t in range(2):
        logp = [x - math.log(sum(math.exp(y) for y in logits[0, t].tolist())) for x in logits[0, t].tolist()]
        gold = int(target[0, t])
        # q = (1 − ε)·one-hot + ε/V on every class: −Σ q log p
        by_hand.append(-(1 - eps) * logp[gold] - eps / v * sum(logp))
    expected = sum(by_hand) / 2
    assert float(label_smoothed_loss(logits, target, pad=0, smoothing=eps)) == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------------------------- toy tasks


class ToyResult:
    """A toy run's result and its trained model (the last weights)."""

    def __init__(self, result: TrainResult) -> None:
        self.result, self.model = result, load(result.run_dir, "last").model
        self.train_seconds = result.metrics[-1]["train_s"]
        self.exact_match = result.final["val_exact_match"]

    def __repr__(self) -> str:
        return f"ToyResult({self.result.final}, {self.train_seconds:.1f} s)"


def toy_model(n_symbols: int = 10, d_model: int = 64) -> Transformer:
    """An untrained model of the copy task's shape."""
    return ToyTask(config("copy", n_symbols=n_symbols, model={"d_model": d_model})).build_model()


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory: pytest.TempPathFactory) -> ToyResult:
    """The copy task, trained once for this module (also serves the decoding tests)."""
    out = tmp_path_factory.mktemp("copy") / "run"
    return ToyResult(train(config("copy", max_steps=300, out_dir=str(out)), verbose=False))


def test_copy_task_is_learned_exactly(copy_run: ToyResult) -> None:
    assert copy_run.train_seconds <= 60.0
    assert copy_run.exact_match == 1.0, copy_run


def test_reverse_task_is_learned_exactly(tmp_path: Path) -> None:
    result = ToyResult(train(config("reverse", max_steps=300, out_dir=str(tmp_path / "run")), verbose=False))
    assert result.train_seconds <= 60.0
    assert result.exact_match == 1.0, result


# ---------------------------------------------------------------------------------------------- decoding


def _mixed_sources(n: int = 12, seed: int = 3) -> torch.Tensor:
    """Sources of lengths 4 … 15 (so rows are padded by different amounts)."""
    gen = torch.Generator().manual_seed(seed)
    return source_tensor([random_sequences(1, 4 + i, 10, gen)[0] for i in range(n)], SP)


def test_beam_of_one_is_greedy(copy_run: ToyResult) -> None:
    src = _mixed_sources()
    assert beam_search(copy_run.model, src, SP, beam_size=1) == greedy_decode(copy_run.model, src, SP)
    untrained = toy_model().eval()  # flat distributions: the hard case for tie-free equivalence
    assert beam_search(untrained, src, SP, beam_size=1, max_len=12) == greedy_decode(untrained, src, SP, max_len=12)
    # Each sentence's own limit, which the untrained model's outputs reach: the same in both.
    assert beam_search(untrained, src, SP, beam_size=1) == greedy_decode(untrained, src, SP)


def test_greedy_edges_and_half_precision(copy_run: ToyResult) -> None:
    """No sentences, no tokens allowed, a row of padding only: empty outputs. A bfloat16 model decodes in the engine
    as in one padded batch."""
    model, src = copy_run.model, _mixed_sources(6)
    assert greedy_decode(model, src[:0], SP) == []
    assert greedy_decode(model, src, SP, max_len=0) == [[]] * 6
    padded = torch.cat([src[:2], torch.full_like(src[:1], SP.pad)])
    assert greedy_decode(model, padded, SP)[2] == []
    half = ToyTask(config("copy", n_symbols=10)).build_model().eval()
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)
    assert greedy_decode(half, src, SP, max_len=20) == greedy_decode(half, src, SP, max_len=20, use_cache=False)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_decoding_builds_no_graph_on_one_thread(decode: Any) -> None:
    """Each decoding step runs without autograd and on one CPU thread (tiny B × d_model products)."""
    model, seen = toy_model().eval(), []
    for module in model.modules():  # the decoders call the model's parts, not its forward
        module.register_forward_hook(lambda *_: seen.append((torch.is_grad_enabled(), torch.get_num_threads())))
    decode(model, _mixed_sources(2), SP, max_len=3)
    assert seen and set(seen) == {(False, 1)}


@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_batched_beam_equals_one_by_one(copy_run: ToyResult, which: str, beta: float) -> None:
    model = copy_run.model if which == "trained" else toy_model().eval()
    src = _mixed_sources()
    batched = beam_search(model, src, SP, beam_size=4, max_len=20, coverage_penalty=beta)
    alone = [beam_search(model, row[row != SP.pad][None], SP, 4, max_len=20, coverage_penalty=beta)[0] for row in src]
    assert batched == alone


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_greedy_in_few_slots_equals_each_sentence_alone(copy_run: ToyResult, which: str) -> None:
    """Twelve sentences through three engine slots (each one's slot taken by the next as it ends), each limited by
    its own length: every translation is the one the sentence gets alone, and the untrained model's reach that
    limit."""
    model = copy_run.model if which == "trained" else toy_model().eval()
    src = _mixed_sources()
    together = greedy_decode(model, src, SP, slots=3)
    alone = [greedy_decode(model, row[row != SP.pad][None], SP, slots=1)[0] for row in src]
    assert together == alone
    limits = [int(len(row[row != SP.pad]) * 1.5) + 10 for row in src]
    if which == "untrained":
        assert any(len(out) == limit for out, limit in zip(together, limits, strict=True))
    assert all(len(out) <= limit for out, limit in zip(together, limits, strict=True))


def test_a_decoder_without_slots_decodes_greedy_in_its_own_cache() -> None:
    """A sliding-window cache has no slots (nor has a latent one): greedy decoding keeps the padded batch in the
    model's own cache, token for token what re-reading every prefix gives."""
    from qkv.attention import SlidingWindowAttentionConfig

    layer = SlidingWindowAttentionConfig(n_heads=4, window=6)
    model = toy_model().cfg.override({"decoder.block.attention": layer}).build().eval()
    src = _mixed_sources(6)
    assert greedy_decode(model, src, SP, max_len=20) == greedy_decode(model, src, SP, max_len=20, use_cache=False)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_cached_and_uncached_decoding_agree(copy_run: ToyResult, beta: float) -> None:
    untrained = toy_model().eval()
    for model in (copy_run.model, untrained):
        src = _mixed_sources(6)
        assert greedy_decode(model, src, SP, max_len=20) == greedy_decode(model, src, SP, max_len=20, use_cache=False)
        cached = beam_search(model, src, SP, beam_size=3, max_len=20, coverage_penalty=beta)
        assert cached == beam_search(model, src, SP, 3, max_len=20, use_cache=False, coverage_penalty=beta)


def test_coverage_penalty_known_numbers() -> None:
    coverage = torch.tensor([[0.5, 2.0, 0.25, 0.0]])  # source token 2 over-attended, the last one is padding
    pad = torch.tensor([[False, False, False, True]])
    expected = 0.2 * (math.log(0.5) + math.log(1.0) + math.log(0.25))  # min(·, 1) caps the over-attended token
    assert gnmt_coverage_penalty(coverage, pad, 0.2).item() == pytest.approx(expected, rel=1e-6)
    assert gnmt_coverage_penalty(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0.7).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("beta", [0.0, 0.5, 3.0])
def test_wide_beam_finds_the_best_scoring_sequence(beta: float) -> None:
    """A beam wide enough to keep every prefix is exhaustive: its winner must be the argmax of GNMT's score.

    The score is recomputed here from scratch for every possible output: teacher-forced log P over
    the whole sequence, the length penalty, and coverage summed from the decoder's cross-attention maps.
    """
    torch.manual_seed(0)
    model = toy_model(n_symbols=3, d_model=32).eval()  # 6 tokens: <pad> <s> </s> and 3 digits
    with torch.no_grad():  # sharpen the cross-attention, so coverage differs from one output to the next
        for layer in model.decoder.layers:
            layer.cross_attn.q_proj.weight.mul_(12.0)  # type: ignore[union-attr]
    # An untrained model never ends a sentence; favour </s> so that short and finished hypotheses compete
    # (and the coverage of a finished one must stay frozen), and rule out <pad> and <s> as a trained one would.
    bias = torch.zeros(6)
    bias[SP.eos], bias[SP.pad], bias[SP.bos] = 4.0, -20.0, -20.0
    model.generator.register_forward_hook(lambda module, inputs, logits: logits + bias)
    vocab, max_len, alpha = 6, 3, 0.6
    last_cross = f"decoder.layers.{len(model.decoder.layers) - 1}.cross_attn"
    gen = torch.Generator().manual_seed(1)
    for src_len in (2, 3, 4, 5, 6):
        src = source_tensor(random_sequences(1, src_len, 3, gen), SP)  # (1, S)
        outputs = [[SP.eos]] + [[a, SP.eos] for a in range(vocab) if a != SP.eos]
        outputs += [[a, b, c] for a in range(vocab) for b in range(vocab) for c in range(vocab) if SP.eos not in (a, b)]
        with torch.no_grad():
            memory = model.encode(src)
            best, best_score = None, -math.inf
            for out in outputs:
                tgt_in = torch.tensor([[SP.bos, *out[:-1]]])
                with record_attention(model, only=last_cross) as recorder:  # as beam search records it
                    logits = model.decode(tgt_in, memory)
                log_p = logits.log_softmax(-1)[0, torch.arange(len(out)), torch.tensor(out)].sum()
                cross = recorder.weights_of(last_cross)[0]  # (1, H, T, S)
                coverage = cross[0].mean(0).sum(0)  # (S,): attention each source token received
                no_pad = torch.zeros_like(coverage, dtype=torch.bool)
                score = log_p / gnmt_length_penalty(torch.tensor(len(out)), alpha)
                score = float(score + gnmt_coverage_penalty(coverage, no_pad, beta))
                if score > best_score:
                    best, best_score = out, score
        assert best is not None
        expected = best[: best.index(SP.eos)] if SP.eos in best else best
        expected = expected[: expected.index(SP.pad)] if SP.pad in expected else expected  # as decoding strips
        assert beam_search(model, src, SP, vocab**2, alpha, max_len, coverage_penalty=beta)[0] == expected


def test_cross_attention_keys_are_computed_once(copy_run: ToyResult) -> None:
    calls = []
    layers = [layer.cross_attn for layer in copy_run.model.decoder.layers]
    assert all(isinstance(attn, MultiHeadAttention) for attn in layers)
    hooks = [attn.k_proj.register_forward_hook(lambda *a: calls.append(1)) for attn in layers]  # type: ignore[union-attr]
    try:
        beam_search(copy_run.model, _mixed_sources(4), SP, beam_size=4, max_len=15)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(layers)  # once per layer for the whole search, not once per step


def test_padding_changes_nothing(copy_run: ToyResult) -> None:
    model = copy_run.model
    gen = torch.Generator().manual_seed(7)
    short = random_sequences(1, 6, 10, gen)[0]
    longer = [random_sequences(1, n, 10, gen)[0] for n in (14, 11)]
    targets = [short[:3], longer[0][:8], longer[1][:5]]
    batch = make_batch([short, *longer], targets, SP)  # short is padded on both sides
    alone = make_batch([short], targets[:1], SP)
    with torch.no_grad():
        logits_batch = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)[0, : alone.tgt_in.shape[1]]
        logits_alone = model(alone.src, alone.tgt_in, alone.src_mask, alone.tgt_mask)[0]
    assert torch.allclose(logits_batch, logits_alone, atol=1e-5, rtol=0)
    for decode in (greedy_decode, beam_search):
        # The same max_len for both: by default it grows with the batch's longest source.
        assert decode(model, batch.src, SP, max_len=25)[0] == decode(model, alone.src, SP, max_len=25)[0]
    covered = [beam_search(model, src, SP, 4, max_len=25, coverage_penalty=0.5)[0] for src in (batch.src, alone.src)]
    assert covered[0] == covered[1]


# ---------------------------------------------------------------------------------------------- CLI


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """qkv.cli.main → (exit code, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "translate", str(tmp_path / "missing"), "Wie geht es dir?")
    assert code == 2 and "no such file or directory" in err and err.count("\n") == 1
    lm_run = tmp_path / "lm"
    lm_run.mkdir()
    config = {"format": "qkv-run/1", "model_type": "decoder_lm", "model": {}, "training": {}}
    (lm_run / "config.json").write_text(json.dumps(config))
    code, err = _run(capsys, "translate", str(lm_run), "Wie geht es dir?")
    assert code == 2 and "not a translation model" in err and err.count("\n") == 1
    code, err = _run(capsys, "eval", str(lm_run), "--coverage-penalty", "0.2")
    assert code == 2 and "for translation runs" in err and err.count("\n") == 1
    code, err = _run(capsys, "translate", str(lm_run), "   ")
    assert code == 2 and "empty" in err and err.count("\n") == 1
    code, err = _run(capsys, "train", "translate", "--block-size", "8")
    assert code == 2 and "language-model option" in err and err.count("\n") == 1
    code, err = _run(capsys, "eval", str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture
def tiny_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train on 300 Ding pairs and validate on 20, so a whole run (corpus="ding") takes seconds."""
    full = split_de_en()
    small = Splits(train=full.train[:300], val=full.val[:20], tests={"test": full.tests["test"][:20]})
    monkeypatch.setattr("qkv.tasks.translate.split_de_en", lambda: small)


def test_resume_takes_the_same_steps(tmp_path: Path, tiny_corpus: None, capsys: pytest.CaptureFixture[str]) -> None:
    tiny: dict[str, Any] = dict(corpus="ding", vocab_size=300, model={"d_model": 32, "n_heads": 2, "d_ff": 64,
                "n_encoder_layers": 1, "n_decoder_layers": 1}, batch_size=200, max_steps=4, eval_interval=2,
                device="cpu")  # fmt: skip
    whole = train(config("translate", **tiny, max_time=1e4, out_dir=str(tmp_path / "a")), verbose=False)
    cut = train(config("translate", **tiny, max_time=1e-3, out_dir=str(tmp_path / "b")), verbose=False)
    assert cut.step == 1  # the time budget stopped it after one step, with a checkpoint
    resumed = train(config("translate", **tiny, max_time=1e4, out_dir=str(tmp_path / "b"), resume=True))
    assert whole.step == resumed.step == 4
    a, b = (load_safetensors(tmp_path / d / "last.safetensors") for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    stored = json.loads((tmp_path / "a" / "config.json").read_text())
    assert stored["model_type"] == "transformer"
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and all("val_bleu" in r and "val_loss" in r for r in rows)
    assert (tmp_path / "a" / "loss.png").is_file() and (tmp_path / "a" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["translate", str(tmp_path / "a"), "Wie geht es dir?", "--beam", "2"]) == 0
    translation = capsys.readouterr().out
    assert translation.strip()
    # Options may also come between the run directory and the sentence.
    assert main(["translate", str(tmp_path / "a"), "--beam", "2", "Wie geht es dir?"]) == 0
    assert capsys.readouterr().out == translation
    assert main(["translate", str(tmp_path / "a"), "Wie geht es dir?", "--beam", "2", "--coverage-penalty", "0",
                 "--length-penalty", "1.0"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip()
    code, err = _run(capsys, "translate", str(tmp_path / "a"), "Wie?", "--coverage-penalty", "-1")
    assert code == 2 and "must be ≥ 0" in err and err.count("\n") == 1
    code, err = _run(capsys, "generate", str(tmp_path / "a"))  # a translation run is not a language model
    assert code == 2 and "not a language model" in err and err.count("\n") == 1


def test_lab_attention_map_of_a_translation_run(tmp_path: Path, tiny_corpus: None) -> None:
    """`qkv lab attention-map` on an encoder–decoder run: encoder self-, decoder self- and cross-attention."""
    from qkv.lab.attention_map import attention_map

    tiny: dict[str, Any] = dict(corpus="ding", vocab_size=300, model={"d_model": 32, "n_heads": 2, "d_ff": 64,
                "n_encoder_layers": 1, "n_decoder_layers": 2}, batch_size=200, max_steps=2, eval_interval=2,
                device="cpu")  # fmt: skip
    train(config("translate", **tiny, out_dir=str(tmp_path / "run")), verbose=False)
    result = attention_map(tmp_path / "run", "Wie geht es dir?")
    kinds = [m.kind for m in result.maps]
    assert kinds == ["encoder", "decoder", "decoder", "cross", "cross"]
    cross = result.maps[-1]
    assert cross.weights.shape[-1] == len(cross.key_tokens)  # keys: the source tokens
    assert cross.weights.shape[-2] == len(cross.query_tokens)  # queries: the target tokens
    assert abs(float(cross.weights.sum(-1).mean()) - 1.0) < 1e-5
