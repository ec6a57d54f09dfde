"""Configs: typed, validated dataclasses that build what they describe.

Every part of a model has a config beside its module (attention, feed-forward, norm, positions, embedding,
block, stack, model), and `build()` makes the module. A model config is a tree of them, and so is a run's
config (qkv.training.config). What this base class gives every config:

- checks when it is made: each field's type, then the config's own rules (`check`), in one-line errors;
- JSON both ways (`to_dict`, `from_dict`): nested dicts, unknown keys refused by name, and the configs that
  come in several kinds (attention: mha, mla, sliding; feed-forward: dense, moe; positions: …) tagged "kind";
- `override({"decoder.block.attention.n_kv_heads": 2})`: a new, checked config with settings changed by dotted
  path, which is what `qkv train --model KEY=VALUE` does. Setting a part that has kinds to a word switches
  its kind and keeps the fields both kinds share (`attention=mla`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal, TypeVar

from qkv.errors import QkvError

C = TypeVar("C", bound="Config")
K = TypeVar("K", bound="Config")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The base of every config (see the module docstring)."""

    kind: ClassVar[str] = ""  # a variant's name in JSON and on the command line ("mha", "moe", "rotary", …)
    variants: ClassVar[dict[str, type[Config]] | None] = None  # set on a config that comes in kinds
    named_errors: ClassVar[bool] = True  # its errors start with its path (False: they name a flag themselves)

    def __post_init__(self) -> None:
        """Check each field's type, then the config's own rules."""
        for name, hint in _hints(type(self)).items():
            _check_type(getattr(self, name), hint, name)
        self.check()

    def check(self) -> None:
        """The config's own rules, raising a QkvError that names the field (none by default)."""

    @classmethod
    def register(cls, variant: type[K]) -> type[K]:
        """Make `variant` (a subclass with a `kind`) one of the kinds of this config: a class decorator."""
        if "variants" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} does not come in kinds")
        assert cls.variants is not None and variant.kind and issubclass(variant, cls)
        cls.variants[variant.kind] = variant
        return variant

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: nested configs as dicts, each variant with its "kind" first."""
        out: dict[str, Any] = {"kind": self.kind} if _kinds_of(type(self)) is not None else {}
        for f in dataclasses.fields(self):
            out[f.name] = _plain(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], path: str = "") -> C:
        """Build from a dict (e.g. a config.json entry); unknown keys and wrong types are refused by name."""
        if not isinstance(data, Mapping):
            raise QkvError(f"{path or cls.__name__} must be a JSON object of its fields, got {data!r}")
        data = dict(data)
        target = _variant(cls, data.pop("kind", None), path) if _kinds_of(cls) is not None else cls
        hints = _hints(target)
        unknown = sorted(set(data) - set(hints))
        if unknown:
            where = f"{path} has" if path else f"{target.__name__} has"
            raise QkvError(f"{where} no field(s) {', '.join(map(str, unknown))}; its fields: {', '.join(hints)}")
        values = {name: _from_plain(value, hints[name], _join(path, name)) for name, value in data.items()}
        try:
            return target(**values)
        except QkvError as e:
            named = not path or not target.named_errors or str(e).startswith((path, "--"))
            raise QkvError(str(e) if named else f"{path}: {e}") from None

    def override(self: C, settings: Mapping[str, Any]) -> C:
        """A new config with `settings` (dotted path → value) changed, checked as a whole.

        Changes of kind come first, so the settings of the new kind apply to it whatever their order.
        """
        data = self.to_dict()
        paths = [(path, value) for key, value in settings.items() for path in self.expand(key)]
        switches = [(p, v) for p, v in paths if _switches_kind(type(self), p, v)]
        for path, value in switches + [pv for pv in paths if pv not in switches]:
            _set(type(self), data, path.split("."), value, path)
        return type(self).from_dict(data)

    def expand(self, key: str) -> list[str]:
        """The full paths a setting's key stands for (model configs accept shorter ones)."""
        return [key]

    def leaves(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """(dotted path, value) of every setting, nested configs walked into."""
        for f in dataclasses.fields(self):
            value, path = getattr(self, f.name), _join(prefix, f.name)
            if isinstance(value, Config):
                yield from value.leaves(path)
            else:
                yield path, value


def _join(path: str, name: str) -> str:
    """path.name, or name at the top."""
    return f"{path}.{name}" if path else name


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A config class's fields and their resolved type hints, in declaration order (worked out once per class)."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


def _kinds_of(cls: type) -> dict[str, type[Config]] | None:
    """The kinds of the config family `cls` belongs to (None: a config without kinds)."""
    return getattr(cls, "variants", None) if isinstance(cls, type) and issubclass(cls, Config) else None


def _variant(cls: type[C], kind: Any, path: str) -> type[C]:
    """The class of the kind named in a dict (a config with kinds), or cls itself."""
    kinds = _kinds_of(cls)
    assert kinds is not None
    if kind is None:
        if cls.kind:
            return cls
        raise QkvError(f"{path or cls.__name__} needs a \"kind\": one of {', '.join(kinds)}")
    found = kinds.get(kind)
    if found is None or not issubclass(found, cls):
        allowed = [k for k, v in kinds.items() if issubclass(v, cls)]
        raise QkvError(f"unknown {path or 'kind'} {kind!r}; choose one of: {', '.join(sorted(allowed))}")
    return found


def _plain(value: Any) -> Any:
    """A field's value as JSON."""
    if isinstance(value, Config):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _config_type(hint: Any) -> type[Config] | None:
    """The config class a hint names (X or X | None), or None."""
    for option in _options(hint):
        if isinstance(option, type) and issubclass(option, Config):
            return option
    return None


def _options(hint: Any) -> tuple[Any, ...]:
    """The members of a union hint, or the hint alone."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _item_type(hint: Any) -> Any | None:
    """The item type of a tuple[X, ...] or list[X] hint (within X | None), or None."""
    for option in _options(hint):
        if typing.get_origin(option) in (tuple, list):
            return typing.get_args(option)[0]
    return None


def _from_plain(value: Any, hint: Any, path: str) -> Any:
    """A JSON value as the field's type: nested configs built, lists of configs made tuples."""
    config = _config_type(hint)
    if config is not None and isinstance(value, Mapping):
        return config.from_dict(value, path)
    item = _item_type(hint)
    if item is not None and isinstance(value, list):
        return tuple(_from_plain(v, item, f"{path}.{i}") for i, v in enumerate(value))
    if float in _options(hint) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    _check_type(value, hint, path)
    return value


def _check_type(value: Any, hint: Any, name: str) -> None:
    """Refuse a value that is not of the field's type, in one line that names the field."""
    if not _is_a(value, hint):
        raise QkvError(f"{name} must be {_describe(hint)}, got {value!r}")


def _is_a(value: Any, hint: Any) -> bool:
    """Whether value fits the hint (int, float, bool, str, Literal, a config, tuples, unions, None)."""
    if hint is Any:
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_is_a(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint) and isinstance(value, (str, int, bool))
    if typing.get_origin(hint) in (tuple, list):
        item = typing.get_args(hint)[0]
        return isinstance(value, (tuple, list)) and all(_is_a(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe(hint: Any) -> str:
    """A type hint in words, for messages."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    words = {int: "an integer", float: "a number", bool: "True or False", str: "a string", type(None): "None"}
    if hint in words:
        return words[hint]
    if isinstance(hint, type) and issubclass(hint, Config):
        kinds = _kinds_of(hint)
        return f"a {hint.__name__}" + (f" (kinds: {', '.join(kinds)})" if kinds else "")
    return str(hint)


def _set(cls: type[Config], data: dict[str, Any], parts: list[str], value: Any, path: str) -> None:
    """Set data[parts…] = value in a config's dict, `cls` telling what each level may hold."""
    name, rest = parts[0], parts[1:]
    hints = _hints(_variant(cls, data.get("kind"), path) if _kinds_of(cls) is not None else cls)
    if name == "kind" and not rest and _kinds_of(cls) is not None:
        raise QkvError(f"set {path.rsplit('.', 2)[0]}={value} to change a part's kind")
    if name not in hints:
        where = path[: -len(".".join(parts))].rstrip(".") or cls.__name__
        raise QkvError(f"{where} has no field {name!r} (in {path}); its fields: {', '.join(hints)}")
    hint, current = hints[name], data.get(name)
    config = _config_type(hint)
    if not rest:
        data[name] = _switched(config, current, value, path) if config and isinstance(value, str) else value
        return
    if rest[0] == "kind" and len(rest) == 1 and config is not None and _kinds_of(config) is not None:
        data[name] = _switched(config, current, value, path)
        return
    item = _item_type(hint)
    if item is not None and _config_type(item) is not None:
        if not isinstance(current, list) or not rest[0].isdigit() or int(rest[0]) >= len(current):
            count = len(current) if isinstance(current, list) else 0
            raise QkvError(f"{path}: {name} holds {count} entries; address one as {name}.N with N < {count}")
        entry = _config_type(item)
        assert entry is not None
        _set(entry, current[int(rest[0])], rest[1:], value, path)
        return
    if config is None:
        raise QkvError(f"{path}: {name} is a setting, not a group of settings; set {name}=VALUE")
    if current is None:  # an absent optional part (e.g. no embedding norm): start from its defaults
        current = data[name] = config().to_dict() if config.kind or _kinds_of(config) is None else {}
    _set(config, current, rest, value, path)


def _switches_kind(cls: type[Config], path: str, value: Any) -> bool:
    """Whether a setting changes a part's kind: a word given to a part that has kinds, or to its "kind"."""
    parts = path.split(".")
    if parts[-1] == "kind":
        return True
    i = 0
    while i < len(parts):
        hint = _hints(cls).get(parts[i])
        config = _config_type(hint) if hint is not None else None
        item = _item_type(hint) if hint is not None and config is None else None
        if item is not None:  # a list of configs: the next part is an index
            config, i = _config_type(item), i + 1
        if config is None:
            return False
        cls, i = config, i + 1
    return isinstance(value, str) and _kinds_of(cls) is not None


def _switched(config: type[Config] | None, current: Any, word: str, path: str) -> dict[str, Any]:
    """A part's dict switched to another kind (or, for a config without kinds, its `kind` field set to the word),
    keeping the settings both kinds share."""
    assert config is not None
    kinds = _kinds_of(config)
    current = dict(current or {})
    if kinds is None:
        if "kind" not in _hints(config):
            raise QkvError(f"{path} is a group of settings; set one of them: {', '.join(_hints(config))}")
        return {**current, "kind": word}
    target = _variant(config, word, path)
    kept = {k: v for k, v in current.items() if k in _hints(target)}
    return {"kind": word, **kept}


def positive(cfg: object, *names: str) -> None:
    """Raise a QkvError for the first named integer field that is not ≥ 1."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise QkvError(f"{name} must be a positive integer, got {value!r}")


def probability(cfg: object, *names: str) -> None:
    """Raise a QkvError for the first named field outside [0, 1)."""
    for name in names:
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise QkvError(f"{name} must be in [0, 1), got {value}")


def option(default: Any = dataclasses.MISSING, help: str = "", *, fixed: bool = False, flag: str | None = None,
           factory: Any = dataclasses.MISSING, prefix: str | None = None) -> Any:  # fmt: skip
    """A config field with its one-line description (the command line's help for it).

    fixed: what a run trains, which a resumed run may not change; flag: its command-line name where the field's own
    name would not do (optim.name is --optimizer); prefix: on a field holding a config, what its settings' flags
    start with (lora.rank is --lora-rank).
    """
    metadata = {"help": help, "fixed": fixed, "flag": flag, "prefix": prefix}
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata)
