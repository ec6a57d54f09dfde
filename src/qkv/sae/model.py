"""The sparse autoencoder: a wide, sparse dictionary of a model's activations.

An SAE reads one activation x (d,) and writes it as a sparse sum of learned directions:

    a = σ((x·s − b_dec) W_enc + b_enc)        (d_sae,)  the latents; few are non-zero
    x̂ = (a W_dec + b_dec) / s                 (d,)      the reconstruction

s is a fixed input scale, measured once before training so that activations have a mean norm of √d (SAELens's
"expected_average_only_in"): the same learning rate then suits any model and layer. W_dec is stored (d_sae, d) as
SAELens stores it: row i is latent i's direction. σ is one of:

    topk       keep each token's k largest pre-activations (ReLU'd), zero the rest: L0 is k by construction
    batchtopk  keep the k·N largest of a batch of N tokens, so tokens share the budget; at inference a threshold
               (learned during training as the mean smallest kept value) replaces the batch
    relu       ReLU, with an L1 penalty on the latents weighted by their decoder norms (Anthropic's "standard" SAE)

TopK and BatchTopK read the decoder as if its rows had unit norm (pre-activations multiplied by the row norms, latents
divided by them before decoding), as SAELens's rescale_acts_by_decoder_norm does: a latent's direction is always a
unit vector, whatever the decoder's norms drift to, and saving folds the norms in.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.models.config import ModelConfig

Architecture = Literal["topk", "batchtopk", "relu"]


@dataclass(frozen=True, kw_only=True)
class SAEConfig(ModelConfig):
    """A sparse autoencoder over activations of width d_model."""

    model_type: ClassVar[str] = "sae"

    d_model: int = 0  # the activation's width (0: the hooked model's, set by the task)
    max_positions: int | None = None  # an SAE reads one position at a time
    d_sae: int = 0  # latents (0: expansion × d_model)
    expansion: int = 8  # latents per input dimension when d_sae is 0
    architecture: Architecture = "topk"
    k: int = 32  # latents kept per token (topk) or per token on average (batchtopk)
    l1_coefficient: float = 5.0  # relu: the weight of the L1 penalty
    aux_coefficient: float = 1.0  # topk, batchtopk: the weight of AuxK, dead latents predicting the residual
    rescale_by_decoder_norm: bool = True  # topk, batchtopk: read the decoder's rows as unit vectors (SAELens's)
    threshold_lr: float = 0.01  # batchtopk: the rate of the threshold's moving average
    decoder_init_norm: float = 0.1  # the decoder rows' norm at initialisation (Anthropic's April 2024 update)
    dead_window: int = 1_000_000  # a latent that has not fired in this many training tokens counts as dead

    def check(self) -> None:
        """Positive sizes; k below the latents."""
        for name in ("d_model", "d_sae"):
            if getattr(self, name) < 0:
                raise QkvError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if self.expansion < 1 or self.k < 1 or self.dead_window < 1:
            raise QkvError(f"expansion, k and dead_window must be ≥ 1, got {self.expansion}, {self.k}, "
                           f"{self.dead_window}")  # fmt: skip
        if self.l1_coefficient < 0 or self.aux_coefficient < 0 or not 0 < self.threshold_lr <= 1:
            raise QkvError("l1_coefficient and aux_coefficient must be ≥ 0 and threshold_lr in (0, 1]")
        if self.d_model and self.architecture != "relu" and self.k > self.latents:
            raise QkvError(f"k = {self.k} is more than the {self.latents} latents; lower it (--model k=…)")

    @property
    def latents(self) -> int:
        """d_sae, or expansion × d_model when it is 0."""
        return self.d_sae or self.expansion * self.d_model

    def build(self) -> SparseAutoencoder:
        """The SAE, initialised as SAELens initialises it."""
        if self.d_model < 1:
            raise QkvError("the SAE's d_model is not set: it is the width of the activation it reads")
        return SparseAutoencoder(self)


@dataclass
class SAELoss:
    """One training batch's loss and its parts (in the normalised space the SAE trains in)."""

    total: Tensor  # what backward() is called on
    mse: Tensor  # ‖x − x̂‖² summed over the width, averaged over tokens
    auxiliary: Tensor  # AuxK (topk, batchtopk) or the L1 penalty (relu)
    latents: Tensor  # (N, d_sae) the batch's latents


class SparseAutoencoder(nn.Module):
    """encode, decode and the training loss of one SAE (see the module docstring)."""

    input_scale: Tensor
    tokens_since_fired: Tensor
    threshold: Tensor

    def __init__(self, cfg: SAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, n = cfg.d_model, cfg.latents
        w_dec = torch.empty(n, d)
        nn.init.kaiming_uniform_(w_dec)
        w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True) * cfg.decoder_init_norm
        self.W_dec = nn.Parameter(w_dec)  # (d_sae, d)
        self.W_enc = nn.Parameter(w_dec.T.contiguous())  # (d, d_sae): the decoder's transpose at first
        self.b_enc = nn.Parameter(torch.zeros(n))
        self.b_dec = nn.Parameter(torch.zeros(d))
        self.register_buffer("input_scale", torch.ones(()))  # s: set once from the data, before training
        self.register_buffer("tokens_since_fired", torch.zeros(n, dtype=torch.int64))
        self.register_buffer("threshold", torch.zeros(n, dtype=torch.float64))  # batchtopk's inference thresholds

    @property
    def rescaled(self) -> bool:
        """Whether the decoder's row norms are divided out (TopK and BatchTopK)."""
        return self.cfg.architecture != "relu" and self.cfg.rescale_by_decoder_norm

    def decoder_norms(self) -> Tensor:
        """Each latent's decoder row norm (d_sae,)."""
        return self.W_dec.norm(dim=-1)

    def pre_activations(self, xn: Tensor) -> Tensor:
        """(…, d_sae) pre-activations of normalised inputs (…, d)."""
        pre = (xn - self.b_dec) @ self.W_enc + self.b_enc
        return pre * self.decoder_norms() if self.rescaled else pre

    def activate(self, pre: Tensor) -> Tensor:
        """The latents from pre-activations: TopK, BatchTopK (a threshold outside training) or ReLU."""
        arch = self.cfg.architecture
        if arch == "relu":
            return pre.relu()
        if arch == "batchtopk" and not self.training:
            return pre.relu() * (pre > self.threshold.to(pre.dtype))
        if arch == "topk":
            top = pre.topk(self.cfg.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        flat = pre.relu().flatten()  # batchtopk, training: the batch's k·N largest, tokens competing for them
        top = flat.topk(int(self.cfg.k * pre.shape[:-1].numel()), sorted=False)
        return torch.zeros_like(flat).scatter(-1, top.indices, top.values).view_as(pre)

    def decode_normalised(self, latents: Tensor) -> Tensor:
        """(…, d) the reconstruction in the normalised space."""
        if self.rescaled:
            latents = latents / self.decoder_norms()
        return latents @ self.W_dec + self.b_dec

    def encode(self, x: Tensor) -> Tensor:
        """(…, d_sae) latents of activations x (…, d) as the model produced them."""
        return self.activate(self.pre_activations(x.to(self.W_enc.dtype) * self.input_scale))

    def decode(self, latents: Tensor) -> Tensor:
        """(…, d) the reconstruction, in the model's units."""
        return self.decode_normalised(latents) / self.input_scale

    def forward(self, x: Tensor) -> Tensor:
        """x̂: the activation rebuilt from its latents."""
        return self.decode(self.encode(x))

    @torch.no_grad()
    def folded(self) -> SparseAutoencoder:
        """The same function as an SAE without an input scale whose (rescaled) decoder rows are unit vectors: the form
        SAELens saves. Its latents are in the model's units (a rescaled SAE's are this one's divided by the scale)."""
        out = copy.deepcopy(self).eval()  # on this SAE's device, without drawing an initialisation
        s = float(self.input_scale)
        w_enc, w_dec, b_enc = self.W_enc * s, self.W_dec / s, self.b_enc.clone()
        threshold = self.threshold.clone()
        if self.rescaled:
            norms = w_dec.norm(dim=-1)  # (d_sae,)
            w_enc, w_dec, b_enc, threshold = w_enc * norms, w_dec / norms[:, None], b_enc * norms, threshold / s
        for name, value in (("W_enc", w_enc), ("W_dec", w_dec), ("b_enc", b_enc), ("b_dec", self.b_dec / s),
                            ("threshold", threshold)):  # fmt: skip
            getattr(out, name).copy_(value)
        out.input_scale.fill_(1.0)
        return out

    def dead(self) -> Tensor:
        """(d_sae,) bool: latents that have not fired within the last dead_window training tokens."""
        return self.tokens_since_fired > self.cfg.dead_window

    def loss(self, xn: Tensor, dead: Tensor | None = None) -> SAELoss:
        """The training loss of normalised inputs (N, d) and what it is made of.

        dead: the latents AuxK revives (default: those dead before this batch). In training mode the firing counts
        (and BatchTopK's threshold) then move on by this batch.
        """
        dead = self.dead() if dead is None else dead
        pre = self.pre_activations(xn)  # (N, d_sae)
        latents = self.activate(pre)
        recon = self.decode_normalised(latents)
        mse = (recon - xn).pow(2).sum(-1).mean()
        if self.cfg.architecture == "relu":
            weighted = latents * self.decoder_norms()
            auxiliary = self.cfg.l1_coefficient * weighted.norm(p=1, dim=-1).mean()
        else:
            auxiliary = self._auxk(xn, recon, pre, dead)
        if self.training:
            self._count(latents)
        return SAELoss(mse + auxiliary, mse, auxiliary, latents)

    def _auxk(self, xn: Tensor, recon: Tensor, pre: Tensor, dead: Tensor) -> Tensor:
        """AuxK (Gao et al. 2024, appendix A.2): the top d/2 dead latents' reconstruction of what the live ones
        missed, weighted down while few are dead, as SAELens computes it."""
        n_dead = int(dead.sum())
        if n_dead == 0:
            return recon.new_zeros(())
        k_aux = xn.shape[-1] // 2
        weight = min(n_dead / k_aux, 1.0)
        top = torch.where(dead, pre, -torch.inf).topk(min(k_aux, n_dead), dim=-1, sorted=False)
        aux_latents = torch.zeros_like(pre).scatter(-1, top.indices, top.values)
        if self.rescaled:
            aux_latents = aux_latents / self.decoder_norms()
        residual = (xn - recon).detach()
        return self.cfg.aux_coefficient * weight * (aux_latents @ self.W_dec - residual).pow(2).sum(-1).mean()

    @torch.no_grad()
    def _count(self, latents: Tensor) -> None:
        """Move the firing counts on by a training batch; BatchTopK's threshold toward its smallest kept value."""
        fired = (latents > 0).flatten(0, -2).any(0)
        self.tokens_since_fired += latents[..., 0].numel()
        self.tokens_since_fired[fired] = 0
        if self.cfg.architecture == "batchtopk" and bool((latents > 0).any()):
            smallest = latents[latents > 0].min().to(self.threshold.dtype)
            self.threshold.mul_(1 - self.cfg.threshold_lr).add_(self.cfg.threshold_lr * smallest)
