"""Attention weights of a model, every layer and head, as PNG grids and as a bertviz export.

The weights are recorded while the model runs (qkv.attention.record_attention):
DecoderLM (`qkv train`): causal self-attention; EncoderModel (`qkv train mlm`): bidirectional
self-attention; Transformer (`qkv train translate`): encoder self-, decoder self- and cross-attention
of the model's own translation.

The JSON export holds exactly the arguments of bertviz's `head_view`, as nested lists:
`{"attention": [layer][1][heads][T][T], "tokens": [...]}` for a single stack, or encoder_attention /
decoder_attention / cross_attention with encoder_tokens / decoder_tokens for an encoder–decoder.
bertviz wants one torch tensor per layer, so, in a notebook:

    from bertviz import head_view
    from qkv.lab.attention_map import bertviz_arguments
    head_view(**bertviz_arguments("lab/attention-bertviz.json"))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qkv.attention import AttentionRecorder, record_attention
from qkv.errors import QkvError
from qkv.lab.plotting import Section, display_token, format_table, head_grid, save
from qkv.models import DecoderLM, EncoderModel, Transformer
from qkv.translation.attention_maps import recorded_translation, teacher_forced_attention

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Attention maps of a trained model"
EXPLANATION = (
    "The attention weights a trained model actually uses, for every layer and every head, on one piece of "
    "text: row = the token that is looking (query), column = the token it looks at (key), each row sums to 1. "
    "A decoder's maps are lower-triangular (causal). Heads of even a tiny model specialise: some look at the "
    "previous token, some at the start, some spread out. The JSON file next to the images feeds bertviz's "
    "interactive head_view."
)
DEFAULT_TEXT = "ROMEO: But, soft!"
# bertviz's head_view argument names for each kind of map.
BERTVIZ_KEYS = {"self": "attention", "encoder": "encoder_attention", "decoder": "decoder_attention",
                "cross": "cross_attention"}  # fmt: skip


@dataclass
class LayerMap:
    """One layer's weights of one kind of attention: self, encoder, decoder or cross."""

    kind: str
    layer: int
    weights: np.ndarray  # (heads, T_q, T_k)
    query_tokens: list[str]
    key_tokens: list[str]
    scores: np.ndarray | None = None  # (heads, T_q, T_k) before the softmax: q·k × scale, −inf where masked


@dataclass
class AttentionMapResult:
    """Every layer's attention weights for one input, with its tokens."""

    model_type: str  # "decoder_lm", "encoder" or "transformer"
    maps: list[LayerMap]
    translation: str | None = None  # an encoder–decoder run's greedy output for the text, whose decoding the maps show

    def table(self) -> str:
        """Per layer and kind: shape, row-sum check, mean entropy, and the most attended key of the last query."""
        rows = []
        for m in self.maps:
            w = m.weights
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.where(w > 0, w * np.log(w), 0.0).sum(-1).mean()
            top = [display_token(m.key_tokens[int(j)]) for j in w[:, -1].argmax(-1)]
            rows.append([m.kind, str(m.layer), str(w.shape), float(np.abs(w.sum(-1) - 1).max()), float(entropy),
                         " ".join(top)])  # fmt: skip
        first = self.maps[0]
        tokens = " ".join(display_token(t) for t in first.query_tokens)
        return format_table(
            [
                "attention",
                "layer",
                "(heads, T_q, T_k)",
                "max |row sum − 1|",
                "mean entropy (nats)",
                "last query's top key, per head",
            ],
            rows,
            title=f"{self.model_type}: {len(first.query_tokens)} tokens: {tokens}",
        )

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()

    def to_bertviz(self) -> dict[str, Any]:
        """The keyword arguments of bertviz.head_view, as JSON-ready nested lists (batch dim 1)."""
        out: dict[str, Any] = {}
        for m in self.maps:
            out.setdefault(BERTVIZ_KEYS[m.kind], []).append(m.weights[None].tolist())  # (1, H, T_q, T_k)
        first = {m.kind: m for m in reversed(self.maps)}  # the layer-0 map of each kind
        if self.model_type != "transformer":  # one stack: decoder_lm or encoder
            out["tokens"] = first["self"].query_tokens
        else:
            out["encoder_tokens"] = first["encoder"].query_tokens
            out["decoder_tokens"] = first["decoder"].query_tokens
        return out


def _tokens(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """One label per token id: each id decoded on its own."""
    return [tokenizer.decode([int(i)]) for i in ids]


def _as_batch(ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Token ids as a (1, T) int64 tensor."""
    t = torch.as_tensor(ids, dtype=torch.int64)
    t = t[None] if t.dim() == 1 else t
    if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] == 0:
        raise QkvError(f"attention maps need one non-empty sequence of token ids, got shape {tuple(t.shape)}")
    return t


def _check_fits(n_tokens: int, max_positions: int) -> None:
    """A clear error for text longer than the model's context."""
    if n_tokens > max_positions:
        raise QkvError(f"the text is {n_tokens} tokens long but the model reads at most {max_positions}; shorten it")


def _layer_maps(kind: str, recorder: AttentionRecorder, pattern: str, q_tokens: list[str],
                k_tokens: list[str]) -> list[LayerMap]:  # fmt: skip
    """LayerMaps of the recorded modules matching `pattern`, one per layer ((1, H, T_q, T_k) each)."""
    pairs = zip(recorder.weights_of(pattern), recorder.scores_of(pattern), strict=True)
    return [LayerMap(kind, i, w[0].float().cpu().numpy(), q_tokens, k_tokens, s[0].float().cpu().numpy())
            for i, (w, s) in enumerate(pairs)]  # fmt: skip


def _checked_batch(ids: torch.Tensor | Sequence[int], tokens: Sequence[str], max_positions: int) -> torch.Tensor:
    """One sequence of ids as a (1, T) batch, with one label per id, that fits the model's context."""
    batch = _as_batch(ids)
    if len(tokens) != batch.shape[1]:
        raise QkvError(f"{len(tokens)} token labels for {batch.shape[1]} token ids")
    _check_fits(batch.shape[1], max_positions)
    return batch


def decoder_attention_maps(
    model: DecoderLM, ids: torch.Tensor | Sequence[int], tokens: Sequence[str]
) -> AttentionMapResult:
    """Causal self-attention weights of a DecoderLM for one sequence, every layer and head."""
    return _one_stack_maps(model, "decoder", ids, tokens)


def encoder_attention_maps(
    model: EncoderModel, ids: torch.Tensor | Sequence[int], tokens: Sequence[str]
) -> AttentionMapResult:
    """Bidirectional self-attention weights of an EncoderModel for one sequence, every layer and head."""
    return _one_stack_maps(model, "encoder", ids, tokens)


def _one_stack_maps(
    model: DecoderLM | EncoderModel, stack: str, ids: torch.Tensor | Sequence[int], tokens: Sequence[str]
) -> AttentionMapResult:
    """The self-attention of a model with one stack of layers (`model.decoder` or `model.encoder`)."""
    batch = _checked_batch(ids, tokens, model.cfg.context_length)
    with torch.no_grad(), record_attention(model) as recorder:
        model(batch.to(next(model.parameters()).device))
    model_type = "decoder_lm" if stack == "decoder" else "encoder"
    return AttentionMapResult(model_type, _layer_maps("self", recorder, f"{stack}.layers.*.self_attn",
                                                      list(tokens), list(tokens)))  # fmt: skip


def transformer_attention_maps(
    model: Transformer,
    src_ids: torch.Tensor | Sequence[int],
    tgt_ids: torch.Tensor | Sequence[int],
    src_tokens: Sequence[str],
    tgt_tokens: Sequence[str],
) -> AttentionMapResult:
    """Encoder self-, decoder self- and cross-attention weights of an encoder–decoder Transformer."""
    src, tgt = _as_batch(src_ids), _as_batch(tgt_ids)
    if len(src_tokens) != src.shape[1] or len(tgt_tokens) != tgt.shape[1]:
        raise QkvError("need one token label per source id and per target id")
    _check_fits(max(src.shape[1], tgt.shape[1]), model.cfg.context_length)
    device = next(model.parameters()).device
    return _encoder_decoder_maps(
        teacher_forced_attention(model, src.to(device), tgt.to(device)), src_tokens, tgt_tokens
    )


def _encoder_decoder_maps(
    recorder: AttentionRecorder, src_tokens: Sequence[str], tgt_tokens: Sequence[str]
) -> AttentionMapResult:
    """The encoder self-, decoder self- and cross-attention maps of a recorded encoder–decoder pass."""
    s, t = list(src_tokens), list(tgt_tokens)
    maps = _layer_maps("encoder", recorder, "encoder.layers.*.self_attn", s, s)
    maps += _layer_maps("decoder", recorder, "decoder.layers.*.self_attn", t, t)
    maps += _layer_maps("cross", recorder, "decoder.layers.*.cross_attn", t, s)
    return AttentionMapResult("transformer", maps)


def attention_map(run_dir: str | Path, text: str = DEFAULT_TEXT, checkpoint: str = "best") -> AttentionMapResult:
    """Attention maps of the model in a `qkv train` run directory (any task with a tokenizer) on `text`."""
    from qkv.tasks import load  # deferred: loading runs pulls in the tokenizers library

    if not text:
        raise QkvError("--text is empty; give the text whose attention to show")
    return run_attention_maps(load(run_dir, checkpoint), text)


def run_attention_maps(run: Any, text: str) -> AttentionMapResult:
    """Attention maps of a loaded run (qkv.tasks.load) on `text`: a translation run's source, or a model's input."""
    if not text:
        raise QkvError("the text is empty; give the text whose attention to show")
    if isinstance(run.model, Transformer):
        return _translation_maps(run, text)
    tokenizer = run.require_tokenizer()
    ids = tokenizer.encode(text)
    if not ids:
        raise QkvError(f"the text {text!r} encodes to no tokens")
    if isinstance(run.model, EncoderModel):
        return encoder_attention_maps(run.model, ids, _tokens(tokenizer, ids))
    return decoder_attention_maps(run.model, ids, _tokens(tokenizer, ids))


def _translation_maps(run: Any, text: str) -> AttentionMapResult:
    """An encoder–decoder run: `text` is the source; the target is the model's own greedy translation."""
    translator = run.translator()
    src, tgt, recorder = recorded_translation(translator, text)
    _check_fits(max(len(src), len(tgt)), run.model.cfg.context_length)
    result = _encoder_decoder_maps(recorder, _tokens(translator.tokenizer, src), _tokens(translator.tokenizer, tgt))
    result.translation = translator.tokenizer.decode(tgt[1:]).strip()  # as Translator.translate decodes it
    return result


def plot(result: AttentionMapResult, path: str | Path | None, index: int = 0) -> Figure:
    """One layer's heads (result.maps[index]) as a grid of heat maps, tokens on both axes (PNG; path None: no file)."""
    m = result.maps[index]
    q = [display_token(t) for t in m.query_tokens]
    k = [display_token(t) for t in m.key_tokens]
    title = f"{result.model_type}: {m.kind}-attention, layer {m.layer} ({m.weights.shape[0]} heads)"
    return save(head_grid(m.weights, q, k, title, annotate=len(k) <= 10), path)


def plot_layers(result: AttentionMapResult, out_dir: str | Path, prefix: str = "attention") -> list[Path]:
    """One PNG per layer and kind of attention: PREFIX-KIND-layerN.png; returns the paths."""
    paths = []
    for i, m in enumerate(result.maps):
        path = Path(out_dir) / f"{prefix}-{m.kind}-layer{m.layer}.png"
        plot(result, path, i)
        paths.append(path)
    return paths


def export_bertviz(result: AttentionMapResult, path: str | Path) -> Path:
    """Write the bertviz head_view arguments as JSON (see the module docstring for how to use it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_bertviz()), encoding="utf-8")
    return path


def bertviz_arguments(path: str | Path) -> dict[str, Any]:
    """Read an export back as head_view's keyword arguments: the weights as one tensor per layer."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {key: [torch.tensor(layer) for layer in value] if key.endswith("attention") else value
            for key, value in data.items()}  # fmt: skip


def run(out_dir: Path, run_dir: str | Path, text: str | None = None, checkpoint: str = "best") -> Section:
    """Attention maps of a trained run on `text` (None: DEFAULT_TEXT): one PNG per layer plus attention-bertviz.json."""
    result = attention_map(run_dir, DEFAULT_TEXT if text is None else text, checkpoint)
    images = plot_layers(result, out_dir)
    json_path = export_bertviz(result, out_dir / "attention-bertviz.json")
    note = f"bertviz export: {json_path} (head_view(**qkv.lab.attention_map.bertviz_arguments(path)))"
    return Section("attention-map", TITLE, EXPLANATION, [f"{result.table()}\n\n{note}"], images)
