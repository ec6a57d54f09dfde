"""Pinned losses of a named, fixed recipe per task, so that a change of the loop's behaviour cannot go unnoticed.

The recipe "tiny-2026-11" is written out here in full, not taken from any default (defaults change with
the recipes they serve): one-layer models, the first 20,000 characters of the embedded Shakespeare and the
first 300 embedded Ding pairs, 6 steps, one thread. Its losses were recorded when the loop was rebuilt
around tasks; at that commit the default runs reproduced the previous loops' weights bit for bit. The masked
LM's validation losses moved once, when text files began to be read through `qkv prepare`: a BPE's
end-of-text token now follows the document, so its validation split ends with one more token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import config, one_thread

from qkv.data import load_shakespeare
from qkv.tasks import train
from qkv.translation.corpus import load_de_en

MODEL = {"d_model": 32, "n_heads": 2, "dropout": 0.0}
SEQ2SEQ = {**MODEL, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1}
COMMON = {"device": "cpu", "eval_interval": 3, "warmup_steps": 2, "max_steps": 6, "seed": 7, "optimizer": "adamw"}
RECIPE: dict[str, dict[str, Any]] = {  # "tiny-2026-11"
    "lm": {
        **COMMON,
        "block_size": 32,
        "batch_size": 4,
        "model": {**MODEL, "n_layers": 1, "n_kv_heads": None},
        "sample_tokens": 0,
        "lr": 3e-3,
        "eval_tokens": None,
    },
    "mlm": {**COMMON, "block_size": 32, "batch_size": 4, "vocab_size": 300, "model": {**MODEL, "n_layers": 1}},
    "translate": {**COMMON, "vocab_size": 300, "batch_size": 200, "model": SEQ2SEQ, "max_time": None},
    "copy": {**COMMON, "batch_size": 8, "length": 8, "min_length": 3, "n_test": 20, "model": SEQ2SEQ},
    "reverse": {**COMMON, "batch_size": 8, "length": 8, "n_test": 20, "model": SEQ2SEQ},
}
# (step, train loss, val loss) at each evaluation of the recipe.
PINNED: dict[str, list[tuple[int, float, float]]] = {
    "lm": [(3, 4.083215, 3.955195), (6, 3.889835, 3.853411)],
    "mlm": [(3, 5.684248, 5.571249), (6, 5.544160, 5.487862)],
    "translate": [(3, 5.680507, 5.393814), (6, 5.396280, 5.248894)],
    "copy": [(3, 3.845117, 3.183314), (6, 3.018368, 2.860922)],
    "reverse": [(3, 3.741075, 3.113053), (6, 3.072047, 2.808572)],
}


@pytest.mark.parametrize("task", list(RECIPE))
def test_the_pinned_recipe_keeps_its_losses(task: str, tmp_path: Path) -> None:
    data = {"text": tmp_path / "text.txt", "pairs": tmp_path / "pairs.tsv"}
    data["text"].write_text(load_shakespeare()[:20_000], encoding="utf-8")
    data["pairs"].write_text("".join(f"{de}\t{en}\n" for de, en in load_de_en()[:300]), encoding="utf-8")
    settings = dict(RECIPE[task])
    if task in ("lm", "mlm"):
        settings["data"] = str(data["text"])
    elif task == "translate":
        settings["data"] = str(data["pairs"])
    with one_thread():
        result = train(config(task, **settings, out_dir=str(tmp_path / "run")), verbose=False)
    got = [(r["step"], r["train_loss"], r["val_loss"]) for r in result.metrics]
    assert [step for step, _, _ in got] == [step for step, _, _ in PINNED[task]]
    for (_, train_loss, val_loss), (_, want_train, want_val) in zip(got, PINNED[task], strict=True):
        assert train_loss == pytest.approx(want_train, abs=1e-4)  # float sums may differ across CPUs, not more
        assert val_loss == pytest.approx(want_val, abs=1e-4)
