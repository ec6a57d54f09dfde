"""The logit lens: read each layer's residual stream as if the model stopped there.

Each layer's stream goes through the model's final norm, recomputed on that stream (its own mean and
scale), then the output head: the probabilities the model would give if the remaining layers wrote
nothing (nostalgebraist, 2020). The last row is the model's own output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.interpret.hooks import run_with_cache
from qkv.models import DecoderLM, EncoderModel, Transformer


@dataclass
class Readout:
    """How a model turns its last residual stream into logits: which stack, its final norm, its head."""

    stack: str  # "decoder" or "encoder": the layers whose streams the lens reads
    n_layers: int
    norm: nn.Module | None  # None: the model has no final norm (post-norm stacks)
    head: nn.Module

    @property
    def note(self) -> str:
        """What the lens applies before the head, in one line."""
        if self.norm is not None:
            return f"final norm ({type(self.norm).__name__}) recomputed on each layer's stream, then the output head"
        return ("this model has no final norm (a post-norm stack normalises inside each layer): "
                "the lens applies the output head to each stream directly")  # fmt: skip

    def logits(self, stream: Tensor) -> Tensor:
        """(..., d) stream → (..., vocab) logits, through the final norm (recomputed) and the head."""
        return self.head(self.norm(stream) if self.norm is not None else stream)


def readout_of(model: nn.Module) -> Readout:
    """The model's final norm and output head (a QkvError for a model without an output over a vocabulary)."""
    if isinstance(model, DecoderLM):
        return Readout("decoder", len(model.decoder.layers), model.decoder.norm, model.lm_head)
    if isinstance(model, Transformer):
        return Readout("decoder", len(model.decoder.layers), model.decoder.norm, model.generator)
    if isinstance(model, EncoderModel):
        if model.mlm_head is None:
            raise QkvError("this encoder has no masked-LM head, so its streams have no vocabulary to be read in")
        return Readout("encoder", len(model.encoder.layers), model.encoder.norm, model.mlm_head)
    raise QkvError(f"{type(model).__name__} is not a qkv model; convert it first (qkv convert)")


def stream_names(readout: Readout) -> list[str]:
    """The streams the lens reads: each layer's input, then the last layer's output (n_layers + 1)."""
    layers = [f"{readout.stack}.layers.{i}.resid_pre" for i in range(readout.n_layers)]
    return [*layers, f"{readout.stack}.layers.{readout.n_layers - 1}.resid_post"]


@dataclass
class LensResult:
    """Logits per stream: row i reads the stream entering layer i; the last row, the last layer's output."""

    labels: list[str]  # "embeddings", "after layer 0", …, "after layer L−1"
    logits: Tensor  # (L + 1, B, T, vocab)
    note: str  # what was applied between the stream and the head

    @property
    def probs(self) -> Tensor:
        """(L + 1, B, T, vocab) probabilities."""
        return self.logits.float().softmax(dim=-1)

    def top(self, k: int = 5) -> tuple[Tensor, Tensor]:
        """The k most probable tokens per stream and position: (probs, ids), each (L + 1, B, T, k)."""
        return self.probs.topk(k, dim=-1)


def logit_lens(model: nn.Module, *inputs: Tensor) -> LensResult:
    """The logit lens of model(*inputs): ids (B, T) for a language model; src, tgt for an encoder–decoder."""
    readout = readout_of(model)
    names = stream_names(readout)
    with torch.no_grad():
        _, acts = run_with_cache(model.eval(), *inputs, names=names)
        logits = torch.stack([readout.logits(acts[name]) for name in names])  # (L + 1, B, T, vocab)
    labels = ["embeddings", *(f"after layer {i}" for i in range(readout.n_layers))]
    return LensResult(labels, logits, readout.note)
