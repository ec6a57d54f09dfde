"""The masked-language-model task: BERT's masking (15 % selected, 80/10/10), the gathered MLM head, a trained
encoder that loads back, restores masked tokens, and shows its attention maps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import config, model_cfg, one_thread, run_main, tiny_data, tiny_settings

from qkv.lab.attention_map import attention_map
from qkv.models import EncoderConfig, EncoderModel
from qkv.tasks import load, train
from qkv.tasks.mlm import MLMRun, mask_tokens


def test_masking_follows_bert_statistics() -> None:
    """Of each window, round(15 %) positions are predicted: 80 % of them <mask>, 10 % random, 10 % unchanged."""
    gen = torch.Generator().manual_seed(0)
    b, t, vocab, mask_id = 2000, 100, 50, 1
    ids = torch.randint(2, vocab, (b, t), generator=gen)
    order, choice = torch.rand(b, t, generator=gen), torch.rand(b, t, generator=gen)
    random_ids = torch.randint(2, vocab, (b, t), generator=gen)
    n = config("mlm").n_selected(t)
    assert n == 15
    inputs, positions, labels = mask_tokens(ids, order, choice, random_ids, n, mask_id)
    assert positions.shape == labels.shape == (b, n)
    assert (positions.diff(dim=1) > 0).all()  # distinct positions, in order
    assert torch.equal(labels, ids.gather(1, positions))  # the labels are the original tokens
    selected = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, positions, True)
    assert torch.equal(inputs[~selected], ids[~selected])  # nothing else changes
    at = inputs.gather(1, positions)
    masked = (at == mask_id).float().mean().item()
    replaced = ((at != mask_id) & (at != labels)).float().mean().item()
    kept = (at == labels).float().mean().item()
    # 30,000 selected positions: the shares are within 1 % of 80/10/10 (a random replacement may equal the label).
    assert masked == pytest.approx(0.8, abs=0.01)
    assert replaced == pytest.approx(0.1 * (1 - 1 / (vocab - 2)), abs=0.01)
    assert kept == pytest.approx(0.1 + 0.1 / (vocab - 2), abs=0.01)
    # Every position is equally likely to be selected.
    share = selected.float().mean(0)
    assert share.min().item() > 0.12 and share.max().item() < 0.18


def test_the_gathered_head_equals_the_full_one() -> None:
    cfg = model_cfg(EncoderConfig, vocab_size=30, d_model=16, n_heads=2, n_layers=1, max_positions=12, pooler=False,
                    mlm_head=True, dropout=0.0)  # fmt: skip
    model = EncoderModel(cfg).eval()
    ids = torch.randint(0, 30, (3, 12))
    positions = torch.tensor([[0, 5], [3, 11], [2, 7]])
    with torch.no_grad():
        full = model(ids).logits
        gathered = model(ids, mlm_positions=positions).logits
    assert full is not None and gathered is not None
    assert torch.allclose(gathered, full.gather(1, positions[..., None].expand(-1, -1, 30)), atol=1e-6)
    assert model.mlm_head is not None and model.mlm_head.output.weight is model.embed.tokens.weight  # tied


def test_a_trained_encoder_loads_restores_and_shows_attention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_data(tmp_path / "data")
    with one_thread():
        result = train(config("mlm", **tiny_settings("mlm", data) | {"max_steps": 4}, out_dir=str(tmp_path / "run")),
                       verbose=False)  # fmt: skip
    assert set(result.final) == {"val_loss", "val_accuracy"} and 0 <= result.final["val_accuracy"] <= 1
    run = load(result.run_dir)
    assert isinstance(run, MLMRun) and isinstance(run.model, EncoderModel)
    filled = run.fill_mask("ROMEO: But, <mask>! what <mask>", top_k=2)
    assert len(filled) == 2 and all(len(options) == 2 for options in filled)
    code, out, err = run_main(capsys, "eval", str(result.run_dir), "--batch-size", "7")
    assert (code, err) == (0, "")
    match = re.fullmatch(r"masked-token accuracy (\d\.\d{4})  loss (\d+\.\d{4})  \([\d,]+ predicted positions, best "
                         r"weights\); always the commonest token: \d\.\d{4} \(\d+\.\d×\)\n", out)  # fmt: skip
    assert match, out
    # The same masks whatever the batch size: `qkv eval` scores what training's evaluation scored.
    best = min(result.metrics, key=lambda r: r["val_loss"])
    assert float(match.group(2)) == pytest.approx(best["val_loss"], abs=1e-4)
    assert float(match.group(1)) == pytest.approx(best["val_accuracy"], abs=1e-4)
    maps = attention_map(result.run_dir, "ROMEO: But, soft!")
    assert maps.model_type == "encoder" and [m.kind for m in maps.maps] == ["self"]
    weights = maps.maps[0].weights  # (heads, T, T): bidirectional, every row sums to 1
    assert weights.shape[0] == 2 and (weights[:, 0, 1:] > 0).any()
    assert abs(float(weights.sum(-1).mean()) - 1) < 1e-5
    code, _, err = run_main(capsys, "generate", str(result.run_dir))
    assert code == 2 and "holds a masked language model run, not a language model" in err
