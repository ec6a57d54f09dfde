"""Hugging Face checkpoints on disk and in memory, and the name maps that tie them to qkv models.

A family module (gpt2.py, llama.py, …) says two things: how config.json becomes a qkv config,
and where each tensor of the qkv model lives in the checkpoint (a `NameMap` of `Ref`s). Everything
else — reading safetensors (sharded or not), refusing pickle, checking names and shapes, slicing
fused tensors, and the reverse trip for export — is written once, here.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.blocks import BlockConfig
from qkv.blocks.feed_forward import Activation
from qkv.errors import QkvError
from qkv.interop.checkpoint import Checkpoint
from qkv.io.files import (
    PICKLE_SUFFIXES,
    atomic_save_safetensors,
    atomic_write_json,
    load_json,
    load_safetensors,
)
from qkv.models import ModelConfig, QkvConfig
from qkv.tokenizers import ByteBPETokenizer
from qkv.tokenizers.base import CONFIG_FILE as TOKENIZER_CONFIG_FILE

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

_NO_DEFAULT: Any = object()


@dataclass(frozen=True)
class Ref:
    """Where one qkv tensor lives in a Hugging Face checkpoint, and how its layout differs."""

    name: str  # the tensor's name in the canonical HF class (e.g. GPT2LMHeadModel: "transformer.h.0…")
    transposed: bool = False  # GPT-2's Conv1D stores (in, out); nn.Linear stores (out, in)
    part: int = 0  # the `part`-th of `parts` equal slices along dim 0: GPT-2's fused c_attn is [q; k; v]
    parts: int = 1
    row: bool = False  # stored with a leading dim of 1 (BART's final_logits_bias is (1, vocab))
    optional: bool = False  # absent → keep the model's initial value (BartModel has no final_logits_bias)

    def hf_shape(self, qkv_shape: torch.Size) -> tuple[int, ...]:
        """The shape the checkpoint must hold for a qkv tensor of `qkv_shape`."""
        shape = (qkv_shape[0] * self.parts, *qkv_shape[1:])
        if self.transposed:
            shape = shape[::-1]
        return (1, *shape) if self.row else shape

    def to_qkv(self, t: Tensor) -> Tensor:
        """The checkpoint tensor (already shape-checked) in qkv's layout."""
        if self.row:
            t = t[0]
        if self.transposed:
            t = t.t()
        return t.chunk(self.parts, dim=0)[self.part] if self.parts > 1 else t


NameMap = dict[str, Ref]  # qkv state_dict name → where the checkpoint keeps it


def linear(qkv: str, hf: str, bias: bool = True, transposed: bool = False, part: int = 0, parts: int = 1) -> NameMap:
    """Refs for a Linear's weight (and bias): qkv `{qkv}.weight` ← HF `{hf}.weight`."""
    refs = {f"{qkv}.weight": Ref(f"{hf}.weight", transposed, part, parts)}
    if bias:
        refs[f"{qkv}.bias"] = Ref(f"{hf}.bias", False, part, parts)  # a bias has no in-dim to transpose
    return refs


def norm(qkv: str, hf: str, bias: bool = True) -> NameMap:
    """Refs for a LayerNorm (weight, bias) or RMSNorm (weight only)."""
    refs = {f"{qkv}.weight": Ref(f"{hf}.weight")}
    if bias:
        refs[f"{qkv}.bias"] = Ref(f"{hf}.bias")
    return refs


@dataclass(frozen=True)
class Family:
    """How one Hugging Face architecture maps onto a qkv model (see the registry in qkv.interop)."""

    name: str  # for messages: "GPT-2", "Llama", …
    model_types: tuple[str, ...]  # config.json "model_type" values this family reads
    config_from_hf: Callable[[dict[str, Any], Collection[str]], QkvConfig]  # (config.json, tensor names)
    name_map: Callable[[Any], NameMap]  # qkv config → where every tensor of the qkv model lives
    aliases: tuple[tuple[str, str], ...] = ()  # prefix rewrites tried for a missing name (bare base models)
    ignored: tuple[str, ...] = ()  # regexes of checkpoint tensors that are not weights (buffers, tied copies)
    config_to_hf: Callable[[Any], dict[str, Any]] | None = None  # export: qkv config → config.json
    export_problems: Callable[[Any], list[str]] | None = None  # why a qkv config is not of this family
    exports: str = "decoder_lm"  # the qkv model type (qkv.models.model_type_of) that config_to_hf takes


def hf_value(config: dict[str, Any], key: str, family: str, default: Any = _NO_DEFAULT) -> Any:
    """config[key], or `default`; a QkvError naming the family and key when it is required and absent."""
    if key in config and config[key] is not None:
        return config[key]
    if default is _NO_DEFAULT:
        raise QkvError(f"{family} config.json lacks {key!r}")
    return default


def unsupported(family: str, option: str, value: Any) -> QkvError:
    """The error for a config option qkv's blocks cannot express."""
    return QkvError(f"{family} checkpoints with {option}={value!r} are not supported by qkv")


_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",  # transformers' ACT2FN: the same function under Marian's name
}


def activation_from_hf(name: str, family: str) -> Activation:
    """qkv's activation for an HF activation name (GPT-2's "gelu_new" is the tanh approximation)."""
    if name not in _ACTIVATIONS:
        raise unsupported(family, "activation", name)
    return _ACTIVATIONS[name]


def activation_to_hf(name: str) -> str:
    """The HF activation name for a qkv activation other than swiglu."""
    return {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}[name]


def value_at(cfg: object, path: str) -> Any:
    """A config's setting by dotted path (decoder.block.attention.kind)."""
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def mismatches(cfg: ModelConfig, wanted: dict[str, Any]) -> list[str]:
    """'path=value (needs wanted)' for each setting that differs from what a family needs."""
    return [f"{path}={value_at(cfg, path)!r} (needs {want!r})" for path, want in wanted.items()
            if value_at(cfg, path) != want]  # fmt: skip


def plain_stack_problems(cfg: ModelConfig, stack: str) -> list[str]:
    """What makes a stack more than one block of multi-head attention + a dense FFN (per-layer blocks, latent or
    sliding-window attention, experts, attention-only layers)."""
    side = cfg.stack(stack)
    if side.layers:
        return [f"{stack}.layers has {len(side.layers)} per-layer blocks (needs one block for every layer)"]
    problems = mismatches(cfg, {f"{stack}.block.attention.kind": "mha", f"{stack}.block.ffn.kind": "dense"})
    if side.block.ffn.d_ff == 0:
        problems.append(f"{stack}.block.ffn.d_ff=0 (attention-only layers; needs a feed-forward in every layer)")
    return problems


def kv_heads(block: BlockConfig) -> int:
    """The key/value heads of a block's multi-head attention."""
    return getattr(block.attention, "n_kv_heads", None) or block.attention.n_heads


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_checkpoint(path: str | Path, native: bool = False) -> Checkpoint:
    """A Hugging Face model directory (config.json + safetensors) or a .gguf file, in memory (native: a GGUF's
    quantised matrices kept quantised)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from qkv.interop.gguf_reader import read_gguf  # lazy: the gguf package is optional

        return read_gguf(path, native)
    if path.is_file():
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise QkvError(f"refusing to load pickle file {path}: qkv only reads safetensors (pickle can run code)")
        raise QkvError(f"{path} is a file; pass a Hugging Face model directory or a .gguf file")
    if not path.is_dir():
        raise QkvError(f"model not found: {path}")
    files, weight_map = _weight_files(path)  # first, so a pickle-only directory is refused as such
    if not (path / CONFIG_FILE).is_file():
        raise QkvError(f"{path} has no {CONFIG_FILE}: not a Hugging Face model directory")
    config = load_json(path / CONFIG_FILE)
    if "auto_map" in config:
        # Such a model is defined by Python files shipped beside it; loading it means running them.
        raise QkvError(f"{path} needs custom model code (auto_map in {CONFIG_FILE}); qkv never runs checkpoint code")
    sampling = _recommended_sampling(path / "generation_config.json")
    if sampling is not None:  # not a model setting: the checkpoint's advice to whoever samples from it (qkv chat)
        config = {**config, "sampling": sampling}
    return Checkpoint(config, _read_tensors(files, weight_map), str(path))


def _recommended_sampling(path: Path) -> dict[str, Any] | None:
    """The sampling generation_config.json recommends (transformers' defaults for the fields it leaves out), or None
    when it does not sample (do_sample unset or false) or there is no such file."""
    config = load_json(path) if path.is_file() else {}
    if not config.get("do_sample"):
        return None
    return {"temperature": config.get("temperature", 1.0), "top_k": config.get("top_k", 50),
            "top_p": config.get("top_p", 1.0)}  # fmt: skip


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files to read (and the sharded index's weight map); pickle is refused."""
    index_path = directory / WEIGHTS_INDEX
    if index_path.is_file():
        weight_map = load_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise QkvError(f"{index_path} has no weight_map")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard:  # no "../" out of the directory
                raise QkvError(f"{index_path} names shard {shard!r}, which is not a file in {directory}")
        return [directory / shard for shard in shards], weight_map
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE], {}
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise QkvError(
            f"refusing to load pickle file(s) {', '.join(pickles)} in {directory}: qkv only reads safetensors "
            "(unpickling can run arbitrary code); ask for a safetensors version of this model"
        )
    raise QkvError(f"{directory} has no {WEIGHTS_FILE} (or {WEIGHTS_INDEX})")


def _read_tensors(files: list[Path], weight_map: dict[str, str]) -> dict[str, Tensor]:
    """Every tensor of the files, checking that each one the index lists is there."""
    tensors: dict[str, Tensor] = {}
    for path in files:
        tensors.update(load_safetensors(path))  # refuses pickle in disguise, by content
    missing = sorted(name for name in weight_map if name not in tensors)
    if missing:
        raise QkvError(f"tensor {missing[0]} is listed in the weight map but missing from {weight_map[missing[0]]}")
    return tensors


# ---------------------------------------------------------------------------------------------
# Building and loading
# ---------------------------------------------------------------------------------------------


def _find(tensors: Collection[str], name: str, aliases: tuple[tuple[str, str], ...]) -> str | None:
    """`name`, or the first alias rewrite of it (e.g. without "transformer.") that the checkpoint has."""
    if name in tensors:
        return name
    for old, new in aliases:
        if name.startswith(old) and new + name[len(old) :] in tensors:
            return new + name[len(old) :]
    return None


def load_mapped(model: nn.Module, ckpt: Checkpoint, family: Family, name_map: NameMap,
                done: Collection[str] = ()) -> None:  # fmt: skip
    """Fill every tensor of `model` from the checkpoint, naming any missing or mis-shaped tensor (done: the names
    of tensors already filled, by quantised modules)."""
    state: dict[str, Tensor] = {}
    used: set[str] = set()
    for qkv_name, target in model.state_dict().items():
        if qkv_name in done:
            continue
        ref = name_map.get(qkv_name)
        if ref is None:  # a family's map must cover its model: this is a bug in qkv, not in the checkpoint
            raise QkvError(f"the {family.name} name map has no entry for qkv tensor {qkv_name}")
        hf_name = _find(ckpt.tensors, ref.name, family.aliases)
        if hf_name is None and ref.optional:
            state[qkv_name] = target
            continue
        if hf_name is None:
            raise QkvError(f"{family.name} checkpoint {ckpt.source} lacks tensor {ref.name}")
        tensor, want = ckpt.tensors[hf_name], ref.hf_shape(target.shape)
        if tuple(tensor.shape) != want:
            raise QkvError(
                f"{family.name} checkpoint {ckpt.source}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                f"but its config.json implies {want}"
            )
        state[qkv_name] = ref.to_qkv(tensor)
        used.add(hf_name)
    unused = [n for n in ckpt.tensors if n not in used and not any(re.search(p, n) for p in family.ignored)]
    if unused:  # e.g. a task head (classifier, MLM head) that the qkv model has no place for
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        warnings.warn(f"{ckpt.source}: ignoring tensor(s) {', '.join(unused[:5])}{more}", stacklevel=3)
    model.load_state_dict(state, strict=not done)  # copies, casting fp16/bf16 checkpoints to the model's fp32


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def export_mapped(model: nn.Module, name_map: NameMap) -> dict[str, Tensor]:
    """The model's tensors under their HF names and layouts (the inverse of load_mapped)."""
    groups: dict[str, list[tuple[Ref, Tensor]]] = {}
    for qkv_name, tensor in model.state_dict().items():
        ref = name_map[qkv_name]
        groups.setdefault(ref.name, []).append((ref, tensor))
    out: dict[str, Tensor] = {}
    for hf_name, items in groups.items():
        ref = items[0][0]
        if ref.parts > 1:  # re-fuse the slices (GPT-2's c_attn = [q; k; v]) in order
            parts = sorted(items, key=lambda item: item[0].part)
            if [r.part for r, _ in parts] != list(range(ref.parts)):
                raise QkvError(f"cannot rebuild {hf_name}: got parts {[r.part for r, _ in parts]} of {ref.parts}")
            tensor = torch.cat([t for _, t in parts], dim=0)
        else:
            tensor = items[0][1]  # several qkv names for one HF name are tied copies of one tensor
        if ref.transposed:
            tensor = tensor.t()
        out[hf_name] = (tensor[None] if ref.row else tensor).detach().contiguous()
    return out


def write_tokenizer(directory: Path, tokenizer: ByteBPETokenizer) -> None:
    """tokenizer.json plus a tokenizer_config.json that both transformers' AutoTokenizer and qkv read."""
    tokenizer.save(directory)  # tokenizer.json + {"kind": "bpe", …} for qkv's load_tokenizer
    qkv_fields = load_json(directory / TOKENIZER_CONFIG_FILE)
    tok = tokenizer.hf_tokenizer
    eos = tok.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else None
    hf_fields = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "clean_up_tokenization_spaces": False}
    atomic_write_json(directory / TOKENIZER_CONFIG_FILE, {**hf_fields, **qkv_fields})


def write_checkpoint(directory: str | Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    """Write config.json and model.safetensors (with the "pt" format tag transformers checks)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(directory / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    atomic_write_json(directory / CONFIG_FILE, config)
    return directory
