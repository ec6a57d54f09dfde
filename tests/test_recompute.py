"""Activation checkpointing (qkv.training.recompute): the gradients of the plain run, for every model kind and with
dropout (its random state is replayed), and a training run through the loop that logs the plain run's losses."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import config, model_cfg, tiny_data, tiny_settings

from qkv import DecoderLM
from qkv.models import DecoderLMConfig, EncoderConfig, EncoderModel, Transformer, TransformerConfig
from qkv.training.recompute import checkpoint_layers, layers_of


def _grads(model: torch.nn.Module, loss_of: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # the same dropout draws for both runs
    loss_of(model).backward()  # type: ignore[operator]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["decoder", "transformer", "encoder"])
def test_gradients_equal_the_plain_runs(kind: str) -> None:
    ids = torch.randint(40, (3, 12))
    if kind == "decoder":
        model: torch.nn.Module = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=40, d_model=32, n_layers=3, n_heads=4,
                                                     dropout=0.1))  # fmt: skip
        loss_of = lambda m: m(ids).logsumexp(-1).mean()  # noqa: E731
    elif kind == "transformer":
        model = Transformer(model_cfg(TransformerConfig, src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4,
                                      n_encoder_layers=2, n_decoder_layers=2, dropout=0.1))  # fmt: skip
        loss_of = lambda m: m(ids, ids).logsumexp(-1).mean()  # noqa: E731
    else:
        model = EncoderModel(model_cfg(EncoderConfig, vocab_size=40, d_model=32, n_layers=2, n_heads=4, dropout=0.1))
        loss_of = lambda m: m(ids).hidden.square().mean()  # noqa: E731
    model.train()
    recomputed = copy.deepcopy(model)
    assert checkpoint_layers(recomputed) == len(layers_of(model)) >= 2
    plain, again = _grads(model, loss_of), _grads(recomputed, loss_of)
    assert plain.keys() == again.keys()
    for name in plain:
        assert torch.allclose(plain[name], again[name], rtol=0, atol=1e-6), name


def test_without_gradients_a_layer_runs_as_before() -> None:
    model = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=40, d_model=32, n_layers=2, n_heads=4)).eval()
    ids = torch.randint(40, (2, 9))
    expected = model(ids)
    checkpoint_layers(model)
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


def test_a_run_with_activation_checkpointing_logs_the_plain_runs_losses(tmp_path: Path) -> None:
    from qkv.tasks import train

    settings = {**tiny_settings("lm", tiny_data(tmp_path / "data")), "model": {"n_layers": 2, "dropout": 0.1}}
    for name, recompute in (("plain", False), ("recomputed", True)):
        train(config("lm", **settings, activation_checkpointing=recompute, out_dir=str(tmp_path / name)),
              verbose=False)  # fmt: skip
    plain, again = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                    for name in ("plain", "recomputed"))  # fmt: skip
    assert [m["train_loss"] for m in again] == pytest.approx([m["train_loss"] for m in plain], abs=1e-6)
    stored = json.loads((tmp_path / "recomputed" / "config.json").read_text())["training"]
    assert stored["system"]["activation_checkpointing"]
