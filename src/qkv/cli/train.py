"""`qkv train [TASK] [options]`: train one of qkv.tasks through the one loop.

The options are generated from the task's config class (LMConfig, TranslateConfig, …): one per field,
with the field's help text and the task's own default, so a new setting appears here, in config.json
and in the Python API together. Only the settings given on the command line are passed on: a resumed
run keeps its stored settings except those.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.cli.common import Parser, key_value
from qkv.errors import QkvError
from qkv.tasks import TASKS

if TYPE_CHECKING:
    from qkv.training import RunConfig, Task

# Short options for common model fields: (option, help, the model-config fields it sets).
SHORTCUTS = (("n_layers", "layers"), ("d_model", "model width"),
             ("n_heads", "attention heads"), ("dropout", "dropout probability"))  # fmt: skip
_SKIPPED = ("model",)  # fields with an option of their own shape (--model KEY=VALUE)


def register(sub: Any) -> None:
    """List `qkv train` in `qkv --help` (main() hands its arguments to `main` below)."""
    tasks = "; ".join(f"{name}: {entry.summary}" for name, entry in TASKS.items())
    sub.add_parser("train", help=f"train a model: {', '.join(TASKS)} (default lm)", description=tasks)


def main(argv: list[str]) -> int:
    """Parse `qkv train [TASK] …` for its task, train, and print what the task shows at the end."""
    from qkv.tasks import config_class, task_class, train
    from qkv.training.distributed import is_main_process
    from qkv.training.loop import stored_run

    task, rest = _task_of(argv)
    cls = config_class(task)
    parser = build_parser(task, cls)
    args, unknown = parser.parse_known_args(rest)
    if unknown:
        _refuse(task, unknown, parser)
    settings = _settings(args, cls)
    cfg = cls(**settings)  # checked here, once, before any process is launched
    nproc = getattr(args, "nproc", None)
    if nproc is not None:
        if cfg.resume:  # the merged settings are checked here, not once in every process
            cfg.resumed_from(stored_run(task_class(task), cfg)["training"])
        return _launch(nproc, ["train", task, *_without_nproc(rest)], cfg, task_class(task))
    result = train(cfg)
    if not is_main_process():  # under torchrun, rank 0 reports for the run
        return 130 if result.interrupted else 0
    print(result.summary())
    return 130 if result.interrupted else 0


def _task_of(argv: list[str]) -> tuple[str, list[str]]:
    """The task named first, or the task of the run being resumed, or lm; and the remaining arguments."""
    if argv and argv[0] in TASKS:
        return argv[0], argv[1:]
    if "--resume" in argv and "--out-dir" in argv[:-1]:
        from qkv.io.run_dir import read_run_config

        try:  # a run's task need not be repeated; an unreadable directory is reported by the loop
            return str(read_run_config(Path(argv[argv.index("--out-dir") + 1]))["task"]), argv
        except QkvError:
            pass
    return "lm", argv


def build_parser(task: str, cls: type[RunConfig]) -> argparse.ArgumentParser:
    """`qkv train TASK`'s parser: an option per field of the task's config class, none with a default."""
    prog = "qkv train" if task == "lm" else f"qkv train {task}"
    others = ", ".join(f"qkv train {name}" for name in TASKS if name != task)
    p = Parser(prog=prog, description=f"{TASKS[task].summary}. Other tasks: {others} (each has its own --help).",
               argument_default=argparse.SUPPRESS)  # fmt: skip
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in _SKIPPED:
            continue
        kind = _value_type(hints[f.name])
        text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        if f.metadata.get("choices"):
            text += f"; one of {', '.join(f.metadata['choices'])}"
        default = getattr(defaults, f.name)
        flag = f"--{f.name.replace('_', '-')}"
        if f.name == "resume":  # an action, not a setting
            p.add_argument(flag, dest=f.name, action="store_true", help=text)
        elif kind is bool:  # --compile / --no-compile: a resumed run may turn a stored setting off again
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=f"{text} (default {default})")
        else:
            p.add_argument(flag, dest=f.name, type=kind, help=f"{text} (default {default})")
    model_cls = cls.model_config
    p.add_argument("--model", action="append", type=key_value, metavar="KEY=VALUE",
                   help=f"any {model_cls.__name__} field, e.g. --model positions=rotary (repeatable)")  # fmt: skip
    sides = "n_layers" not in {f.name for f in dataclasses.fields(model_cls)}  # an encoder–decoder counts per side
    for name, text in SHORTCUTS:
        text += " (of the encoder and of the decoder)" if name == "n_layers" and sides else ""
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"shortcut_{name}", type=int if name != "dropout" else float,
                       metavar=name.upper(), help=f"model: {text}")  # fmt: skip
    p.add_argument("--nproc", type=int, help="train on N local processes (torch's elastic launcher, like torchrun)")
    return p


def _value_type(hint: Any) -> Any:
    """The option's type for a field's type hint: int, float, str or bool; for X | None, X or the word "none"."""
    if not (isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union):
        return hint
    kind = next(h for h in typing.get_args(hint) if h is not type(None))

    def value_or_none(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    value_or_none.__name__ = kind.__name__  # argparse names the type in its errors: "invalid int value"
    return value_or_none


def _settings(args: argparse.Namespace, cls: type[RunConfig]) -> dict[str, Any]:
    """The config fields given on the command line, with --model and the shortcuts gathered into `model`."""
    given = vars(args)
    settings = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given and f.name not in _SKIPPED}
    fields = {f.name for f in dataclasses.fields(cls.model_config)}
    model: dict[str, Any] = {}
    for name, _ in SHORTCUTS:
        if f"shortcut_{name}" in given:
            # The encoder–decoder configs count layers per side; --n-layers sets both.
            targets = [name] if name in fields else [n for n in ("n_encoder_layers", "n_decoder_layers") if n in fields]
            model.update(dict.fromkeys(targets, given[f"shortcut_{name}"]))
    model.update(dict(given.get("model", [])))
    if model:
        settings["model"] = model  # laid over the task's recipe by the config
    return settings


def _refuse(task: str, unknown: list[str], parser: argparse.ArgumentParser) -> None:
    """A one-line error for options of other tasks (naming whose they are), or argparse's own."""
    from qkv.tasks import config_class

    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("--")]
    owners = {}
    for flag in flags:
        name = flag[2:].replace("-", "_")
        owner = next((t for t in TASKS if any(f.name == name for f in dataclasses.fields(config_class(t)))), None)
        if owner is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        owners[flag] = owner
    if not owners:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    kind = TASKS[next(iter(owners.values()))].kind.replace(" ", "-")
    raise QkvError(f"{', '.join(owners)}: {kind} option(s), not used by `qkv train {task}`")


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line minus --nproc N (or an abbreviation of it): what each launched process runs."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token.startswith("--np") and "--nproc".startswith(token.split("=", 1)[0]):
            skip = "=" not in token
        else:
            out.append(token)
    return out


def _launch(nproc: int, argv: list[str], cfg: RunConfig, task: type[Task]) -> int:
    """Run the same `qkv train` in nproc local processes; the run directory is chosen here, once."""
    from qkv.training.distributed import launch
    from qkv.training.loop import default_run_dir

    if nproc < 1:
        raise QkvError(f"--nproc must be a positive integer, got {nproc}")
    if cfg.out_dir is None:  # chosen once, so the failure message can name it
        cfg.out_dir = str(default_run_dir(task, cfg))
        argv += ["--out-dir", cfg.out_dir]
    return launch(nproc, argv, cfg.out_dir)
