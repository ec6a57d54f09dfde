"""One run configuration: shared fields defined and validated once, one option per field in `qkv train TASK`,
and resuming that keeps a run's stored settings except those given explicitly, from Python and from the CLI.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import TASK_NAMES, cli_args, one_thread, run_main, tiny_data, tiny_settings

from qkv.cli.train import build_parser
from qkv.errors import QkvError
from qkv.tasks import TASKS, config_class, train
from qkv.tasks.lm import LMConfig
from qkv.tasks.translate import TranslateConfig
from qkv.training import RunConfig


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def finished(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step language-model run."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with one_thread():
        train(LMConfig(**tiny_settings("lm", data), out_dir=str(out)), verbose=False)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))


def _stored(run: Path) -> dict[str, Any]:
    return json.loads((run / "config.json").read_text())["training"]


def test_shared_fields_are_defined_once() -> None:
    """Every task's config is a RunConfig: the shared fields come from it, with the task's own defaults."""
    shared = {f.name for f in dataclasses.fields(RunConfig)}
    for task in TASKS:
        cls = config_class(task)
        assert issubclass(cls, RunConfig) and cls.task == task
        assert shared <= {f.name for f in dataclasses.fields(cls)}
    assert (TranslateConfig().beta2, TranslateConfig().min_lr, LMConfig().beta2, LMConfig().min_lr) == (
        0.98,
        0.0,
        0.99,
        None,
    )
    with pytest.raises(QkvError, match=r"betas must be in \[0, 1\)"):
        TranslateConfig(beta2=1.5)  # the translation task's settings are validated like every other task's
    with pytest.raises(QkvError, match=r"grad-clip and weight-decay must be ≥ 0"):
        TranslateConfig(weight_decay=-1.0)
    assert LMConfig(compile=True, strategy="fsdp").compile  # per-layer compile works under FSDP too


@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_field_is_an_option_with_its_help(task: str) -> None:
    cls = config_class(task)
    parser = build_parser(task, cls)
    options = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(cls):
        if f.name == "model":
            assert "model" in options
            continue
        assert f.name in options, f.name
        assert f.metadata["help"].replace("%", "%%") in (options[f.name].help or ""), f.name  # argparse-escaped
    assert "--nproc" in parser.format_help()


def test_given_settings_are_remembered() -> None:
    assert LMConfig(max_steps=600, lr=3e-3).given == {"max_steps", "lr"}  # equal to the defaults, still given
    assert LMConfig().given == frozenset()


def test_python_resume_keeps_stored_settings_and_honours_given_ones(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path)
    with one_thread():
        kept = train(LMConfig(out_dir=str(run), resume=True, device="cpu"), verbose=False)
    assert kept.step == 6 and _stored(run)["max_steps"] == 6  # nothing given: the run's own 6 steps
    with one_thread():  # 600 is LMConfig's default, and it was given: it counts
        longer = train(LMConfig(out_dir=str(run), resume=True, max_steps=600, eval_interval=600), verbose=False)
    assert longer.step == 600
    assert (_stored(run)["max_steps"], _stored(run)["eval_interval"]) == (600, 600)  # stored for the next resume


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
    from qkv.cli.train import _settings

    for task in TASK_NAMES:
        settings = tiny_settings(task, data)
        cls = config_class(task)
        args, unknown = build_parser(task, cls).parse_known_args(cli_args(settings))
        assert not unknown
        assert cls(**_settings(args, cls)).to_dict() == cls(**settings).to_dict()


def test_given_settings_are_checked_against_the_stored_run(data: dict[str, Path], tmp_path: Path) -> None:
    """On resume, a given min-lr is checked against the run's lr, not against today's default lr."""
    out = tmp_path / "run"
    with one_thread():
        train(LMConfig(**tiny_settings("lm", data) | {"lr": 1e-2, "max_steps": 2}, out_dir=str(out)), verbose=False)
        result = train(LMConfig(out_dir=str(out), resume=True, min_lr=5e-3, max_steps=4), verbose=False)
    assert result.step == 4 and _stored(out)["min_lr"] == 5e-3  # 5e-3 > the default lr, < the run's 1e-2
    with pytest.raises(QkvError, match=r"min-lr must be in \[0, lr=0.01\], got 0.02"):
        train(LMConfig(out_dir=str(out), resume=True, min_lr=2e-2), verbose=False)


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
    fused = make_optimizer(model, LMConfig(fused_optimizer=True, weight_decay=0.1))
    state = fused.state_dict()
    foreach = make_optimizer(model, LMConfig(fused_optimizer=False, weight_decay=0.5))
    settings = group_settings(foreach)
    foreach.load_state_dict(state)
    assert foreach.param_groups[0]["fused"]  # what load_state_dict brought back
    apply_settings(foreach, settings)
    assert group_settings(foreach) == settings
    assert all(not g["fused"] and g["foreach"] for g in foreach.param_groups)
    assert [g["weight_decay"] for g in foreach.param_groups] == [0.5, 0.0]
