"""Tests for qkv.io.files and qkv.training.checkpoint: atomic writes, safetensors and JSON state, clear load errors."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qkv.errors import QkvError
from qkv.io import files
from qkv.training import checkpoint as ckpt
from qkv.training import train_state
from qkv.training.distributed import DistContext


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """Take ``steps`` deterministic AdamW steps on a fixed regression batch."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _model_and_opt(seed: int = 0) -> tuple[nn.Linear, torch.optim.AdamW]:
    """A tiny model and its AdamW optimizer, identical for equal seeds."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, foreach=False)
    return model, opt


def _no_temp_files(directory: Path) -> bool:
    """True if no atomic-write temp file was left behind."""
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


# --- atomic writes ----------------------------------------------------------------------------


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    """A successful write replaces the file and cleans up."""
    target = tmp_path / "a.json"
    files.atomic_write_json(target, {"x": 1})
    files.atomic_write_json(target, {"x": 2})
    assert files.load_json(target) == {"x": 2}
    assert _no_temp_files(tmp_path)


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_atomic_write_failure_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """If the write dies before the rename, the old file is intact and no temp file remains."""
    target = tmp_path / "w.safetensors"
    files.atomic_save_safetensors(target, {"w": torch.ones(3)})

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="simulated crash"):
        files.atomic_save_safetensors(target, {"w": torch.zeros(3)})
    monkeypatch.undo()
    assert torch.equal(files.load_safetensors(target)["w"], torch.ones(3))
    assert _no_temp_files(tmp_path)


def test_save_safetensors_handles_tied_and_strided_tensors(tmp_path: Path) -> None:
    """Shared storage (tied weights) and non-contiguous views are saved, not refused."""
    emb = torch.randn(5, 3)
    tensors = {"embed": emb, "lm_head": emb, "t": emb.t(), "row": emb[1]}
    files.atomic_save_safetensors(tmp_path / "m.safetensors", tensors, metadata={"note": "hi"})
    loaded = files.load_safetensors(tmp_path / "m.safetensors")
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t), name


# --- refusing pickle and reporting malformed files -------------------------------------------


def test_refuses_torch_save_files(tmp_path: Path) -> None:
    """torch.save output is refused by suffix and, when renamed, by its magic bytes."""
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    with pytest.raises(QkvError) as info:
        files.load_safetensors(pt)
    assert str(info.value) == f"refusing to load pickle file {pt}: qkv only reads safetensors and JSON"
    disguised = tmp_path / "model.safetensors"
    disguised.write_bytes(pt.read_bytes())
    with pytest.raises(QkvError, match=r"refusing to load pickle file .*model\.safetensors"):
        files.load_safetensors(disguised)
    legacy = tmp_path / "legacy.json"  # old non-zip torch.save format is a raw pickle stream
    torch.save({"w": 1}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(QkvError, match="refusing to load pickle file"):
        files.load_json(legacy)


def test_truncated_and_garbage_safetensors(tmp_path: Path) -> None:
    """Malformed safetensors files name the file and the reason."""
    good = tmp_path / "good.safetensors"
    files.atomic_save_safetensors(good, {"w": torch.arange(100.0)})
    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(QkvError, match=r"trunc\.safetensors is damaged or incomplete \(.+\); copy or write it again"):
        files.load_safetensors(truncated)
    cut_header = tmp_path / "cut.safetensors"
    cut_header.write_bytes(good.read_bytes()[:20])
    with pytest.raises(QkvError, match=r"cut\.safetensors is damaged or incomplete \(header claims"):
        files.load_safetensors(cut_header)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"hello")
    with pytest.raises(QkvError, match="shorter than the 8-byte header length"):
        files.load_safetensors(garbage)


def test_missing_and_malformed_json(tmp_path: Path) -> None:
    """Missing files and JSON syntax errors produce one-line messages with the line number."""
    with pytest.raises(QkvError, match=r"file not found: .*nope\.json"):
        files.load_json(tmp_path / "nope.json")
    with pytest.raises(QkvError, match="file not found"):
        files.load_safetensors(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "a": 1,\n  "b": \n}\n')
    with pytest.raises(QkvError) as info:
        files.load_json(bad)
    assert str(info.value).startswith(f"{bad} is not valid JSON (line 4: ")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(QkvError, match="must contain a JSON object"):
        files.load_json(listed)


# --- optimizer and RNG state -----------------------------------------------------------------


def test_optimizer_state_round_trip_is_exact(tmp_path: Path) -> None:
    """A restored AdamW continues bit-for-bit like the original."""
    model_a, opt_a = _model_and_opt()
    _train(model_a, opt_a, steps=3, seed=1)
    tensors, meta = train_state.optimizer_state_to_safetensors(opt_a)
    assert isinstance(opt_a.state_dict()["state"][0]["step"], torch.Tensor)
    files.atomic_save_safetensors(tmp_path / "o.safetensors", tensors)
    files.atomic_write_json(tmp_path / "o.json", meta)

    model_b, opt_b = _model_and_opt(seed=123)  # different init: everything must come from disk
    model_b.load_state_dict(model_a.state_dict())
    sd = train_state.optimizer_state_from_safetensors(
        files.load_safetensors(tmp_path / "o.safetensors"), files.load_json(tmp_path / "o.json")
    )
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["betas"] == (0.8, 0.95)
    assert opt_b.param_groups[0]["foreach"] is False

    _train(model_a, opt_a, steps=4, seed=2)
    _train(model_b, opt_b, steps=4, seed=2)
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_optimizer_non_tensor_state_survives() -> None:
    """Plain Python values in optimizer state go through the JSON half."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt.state[p]["counter"] = 7
    opt.state[p]["momentum_buffer"] = torch.full((2,), 0.5)
    tensors, meta = train_state.optimizer_state_to_safetensors(opt)
    assert set(tensors) == {"state.0.momentum_buffer"}
    sd = train_state.optimizer_state_from_safetensors(tensors, json.loads(json.dumps(meta)))
    assert sd["state"][0]["counter"] == 7


def test_rng_round_trip() -> None:
    """Restored RNG states replay the same draws for torch, random, numpy and a Generator."""
    gen = torch.Generator().manual_seed(42)
    random.gauss(0, 1)  # leave a cached gaussian so gauss_next is non-None
    tensors, meta = train_state.rng_state_to_tensors()
    meta = json.loads(json.dumps(meta))  # must survive JSON
    gen_state = train_state.generator_state(gen)

    def draw() -> tuple[torch.Tensor, list[float], np.ndarray, torch.Tensor]:
        return (
            torch.rand(5),
            [random.random(), random.gauss(0, 1)],
            np.random.rand(5),
            torch.randint(0, 1000, (5,), generator=gen),
        )

    first = draw()
    train_state.restore_rng_state(tensors, meta)
    train_state.set_generator_state(gen, gen_state)
    second = draw()
    assert torch.equal(first[0], second[0])
    assert first[1] == second[1]
    assert np.array_equal(first[2], second[2])
    assert torch.equal(first[3], second[3])


# --- whole training state ------------------------------------------------------------------------


ONE = DistContext(0, 1, "ddp", torch.device("cpu"))  # one process, no process group


def test_training_state_round_trip(tmp_path: Path) -> None:
    """save/load_checkpoint restores weights, optimizer (hyperparameters too), RNGs, generators and counters."""
    model_a, opt_a = _model_and_opt()
    _train(model_a, opt_a, steps=2, seed=1)
    gen = torch.Generator().manual_seed(7)
    extra = {"step": 2, "tokens_seen": 1024, "best": 1.5}
    ckpt.save_checkpoint(tmp_path / "run", model_a, opt_a, extra, {"data": gen}, ONE, frozen=False).wait()
    expected = (torch.rand(3), torch.rand(3, generator=gen))

    model_b, opt_b = _model_and_opt(seed=9)
    opt_b.param_groups[0]["lr"] = 0.5  # the checkpoint's hyperparameters come back
    gen_b = torch.Generator().manual_seed(0)
    assert ckpt.load_checkpoint(tmp_path / "run", model_b, opt_b, {"data": gen_b}, ONE, set()) == extra
    assert opt_b.param_groups[0]["lr"] == 1e-2 and opt_b.param_groups[0]["betas"] == (0.8, 0.95)
    assert torch.equal(torch.rand(3), expected[0])
    assert torch.equal(torch.rand(3, generator=gen_b), expected[1])
    _train(model_a, opt_a, steps=2, seed=3)
    _train(model_b, opt_b, steps=2, seed=3)
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_training_state_errors(tmp_path: Path) -> None:
    """Missing, damaged or mismatched checkpoints raise QkvError naming the problem."""
    run = tmp_path / "run"
    model, opt = _model_and_opt()
    with pytest.raises(QkvError) as info:
        ckpt.load_checkpoint(run, model, opt, {}, ONE, set())
    assert str(info.value) == (f"no checkpoint to resume in {run} (checkpoint/latest.json missing): a run that "
                               "stopped before its first save starts again without --resume")
    _train(model, opt, steps=1, seed=1)
    ckpt.save_checkpoint(run, model, opt, {"step": 1}, {}, ONE, frozen=False).wait()
    with pytest.raises(QkvError, match="has no state for generator"):
        ckpt.load_checkpoint(run, model, opt, {"data": torch.Generator()}, ONE, set())
    big = nn.Linear(4, 2)
    unfit = r"checkpoint .*step-00000001 is damaged or does not fit this run's model or optimizer \(ValueError: Size"
    with pytest.raises(QkvError, match=unfit):
        ckpt.load_checkpoint(run, big, torch.optim.AdamW(big.parameters()), {}, ONE, set())
    with pytest.raises(QkvError, match="not JSON-serialisable"):
        ckpt.save_checkpoint(run, model, opt, {"step": 2, "x": object()}, {}, ONE, frozen=False)
    pointer = json.loads((run / "checkpoint" / "latest.json").read_text())
    (run / "checkpoint" / "latest.json").write_text(json.dumps({**pointer, "directory": "step-00000009"}))
    with pytest.raises(QkvError, match=r"step-00000009 named by .*latest.json is missing"):
        ckpt.load_checkpoint(run, model, opt, {}, ONE, set())


def test_streamed_safetensors_equal_safetensors_own_writer(tmp_path: Path) -> None:
    """atomic_stream_safetensors (one tensor at a time) writes what safetensors reads back, to several paths."""
    import safetensors.torch

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2, 2).bfloat16(),
               "d": torch.zeros(0, 4), "e": torch.tensor(True), "f": torch.randn(4, 6)[:, ::2]}  # fmt: skip
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    paths = [tmp_path / "x.safetensors", tmp_path / "y.safetensors"]
    files.atomic_stream_safetensors(paths, specs, iter(tensors.values()))
    for path in paths:
        back = safetensors.torch.load_file(path)
        assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    assert _no_temp_files(tmp_path)
    with pytest.raises(QkvError, match=r"tensor b is torch.int64 \(7,\), its header says torch.int64 \(8,\)"):
        files.atomic_stream_safetensors(paths, [specs[0], ("b", torch.int64, (8,))], iter(tensors.values()))
    assert _no_temp_files(tmp_path) and safetensors.torch.load_file(paths[0]).keys() == tensors.keys()
