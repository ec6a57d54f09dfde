"""One run configuration: sections declared once, recipes instead of re-declared defaults, one option per setting in
`qkv train TASK` with the recipe's default, and resuming that keeps a run's stored settings except those given, from
Python and from the CLI.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from pathlib import Path
from typing import Any

import pytest
from helpers import TASK_NAMES, cli_args, config, one_thread, run_main, tiny_data, tiny_settings

from qkv.cli.train import _settings, build_parser
from qkv.config import Config
from qkv.errors import QkvError
from qkv.tasks import TASKS, config_class, recipe, train
from qkv.training import RunConfig
from qkv.training.config import setting_fields


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def finished(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step language-model run."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with one_thread():
        train(config("lm", **tiny_settings("lm", data), out_dir=str(out)), verbose=False)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))


def _stored(run: Path) -> dict[str, Any]:
    return json.loads((run / "config.json").read_text())["training"]


def _declared(cls: type) -> set[str]:
    """The fields a class itself declares (its own annotations, not inherited ones)."""
    return {f.name for f in dataclasses.fields(cls) if f.name in inspect.get_annotations(cls)}


def test_no_task_config_declares_an_inherited_field_again() -> None:
    """A task changes a default through its recipe: its config adds its own settings and declares no inherited one."""
    from qkv.lab.induction_task import InductionConfig

    for cls in [config_class(task) for task in TASKS] + [InductionConfig]:
        for parent in cls.__mro__[1:]:
            if dataclasses.is_dataclass(parent):
                inherited = {f.name for f in dataclasses.fields(parent)}
                assert not _declared(cls) & inherited, (cls.__name__, parent.__name__, _declared(cls) & inherited)


def test_each_help_text_is_written_once() -> None:
    """Every setting of every task has one help text, in one place (its field); no two settings share one."""
    seen: dict[str, str] = {}
    for task in TASKS:
        for flag, path, f, _ in setting_fields(config_class(task)):
            text = f.metadata["help"]
            assert text, (task, path)
            owner = f"{type(f).__name__}:{id(f)}"
            assert seen.setdefault(text, owner) == owner, (task, flag, text)


def test_sections_and_task_settings_are_typed_and_checked() -> None:
    """RunConfig's sections hold the shared settings; a recipe's values are checked like any others."""
    assert {f.name for f in dataclasses.fields(RunConfig)} == {"model", "optim", "schedule", "data", "eval", "system",
                                                               "checkpoint"}  # fmt: skip
    translate, lm = recipe("translate"), recipe("lm")
    assert (translate.optim.beta2, translate.schedule.min_lr) == (0.98, 0.0)
    assert (lm.optim.beta2, lm.schedule.min_lr) == (0.99, None)
    assert (lm.optim.name, lm.optim.newton_schulz_steps, lm.schedule.max_steps, lm.model.decoder.n_layers) == (
        "muon", 4, 350, 3)
    with pytest.raises(QkvError, match=r"betas must be in \[0, 1\)"):
        config("translate", beta2=1.5)
    with pytest.raises(QkvError, match=r"grad-clip and weight-decay must be ≥ 0"):
        config("translate", weight_decay=-1.0)
    with pytest.raises(QkvError, match=r"lr must be a number, got 'fast'"):
        config("lm", lr="fast")
    with pytest.raises(QkvError, match=r"--optimizer must be one of adamw, muon, got 'sgd'"):
        config("lm", optimizer="sgd")
    assert config("lm", compile=True, strategy="fsdp").system.compile  # per-layer compile works under FSDP too
    assert isinstance(lm.model, config_class("lm").model_class)  # a typed model config, not a dict


@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_setting_is_an_option_with_its_help_and_the_recipes_default(task: str) -> None:
    cls = config_class(task)
    parser = build_parser(task, cls)
    options = {a.dest: a for a in parser._actions}
    defaults = recipe(task)
    for flag, path, f, _ in setting_fields(cls):
        assert flag in options, flag
        text = options[flag].help or ""
        assert f.metadata["help"].replace("%", "%%") in text, flag  # argparse-escaped
        value = defaults
        for part in path.split("."):
            value = getattr(value, part, None)
        if flag != "resume":
            shown = ",".join(value) if isinstance(value, tuple) else "none" if value is None else value
            assert f"(default {shown})" in text, (flag, text)
    assert "model" in options and "--nproc" in parser.format_help()


def test_the_language_models_help_shows_its_speedrun_and_the_fine_tuning_recipe() -> None:
    text = build_parser("lm", config_class("lm")).format_help().replace("\n", " ")
    assert "(default 350)" in text and "(default muon)" in text
    assert "With --init-from CHECKPOINT the model is the checkpoint's" in " ".join(text.split())


def test_dotted_short_and_flat_model_settings() -> None:
    """--model takes a path, a block's setting for every block, a kind's name, and the flat keys of earlier versions."""
    cfg = config("lm", model={"decoder.block.attention.n_kv_heads": 2})
    assert cfg.model.decoder.block.attention.n_kv_heads == 2
    assert config("lm", model={"attention.n_kv_heads": 2}).model == cfg.model
    assert config("lm", model={"n_kv_heads": 2}).model == cfg.model  # the flat key of earlier versions
    mla = config("lm", model={"attention": "mla", "attention.kv_lora_rank": 16}).model.decoder.block.attention
    assert (mla.kind, mla.n_heads, mla.kv_lora_rank) == ("mla", 4, 16)  # the heads are kept, n_kv_heads is dropped
    with pytest.raises(QkvError, match=r"unknown model setting 'headz'"):
        config("lm", model={"headz": 2})
    with pytest.raises(QkvError, match=r"--model moe_first_dense is no longer a setting: give the first layers"):
        config("lm", model={"moe_first_dense": 1})


def test_given_settings_over_the_recipe() -> None:
    """Settings given are laid over the task's recipe: flags by name, or dotted paths."""
    cfg = config("lm", max_steps=12, **{"optim.lr": 0.02})
    assert (cfg.schedule.max_steps, cfg.optim.lr, cfg.optim.name) == (12, 0.02, "muon")
    assert config("lm").override({"lr": 0.02}) == config("lm", lr=0.02)


def test_python_resume_keeps_stored_settings_and_honours_given_ones(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path)
    with one_thread():
        kept = train(task="lm", out_dir=str(run), resume=True, device="cpu", verbose=False)
    assert kept.step == 6 and _stored(run)["schedule"]["max_steps"] == 6  # nothing given: the run's own 6 steps
    with one_thread():  # 600 given: it counts
        longer = train(task="lm", out_dir=str(run), resume=True, max_steps=600, eval_interval=600, verbose=False)
    assert longer.step == 600
    stored = _stored(run)
    assert (stored["schedule"]["max_steps"], stored["eval"]["interval"]) == (600, 600)  # for the next resume


def test_cli_resume_keeps_stored_settings_and_honours_given_ones(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(finished, tmp_path)
    with one_thread():
        code, out, err = run_main(capsys, "train", "--resume", "--out-dir", str(run), "--max-steps", "600",
                                  "--eval-interval", "600")  # fmt: skip
    assert code == 0, err
    assert "after 600 steps" in out
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [2, 4, 6, 600]


def test_resume_refuses_to_change_what_the_run_trains(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(finished, tmp_path)
    code, out, err = run_main(capsys, "train", "--resume", "--out-dir", str(run), "--block-size", "16")
    assert code == 2 and out == ""
    assert err == "qkv train: error: --block-size cannot change on --resume (the run has block_size=32); drop it\n"
    code, _, err = run_main(capsys, "train", "--resume", "--out-dir", str(run), "--model", "n_heads=4")
    assert code == 2 and "--model cannot change on --resume (the run has decoder.block.attention.n_heads=2)" in err
    code, _, err = run_main(
        capsys, "train", "--resume", "--out-dir", str(run), "--block-size", "32", "--max-steps", "6"
    )
    assert code == 0, err  # the stored value, given again, is fine
    code, _, err = run_main(capsys, "train", "translate", "--resume", "--out-dir", str(run))
    assert code == 2 and "holds a lm run; continue it with `qkv train lm --resume" in err


def test_options_of_other_tasks_are_named(data: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "train", "copy", "--vocab-size", "300")
    assert (code, err) == (
        2,
        "qkv train: error: --vocab-size: language-model option(s), not used by `qkv train copy`\n",
    )
    code, _, err = run_main(capsys, "train", "--label-smoothing", "0.1")
    assert (code, err) == (2, "qkv train: error: --label-smoothing: translation-model option(s), not used by "
                              "`qkv train lm`\n")  # fmt: skip
    code, _, err = run_main(capsys, "train", "--no-such-option")
    assert code == 2 and "unrecognized arguments: --no-such-option" in err


def test_cli_args_round_trip(data: dict[str, Path]) -> None:
    """The tests' own helper gives each task's tiny settings as options (the CLI reads what Python would)."""
    for task in TASK_NAMES:
        settings = tiny_settings(task, data)
        args, unknown = build_parser(task, config_class(task)).parse_known_args(cli_args(settings))
        assert not unknown
        assert recipe(task, _settings(args)) == config(task, **settings)


def test_given_settings_are_checked_against_the_stored_run(data: dict[str, Path], tmp_path: Path) -> None:
    """On resume, a given min-lr is checked against the run's lr, not against today's default lr."""
    out = tmp_path / "run"
    with one_thread():
        train(config("lm", **tiny_settings("lm", data) | {"lr": 1e-2, "max_steps": 2}, out_dir=str(out)),
              verbose=False)  # fmt: skip
        result = train(task="lm", out_dir=str(out), resume=True, min_lr=5e-3, max_steps=4, verbose=False)
    assert result.step == 4 and _stored(out)["schedule"]["min_lr"] == 5e-3  # 5e-3 < the run's lr
    with pytest.raises(QkvError, match=r"min-lr must be in \[0, lr=0.01\], got 0.02"):
        train(task="lm", out_dir=str(out), resume=True, min_lr=2e-2, verbose=False)


def test_every_boolean_setting_can_be_turned_off(capsys: pytest.CaptureFixture[str]) -> None:
    """--compile and --no-compile (a resumed run may drop a stored True); --resume alone is a plain switch."""
    for task in TASK_NAMES:
        text = build_parser(task, config_class(task)).format_help()
        assert "--compile, --no-compile" in text and "--fused-optimizer, --no-fused-optimizer" in text
        assert "--no-resume" not in text


def test_the_run_chooses_its_optimizer_kernel_on_resume() -> None:
    """A stored optimizer state brings back its param groups' kernel flags; the resumed run's choice wins."""
    import torch

    from qkv.training.optim import apply_settings, group_settings, make_optimizer

    model = torch.nn.Linear(4, 4)
    fused = make_optimizer(model, config("lm", fused_optimizer=True, weight_decay=0.1).optim)
    state = fused.state_dict()
    foreach = make_optimizer(model, config("lm", fused_optimizer=False, weight_decay=0.5).optim)
    settings = group_settings(foreach)
    foreach.load_state_dict(state)
    assert foreach.param_groups[0]["fused"]  # what load_state_dict brought back
    apply_settings(foreach, settings)
    assert group_settings(foreach) == settings
    assert all(not g["fused"] and g["foreach"] for g in foreach.param_groups)
    assert [g["weight_decay"] for g in foreach.param_groups] == [0.5, 0.0]


def test_a_flat_run_config_of_earlier_versions_is_read_through_one_converter() -> None:
    """A qkv-run/1 config.json (flat settings, flat model) becomes today's sections and model tree."""
    stored = json.loads((Path(__file__).parent / "fixtures" / "old_runs" / "ae117cc" / "lora" / "config.json")
                        .read_text())  # fmt: skip
    assert stored["format"] == "qkv-run/1" and "lr" in stored["training"]
    cfg = config_class("lm").from_stored(stored)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.newton_schulz_steps) == ("adamw", 2e-4, 4)
    assert cfg.lora is not None and (cfg.lora.rank, cfg.lora.effective_alpha) == (2, 4.0)
    assert cfg.model.decoder.block.attention.n_kv_heads == 1 and cfg.model.vocab_size == 300
    hints = typing.get_type_hints(type(cfg))
    assert all(issubclass(hints[name], Config) for name in ("optim", "schedule", "data", "eval", "system"))
