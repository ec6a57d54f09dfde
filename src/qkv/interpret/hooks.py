"""Named activations of any qkv model: read them all in one forward pass, or replace any of them.

No layer takes a flag. While a `hooked` block runs, forward hooks on the model's own modules copy out
the activations asked for and swap in replacements; outside it they do nothing (each block's hooks act only
on forward passes run inside that block, so threads may inspect one model at once, as `qkv explore` does).

    with hooked(model, cache=["decoder.layers.*.resid_post"]) as acts:
        model(ids)
    acts["decoder.layers.0.resid_post"]                       # (B, T, d_model)

    with hooked(model, patch={"decoder.layers.1.resid_pre": lambda x: clean_x}):
        patched_logits = model(corrupted_ids)

Names follow the layer's place in the model (`decoder.layers.3`, `encoder.layers.0`), so they are the same
with and without LoRA adapters. For each layer L:

    L.resid_pre     (B, T, d)      the residual stream entering the layer
    L.attn_out      (B, T, d)      self-attention's output, before the residual sum
    L.resid_mid     (B, T, d)      the stream after self-attention (post-norm: after its norm)
    L.cross_out, L.resid_cross     the same for cross-attention (encoder–decoder decoders)
    L.ffn_out       (B, T, d)      the feed-forward's output (absent in attention-only layers)
    L.resid_post    (B, T, d)      the stream leaving the layer
    L.attn.z        (B, T, H, d_v) each head's attention-weighted values, before W_O
    L.attn.result   (B, T, H, d)   each head's write into the stream: z_h · W_O[:, h]ᵀ
    L.attn.pattern  (B, H, T, T)   each head's attention weights (read-only: to change a head, patch z)

(and L.cross.z, L.cross.result, L.cross.pattern). A head is a query head: with grouped-query attention the
query heads of a group share one K/V head, and head h's z is its own attention over that shared V.
Σ_h result_h + b_O = attn_out, exactly.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.attention.record import record_attention
from qkv.blocks.block import DecoderLayer, EncoderLayer
from qkv.errors import QkvError
from qkv.lora import LoRALinear

Patch = Callable[[Tensor], Tensor]
# Where an activation is read: a module's input (first positional argument), its output, the input of an
# attention's W_O seen per head (z), each head's share of W_O's output (result), or recorded attention weights.
_INPUT, _OUTPUT, _HEADS, _RESULT, _PATTERN = "input", "output", "heads", "result", "pattern"


@dataclass(frozen=True)
class Site:
    """Where one named activation lives: the module hooked, and how it is read."""

    module: nn.Module
    kind: str
    attention: str = ""  # for z/result/pattern: the attention module's name (record_attention labels)
    n_heads: int = 0  # for z/result: the query heads whose outputs W_O concatenates

    @property
    def patchable(self) -> bool:
        """True if a forward pass can be run with this activation replaced."""
        return self.kind != _PATTERN


def hook_sites(model: nn.Module) -> dict[str, Site]:
    """Every named activation of `model`, in forward order, with where it is read."""
    sites: dict[str, Site] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, (EncoderLayer, DecoderLayer)):
            continue
        sites[f"{name}.resid_pre"] = Site(layer, _INPUT)
        residual = layer.attn_residual if isinstance(layer, EncoderLayer) else layer.self_residual
        sublayers: list[tuple[str, str, Any, nn.Module, str]] = [("attn", "self_attn", layer.self_attn, residual,
                                                                  "resid_mid")]  # fmt: skip
        if isinstance(layer, DecoderLayer) and layer.cross_attn is not None and layer.cross_residual is not None:
            sublayers.append(("cross", "cross_attn", layer.cross_attn, layer.cross_residual, "resid_cross"))
        for short, attr, attention, res, after in sublayers:
            n_heads = int(attention.n_heads)
            sites[f"{name}.{short}.z"] = Site(attention.out_proj, _HEADS, f"{name}.{attr}", n_heads)
            sites[f"{name}.{short}.result"] = Site(attention.out_proj, _RESULT, f"{name}.{attr}", n_heads)
            sites[f"{name}.{short}.pattern"] = Site(attention, _PATTERN, f"{name}.{attr}")
            sites[f"{name}.{short}_out"] = Site(attention, _OUTPUT)
            sites[f"{name}.{after}"] = Site(res, _OUTPUT)
        if layer.ffn is not None:
            sites[f"{name}.ffn_out"] = Site(layer.ffn, _OUTPUT)
        sites[f"{name}.resid_post"] = Site(layer, _OUTPUT)
    return sites


def hook_names(model: nn.Module, pattern: str = "*") -> list[str]:
    """The names of `model`'s activations that match the glob `pattern`, in forward order."""
    return [n for n in hook_sites(model) if fnmatch.fnmatchcase(n, pattern)]


def check_name(sites: Mapping[str, Site], pattern: str) -> list[str]:
    """The names a glob matches; a QkvError listing the close matches when it matches none."""
    found = [n for n in sites if fnmatch.fnmatchcase(n, pattern)]
    if found:
        return found
    close = difflib.get_close_matches(pattern, list(sites), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"names look like {next(iter(sites), 'none')}"
    raise QkvError(f"unknown hook name {pattern!r}; {hint} (qkv.interpret.hook_names lists them)")


_ACTIVE: ContextVar[object | None] = ContextVar("qkv_hooked", default=None)


@contextlib.contextmanager
def hooked(
    model: nn.Module, cache: str | Iterable[str] = (), patch: Mapping[str, Patch] | None = None
) -> Iterator[dict[str, Tensor]]:
    """Run forward passes of `model` that fill a dict with the `cache` activations (globs) and replace the
    `patch` ones (exact names, each mapped to a function of the activation that returns its replacement)."""
    sites = hook_sites(model)
    wanted = {n for pattern in ([cache] if isinstance(cache, str) else cache) for n in check_name(sites, pattern)}
    patches = dict(patch or {})
    for name in patches:
        check_name(sites, name)
        if name not in sites or not sites[name].patchable:
            raise QkvError(f"{name} cannot be replaced (attention weights are read-only); patch "
                           f"{name.rsplit('.', 1)[0]}.z to change what the head writes")  # fmt: skip
    token = object()
    acts: dict[str, Tensor] = {}
    handles = [_install(name, sites[name], token, acts, name in wanted, patches.get(name))
               for name in sites if name in wanted or name in patches]  # fmt: skip
    patterns = {sites[n].attention: n for n in wanted if sites[n].kind == _PATTERN}
    reset = _ACTIVE.set(token)
    try:
        with record_attention(model) if patterns else contextlib.nullcontext() as rec:
            yield acts
            if rec is not None:
                for record in rec.records:
                    if record.module in patterns:
                        acts[patterns[record.module]] = record.weights
    finally:
        _ACTIVE.reset(reset)
        for handle in handles:
            if handle is not None:
                handle.remove()


def run_with_cache(model: nn.Module, *args: object, names: str | Iterable[str] = "*",
                   **kwargs: object) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """model(*args, **kwargs) without gradients, and its activations whose names match `names`."""
    with torch.no_grad(), hooked(model, cache=names) as acts:
        out = model(*args, **kwargs)
    return out, acts


def _install(name: str, site: Site, token: object, acts: dict[str, Tensor], keep: bool,
             replace: Patch | None) -> torch.utils.hooks.RemovableHandle | None:  # fmt: skip
    """The hook that reads (and replaces) one activation in forward passes of the block that owns `token`."""
    def handle(value: Tensor) -> Tensor:
        if replace is not None:
            new = replace(value)
            if new.shape != value.shape:
                raise QkvError(f"the patch of {name} returned shape {tuple(new.shape)}, not {tuple(value.shape)}")
            value = new.to(value.dtype)
        if keep:
            acts[name] = value.detach()
        return value

    if site.kind == _PATTERN:
        return None  # read from record_attention
    if site.kind == _OUTPUT:
        def after(module: nn.Module, args: object, output: Tensor) -> Tensor | None:
            return handle(output) if _ACTIVE.get() is token else None
        return site.module.register_forward_hook(after)
    if site.kind == _RESULT:
        def split(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
            if _ACTIVE.get() is not token:
                return None
            old = head_results(module, args[0].unflatten(-1, (site.n_heads, -1)))  # (B, T, H, d)
            new = handle(old)
            return output if new is old else output + (new - old).sum(-2)  # W_O's output is Σ_h result_h + b_O
        return site.module.register_forward_hook(split)

    def before(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
        if _ACTIVE.get() is not token:
            return None
        x = args[0]
        if site.kind == _INPUT:
            return (handle(x), *args[1:])
        heads = x.unflatten(-1, (site.n_heads, -1))  # (B, T, H·d_v) → (B, T, H, d_v)
        return (handle(heads).flatten(-2), *args[1:])

    return site.module.register_forward_pre_hook(before)


def output_weight(out_proj: nn.Module) -> Tensor:
    """W_O as the forward pass applies it (d, H·d_v): with a LoRA adapter, the base weight plus B·A·scale."""
    assert isinstance(out_proj, nn.Linear)
    weight = out_proj.weight
    return weight + out_proj.delta() if isinstance(out_proj, LoRALinear) else weight


def head_results(out_proj: nn.Module, heads: Tensor) -> Tensor:
    """Each head's write into the residual stream (..., H, d) from its z (..., H, d_v); W_O's bias is not in it."""
    weight = output_weight(out_proj)  # (d, H·d_v)
    per_head = weight.unflatten(1, (heads.shape[-2], heads.shape[-1]))  # (d, H, d_v)
    return torch.einsum("...hv,dhv->...hd", heads, per_head.to(heads.dtype))
