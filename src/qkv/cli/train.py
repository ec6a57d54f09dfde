"""`qkv train [TASK] [options]`: train one of qkv.tasks through the one loop.

The options are generated from the task's config class: one per setting, each with its help text and the task's
recipe's default (`qkv train TASK --help` shows them), and --model KEY=VALUE for the model's settings. The settings
given are laid over the task's recipe (fine-tuning's, with --init-from), or over a resumed run's stored config.
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
from qkv.tasks import LANGUAGE_MODELS, TASKS

if TYPE_CHECKING:
    from qkv.training import RunConfig

# Short options for common model settings: (name, help); a model config takes each as a short path.
SHORTCUTS = (("n_layers", "layers"), ("d_model", "model width"), ("n_heads", "attention heads"),
             ("dropout", "dropout probability (every dropout of the model)"))  # fmt: skip


def register(sub: Any) -> None:
    """List `qkv train` in `qkv --help` (main() hands its arguments to `main` below)."""
    tasks = "; ".join(f"{name}: {entry.summary}" for name, entry in TASKS.items())
    sub.add_parser("train", help=f"train a model: {', '.join(TASKS)} (default lm)", description=tasks)


def main(argv: list[str]) -> int:
    """Parse `qkv train [TASK] …` for its task, train, and print what the task shows at the end."""
    from qkv.tasks import config_class, recipe, resumed, train
    from qkv.training.distributed import is_main_process

    task, rest = _task_of(argv)
    cls = config_class(task)
    parser = build_parser(task, cls)
    args, unknown = parser.parse_known_args(rest)
    if unknown:
        _refuse(task, unknown, parser)
    settings = _settings(args)
    if settings.get("init_from") is not None and task in LANGUAGE_MODELS:
        _refuse_architecture(args)
    cfg = resumed(task, settings) if settings.get("resume") else recipe(task, settings)  # checked once, here
    nproc = getattr(args, "nproc", None)
    if nproc is not None and not cls.model_class.stacks:
        raise QkvError(f"`qkv train {task}` trains on one process: drop --nproc")
    if nproc is not None:
        return _launch(nproc, ["train", task, *_without_nproc(rest)], cfg)
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


def build_parser(task: str, cls: type[RunConfig[Any]]) -> argparse.ArgumentParser:
    """`qkv train TASK`'s parser: an option per setting of the task's config class, none with a default (the ones
    shown are the recipe's)."""
    from qkv.tasks import recipe

    prog = "qkv train" if task == "lm" else f"qkv train {task}"
    others = ", ".join(f"qkv train {name}" for name in TASKS if name != task)
    p = Parser(prog=prog, description=f"{TASKS[task].summary}. Other tasks: {others} (each has its own --help).",
               argument_default=argparse.SUPPRESS, epilog=_epilog(task))  # fmt: skip
    defaults = recipe(task)
    for flag, path, f, hint in _options(cls):
        kind = _value_type(hint)
        text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
        default = _at(defaults, path)
        option = f"--{flag.replace('_', '-')}"
        if flag == "resume":  # an action, not a setting
            p.add_argument(option, dest=flag, action="store_true", help=text)
        elif kind is bool:  # --compile / --no-compile: a resumed run may turn a stored setting off again
            p.add_argument(option, dest=flag, action=argparse.BooleanOptionalAction, help=f"{text} (default {default})")
        else:
            shown = ",".join(default) if isinstance(default, tuple) else "none" if default is None else default
            p.add_argument(option, dest=flag, type=kind, help=f"{text} (default {shown})", **_choices(hint))
    model = cls.model_class
    fields = ", ".join(sorted(f.name for f in dataclasses.fields(model)))
    which = (f"one of {fields}" if not model.stacks else "a path such as decoder.block.attention.n_kv_heads=2, a "
             "block's or stack's setting for every block (attention.n_kv_heads=2, n_layers=4), or attention=mla to "
             "change a part's kind")  # fmt: skip
    p.add_argument("--model", action="append", type=key_value, metavar="KEY=VALUE",
                   help=f"a setting of the model ({model.__name__}): {which} (repeatable)")
    if not model.stacks:  # a model without layers (an SAE): no layer shortcuts, and one process
        p.add_argument("--nproc", type=int, help=argparse.SUPPRESS)  # refused with a reason in main()
        return p
    sides = " (of the encoder and of the decoder)" if len(model.stacks) > 1 else ""
    for name, text in SHORTCUTS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"shortcut_{name}", type=int if name != "dropout" else float,
                       metavar=name.upper(), help=f"model: {text}{sides if name == 'n_layers' else ''}")  # fmt: skip
    p.add_argument("--nproc", type=int, help="train on N local processes (torch's elastic launcher, like torchrun)")
    return p


def _options(cls: type[RunConfig[Any]]) -> list[tuple[str, str, dataclasses.Field[Any], Any]]:
    """(flag, dotted path, field, type hint) of every setting the task's config has, the model's excepted."""
    from qkv.training import RunConfig
    from qkv.training.config import setting_fields

    shared = {f.name for f in dataclasses.fields(RunConfig)}
    options = list(setting_fields(cls))
    return sorted(options, key=lambda o: o[1].split(".")[0] in shared)  # the task's own first (the sort is stable)


def _epilog(task: str) -> str | None:
    """What --help adds after the options: the fine-tuning recipe, for a language model."""
    if task != "lm":
        return None
    from qkv.tasks import config_class
    from qkv.tasks.finetune import SETTINGS

    flag_of = {path: flag for flag, path in config_class("lm").flags().items()}
    changed = ", ".join(f"--{flag_of.get(k, k).replace('_', '-')} {v}" for k, v in SETTINGS.items())
    return (f"With --init-from CHECKPOINT the model is the checkpoint's and fine-tuning's defaults apply: {changed} "
            "(--lr 2e-4 with --lora-rank); a JSON Lines file of conversations as --data trains a chat model.")


def _at(cfg: object, path: str) -> Any:
    """A setting's value by dotted path (None inside an absent section)."""
    for part in path.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def _choices(hint: Any) -> dict[str, Any]:
    """argparse's choices for a Literal setting (or Literal | None)."""
    for option in typing.get_args(hint) if _is_union(hint) else (hint,):
        if typing.get_origin(option) is typing.Literal:
            return {"choices": [*typing.get_args(option), *([None] if _is_union(hint) else [])]}  # None: "none"
    return {}


def _is_union(hint: Any) -> bool:
    """Whether a hint is X | Y."""
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _value_type(hint: Any) -> Any:
    """The option's type for a setting's hint: int, float, str or bool; a tuple of strings, comma-separated; for
    X | None, X or the word "none"."""
    if typing.get_origin(hint) is tuple:
        return _comma_list
    if typing.get_origin(hint) is typing.Literal:
        return str
    if not _is_union(hint):
        return hint
    kind = _value_type(next(h for h in typing.get_args(hint) if h is not type(None)))

    def value_or_none(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    value_or_none.__name__ = kind.__name__  # argparse names the type in its errors: "invalid int value"
    return value_or_none


def _comma_list(text: str) -> tuple[str, ...]:
    """a,b,c → ("a", "b", "c")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


_comma_list.__name__ = "comma-separated list"


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line: flags by name, model settings as model.KEY."""
    given = {k: v for k, v in vars(args).items() if k != "nproc"}
    settings = {k: v for k, v in given.items() if not k.startswith("shortcut_") and k != "model"}
    for name, _ in SHORTCUTS:
        if f"shortcut_{name}" in given:
            settings[f"model.{name}"] = given[f"shortcut_{name}"]
    settings |= {f"model.{key}": value for key, value in given.get("model", [])}
    return settings


def _refuse_architecture(args: argparse.Namespace) -> None:
    """--init-from fixes the model: a model setting other than a dropout is refused by the flag that gave it."""
    typed = [f"--{name.replace('_', '-')}" for name, _ in SHORTCUTS
             if name != "dropout" and getattr(args, f"shortcut_{name}", None) is not None]  # fmt: skip
    typed += [f"--model {key}={value}" for key, value in getattr(args, "model", None) or []
              if not key.endswith("dropout")]  # fmt: skip
    if typed:
        raise QkvError(f"--init-from fixes the model's architecture; drop {', '.join(typed)} (only the dropouts may "
                       "change when fine-tuning)")  # fmt: skip


def _refuse(task: str, unknown: list[str], parser: argparse.ArgumentParser) -> None:
    """A one-line error for options of other tasks (naming whose they are), or argparse's own."""
    from qkv.tasks import config_class

    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("--")]
    owners = {}
    for flag in flags:
        name = flag[2:].replace("-", "_")
        owner = next((t for t in TASKS if name in config_class(t).flags()), None)
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


def _launch(nproc: int, argv: list[str], cfg: RunConfig[Any]) -> int:
    """Run the same `qkv train` in nproc local processes; the run directory is chosen here, once."""
    from qkv.tasks import task_class
    from qkv.training.distributed import launch
    from qkv.training.loop import default_run_dir

    if nproc < 1:
        raise QkvError(f"--nproc must be a positive integer, got {nproc}")
    out_dir = cfg.checkpoint.out_dir
    if out_dir is None:  # chosen once, so the failure message can name it
        out_dir = str(default_run_dir(task_class(cfg), cfg))
        argv += ["--out-dir", out_dir]
    return launch(nproc, argv, out_dir)
