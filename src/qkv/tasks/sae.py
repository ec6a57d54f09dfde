"""The SAE task (`qkv interpret sae train MODEL --hook NAME --data DIR`, or `qkv train sae --lm MODEL …`): a sparse
autoencoder (qkv.sae) trained, through the one loop, on a language model's activations at one named hook.

The language model is any decoder-only checkpoint (a qkv run, a .gguf file, a Hugging Face or `qkv convert`
directory); it stays frozen and outside the loop, which trains only the SAE. The activations come from prepared
shards (`qkv prepare`, with the model's tokenizer), read on the fly through a bounded, shuffled buffer
(qkv.sae.activations). Before the first step the task measures, on a sample of its own, the input scale (mean norm
√d) and the geometric median that b_dec starts at. A step's batch is --batch-size activations. Evaluations read
held-out windows of the validation split: FVU and L0 each time, and the losses with the SAE spliced in (loss
recovered) in the last one and in `qkv eval`. The lowest held-out FVU keeps model.safetensors.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from qkv.config import option
from qkv.data.tokens import TokenData, open_data
from qkv.errors import QkvError
from qkv.finetune.base import Base, load_base
from qkv.finetune.reference import check_reference
from qkv.interpret.hooks import check_name, hook_sites
from qkv.io.devices import resolve_device
from qkv.io.files import load_json
from qkv.io.invocation import program
from qkv.io.run_dir import CHECKPOINT_DIR, read_run_config
from qkv.sae import SAEConfig, SparseAutoencoder
from qkv.sae.activations import ActivationStream, Buffered, Filters, geometric_median
from qkv.sae.cache import CachedStream
from qkv.sae.measures import eval_windows, sae_measures
from qkv.tasks.base import EvalOptions, LoadedRun
from qkv.training import Evaluation, RunConfig, Task, TrainResult
from qkv.training.checkpoint import LATEST
from qkv.training.config import DataConfig, EvalConfig, OptimConfig, ScheduleConfig

READABLE = ("resid_pre", "resid_mid", "resid_post", "attn_out", "ffn_out")  # hooks of width d_model, one per position
INIT_ROWS = 16_384  # activations sampled for the input scale and b_dec's starting point


@dataclass(frozen=True, kw_only=True)
class SAETrainConfig(RunConfig[SAEConfig]):
    """How to train an SAE: the model and hook it reads, the data, and what the activation stream keeps."""

    task: ClassVar[str] = "sae"
    model_class: ClassVar[type[SAEConfig]] = SAEConfig
    paths: ClassVar[tuple[str, ...]] = ("lm", "source", "activations")

    lm: str | None = option(None, "the language model whose activations the SAE reads: a qkv run, a .gguf file, a "
                            "Hugging Face or `qkv convert` directory", fixed=True)  # fmt: skip
    hook: str | None = option(None, "the activation read (`qkv interpret hooks MODEL` lists them); none: the residual "
                              "stream entering the middle layer", fixed=True)  # fmt: skip
    source: str | None = option(None, "a data directory from `qkv prepare`, made with the model's tokenizer",
                                fixed=True, flag="data")  # fmt: skip
    activations: str | None = option(None, "read the activations from this cache (`qkv interpret sae cache`) "
                                     "instead of computing them", fixed=True)  # fmt: skip
    block_size: int = option(128, "tokens per window the model reads", fixed=True)
    buffer_tokens: int = option(65_536, "activations held and shuffled at once (memory: this × width × 4 bytes)",
                                fixed=True)  # fmt: skip
    drop_first: bool = option(True, "drop each window's first position (the attention sink)", fixed=True)
    max_norm_ratio: float | None = option(10.0, "drop activations whose norm is above this × the median (none: keep "
                                          "all)", fixed=True)  # fmt: skip
    b_dec_init: str = option("median", "b_dec's starting point: median (geometric), mean or zeros", fixed=True)
    eval_windows: int = option(64, "held-out windows each evaluation reads")

    def check(self) -> None:
        """The shared checks, then the stream's."""
        super().check()
        if self.block_size < 2 or self.buffer_tokens < 1 or self.eval_windows < 1:
            raise QkvError("block-size must be ≥ 2, buffer-tokens and eval-windows ≥ 1")
        if self.system.seed < 0:
            raise QkvError(f"seed must be ≥ 0, got {self.system.seed}")
        if self.b_dec_init not in ("median", "mean", "zeros"):
            raise QkvError(f"b-dec-init must be median, mean or zeros, got {self.b_dec_init!r}")
        if self.max_norm_ratio is not None and self.max_norm_ratio <= 1:
            raise QkvError(f"max-norm-ratio must be above 1 (or none), got {self.max_norm_ratio}")
        if self.system.compile:
            raise QkvError("--compile is not supported for SAE training; drop it")

    @property
    def filters(self) -> dict[str, Any]:
        """The stream's position filters, as saved in config.json."""
        return {"drop_first": self.drop_first, "max_norm_ratio": self.max_norm_ratio}


def recipe() -> SAETrainConfig:
    """A TopK SAE, 8 latents per dimension, k = 32, on 500 steps of 4,096 activations (about 2 M tokens), Adam at
    4e-4 (Gao et al.'s rate for this width) with a short warm-up and a linear decay, gradients clipped at 1."""
    return SAETrainConfig(model=SAEConfig.of(), data=DataConfig(batch_size=4096),
                          optim=OptimConfig(lr=4e-4, weight_decay=0.0, beta2=0.999, grad_clip=1.0),
                          schedule=ScheduleConfig(decay="linear", warmup_steps=25, max_steps=500, min_lr=0.0),
                          eval=EvalConfig(interval=100))  # fmt: skip


@dataclass
class SAEBatch:
    """One micro-batch of activations (N, d) on its device."""

    x: Tensor

    @property
    def n_targets(self) -> int:
        """Each activation is one target."""
        return len(self.x)

    @property
    def n_tokens(self) -> int:
        """Each activation is one token."""
        return len(self.x)


def width_of(base: Base, hook: str) -> int:
    """The width of a readable hook, or a one-line error naming the hooks an SAE reads."""
    if hook.rsplit(".", 1)[-1] not in READABLE:
        raise QkvError(f"an SAE reads one vector per position: give a hook ending in {', '.join(READABLE)}, not {hook}")
    return base.model.cfg.d_model


def middle_hook(base: Base) -> str:
    """The residual stream entering the middle layer."""
    return f"decoder.layers.{base.model.cfg.decoder.n_layers // 2}.resid_pre"


def load_subject(cfg: SAETrainConfig, reference: dict[str, Any] | None,
                 device: str | torch.device = "cpu") -> tuple[Base, str, TokenData]:  # fmt: skip
    """The language model (its weights checked against `reference`) on `device`, the hook, and the data, each
    checked."""
    if cfg.lm is None or cfg.source is None:
        raise QkvError("an SAE reads a model's activations on prepared text: give the model and --data DIR")
    data = open_data(cfg.source)
    if reference is not None:  # a run's model: the very weights it was trained on, or a one-line refusal
        check_reference(reference, "this run", "an SAE", "train the SAE again on this one")
    base, hook = load_hooked(cfg.lm, cfg.hook, reference, device)
    if data.fingerprint != base.tokenizer.fingerprint():
        raise QkvError(f"{cfg.source} was prepared with another tokenizer than {cfg.lm}'s; prepare it with "
                       f"`{program()} prepare INPUT --tokenizer {cfg.lm} --out DIR`")  # fmt: skip
    return base, hook, data


def load_hooked(lm: str, hook: str | None, reference: dict[str, Any] | None = None,
                device: str | torch.device = "cpu", role: str = "MODEL") -> tuple[Base, str]:  # fmt: skip
    """The frozen language model on `device` and the hook it is read at (default: the middle layer's stream),
    checked to be one of its activations of width d_model (role: the option that named the model, for messages)."""
    base = load_base(lm, reference, role=role)
    base.model.eval().requires_grad_(False).to(device)
    hook = hook or middle_hook(base)
    check_name(hook_sites(base.model), hook)
    width_of(base, hook)
    return base, hook


def filters_of(cfg: SAETrainConfig, base: Base) -> Filters:
    """The run's position filters, with the model's BOS token."""
    bos = (base.reference.get("metadata") or {}).get("bos_token_id")
    return Filters(cfg.drop_first, bos if isinstance(bos, int) else None, cfg.max_norm_ratio)


def cache_about(cfg: SAETrainConfig, base: Base, hook: str, data: TokenData) -> dict[str, Any]:
    """What an activation cache records of where its rows come from."""
    return {"model": {k: base.reference[k] for k in ("path", "sha256", "kind")}, "hook": hook,
            "filters": cfg.filters, "data": {"directory": str(data.directory.resolve()), "tokenizer": data.fingerprint}}


def checkpoint_step(run_dir: Path) -> int:
    """The step of a run's committed checkpoint (0 without one)."""
    pointer = run_dir / CHECKPOINT_DIR / LATEST
    return int(load_json(pointer, "checkpoint pointer")["step"]) if pointer.is_file() else 0


class SAETask(Task):
    """Train an SAE on a frozen model's activations. The lowest held-out FVU keeps the best weights of a TopK SAE;
    a BatchTopK or ReLU SAE's L0 moves while it trains (a threshold, a penalty), so there the latest weights do."""

    name = "sae"
    best_metric = "val_choice"

    def __init__(self, cfg: SAETrainConfig) -> None:
        super().__init__(cfg)
        self.cfg: SAETrainConfig = cfg
        self.start: dict[str, Tensor] = {}  # the input scale and b_dec a new run starts from
        self.last: dict[str, Tensor] = {}

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """<model>-<hook>-sae."""
        sae_cfg = cast(SAETrainConfig, cfg)
        model = Path(sae_cfg.lm or "model").name.removesuffix(".gguf")
        return f"{model}-{sae_cfg.hook or 'middle'}-sae".replace("/", "_")

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Load and check the model, hook and data; open the stream where the run stands; a new run measures the
        input scale and b_dec's start on a sample of its own."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise QkvError("an SAE trains on one process: drop --nproc and torchrun")
        stored = read_run_config(run_dir).get("base") if resume else None
        self.base, self.hook, self.data = load_subject(self.cfg, stored, resolve_device(self.cfg.system.device))
        if self.data.split("val").window_count(self.cfg.block_size) < 1:
            raise QkvError(f"the validation split of {self.cfg.source} holds no window of {self.cfg.block_size + 1} "
                           "tokens to measure the SAE on; lower --block-size or prepare more text")  # fmt: skip
        self.cfg = dataclasses.replace(self.cfg, hook=self.hook)
        self.filters = filters_of(self.cfg, self.base)
        self.stream: Buffered = self._stream(self.cfg.system.seed)
        if self.cfg.activations is not None:
            self.stream = self._cached(self.cfg.activations)
        self.resumed_step = checkpoint_step(run_dir) if resume else 0
        self.position: int | None = None
        if not resume:
            self.start = self._starting_point()

    def _stream(self, seed: int) -> ActivationStream:
        """The training split's activation stream from a seed."""
        cfg = self.cfg
        return ActivationStream(self.base.model, self.hook, self.data.split("train"), cfg.block_size, self.filters,
                                cfg.buffer_tokens, seed)  # fmt: skip

    def _cached(self, directory: str) -> CachedStream:
        """The cache, refused unless it holds this model's activations at this hook, filtered as this run filters."""
        cached = CachedStream(directory)
        about = cache_about(self.cfg, self.base, self.hook, self.data)
        differs = [k for k, v in about.items() if cached.meta.get(k) != v]
        if cached.meta.get("block_size") != self.cfg.block_size:
            differs.append("block_size")
        if differs:
            raise QkvError(f"{directory} holds other activations than this run reads ({', '.join(differs)} differ); "
                           "cache them again for this model, hook and data")  # fmt: skip
        needed = self.cfg.schedule.max_steps * self.cfg.data.batch_size * self.cfg.data.grad_accum
        if needed > cached.total:
            raise QkvError(f"{directory} holds {cached.total:,} activations and --max-steps "
                           f"{self.cfg.schedule.max_steps} reads {needed:,}: cache more or lower "
                           "--max-steps")  # fmt: skip
        return cached

    def _starting_point(self) -> dict[str, Tensor]:
        """The input scale (mean norm √d) and b_dec's start, from INIT_ROWS activations of a stream of their own."""
        cfg = self.cfg
        sample = ActivationStream(self.base.model, self.hook, self.data.split("train"), cfg.block_size, self.filters,
                                  INIT_ROWS, cfg.system.seed + 1)  # fmt: skip
        rows = sample.buffer(0)
        scale = rows.shape[-1] ** 0.5 / rows.norm(dim=-1).mean()
        scaled = rows * scale
        b_dec = {"median": geometric_median, "mean": lambda r: r.mean(0), "zeros": lambda r: torch.zeros(r.shape[-1])}
        return {"input_scale": scale, "b_dec": b_dec[self.cfg.b_dec_init](scaled)}

    def model_config(self) -> SAEConfig:  # type: ignore[override]
        """The run's SAE over the hook's width, its latents counted."""
        width = width_of(self.base, self.hook)
        cfg = dataclasses.replace(self.cfg.model, d_model=width)
        return dataclasses.replace(cfg, d_sae=cfg.latents)

    def build_model(self) -> SparseAutoencoder:
        """The SAE, from the measured input scale and b_dec start (a resumed run's weights are loaded after)."""
        sae = self.model_config().build()
        with torch.no_grad():
            for name, value in self.start.items():
                getattr(sae, name).copy_(value)
        return sae

    def describe(self) -> str:
        """The model, hook and data."""
        return (f"{self.hook} of {Path(self.base.reference['path']).name}, {self.data.describe()}, "
                f"{self.cfg.model.architecture} SAE")  # fmt: skip

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Tensor:
        """The stream's next `budget` activations (N, d) (a resumed run's first draw finds where it stood)."""
        if self.position is None:
            self.position = self.resumed_step * budget
        rows = self.stream.rows(self.position, budget)
        self.position += budget
        return rows

    def collate(self, examples: Any, device: torch.device) -> SAEBatch:
        """The activations on the device."""
        return SAEBatch(examples.to(device))

    def logits(self, model: Callable[..., Any], batch: SAEBatch) -> Tensor:
        """The reconstruction."""
        return cast(Tensor, model(batch.x))

    def criterion(self, logits: Tensor, batch: SAEBatch) -> Tensor:
        """Not used: an SAE's loss needs its latents, not only its reconstruction (SAETask.loss)."""
        raise QkvError("an SAE's training loss is SparseAutoencoder.loss (SAETask.loss)")

    def loss(self, model: Callable[..., Any], batch: SAEBatch) -> Tensor:
        """The SAE's loss on the batch, scaled to its normalised units: MSE plus AuxK (or the L1 penalty)."""
        if not isinstance(model, SparseAutoencoder):
            raise QkvError("an SAE trains on one process (no --nproc, no torchrun)")
        loss = model.loss(batch.x * model.input_scale)
        self.last = {"mse": loss.mse.detach(), "aux": loss.auxiliary.detach(),
                     "l0": (loss.latents > 0).sum(-1).float().mean()}  # fmt: skip
        return loss.total

    def progress_note(self) -> str:
        """The latest step's MSE, auxiliary loss and L0."""
        if not self.last:
            return ""
        last = {k: float(v) for k, v in self.last.items()}  # read here, once per shown step, not at every step
        return f"mse {last['mse']:.3f}  aux {last['aux']:.3f}  L0 {last['l0']:.1f}  "

    @property
    def partial_evaluation(self) -> bool:
        """Periodic evaluations measure FVU and L0; the last one adds the losses."""
        return True

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """FVU, L0 and the dead share on held-out windows; in the last evaluation, the losses too."""
        sae = cast(SparseAutoencoder, ev.model)
        windows = eval_windows(self.data.split("val"), self.cfg.block_size, self.cfg.eval_windows)
        measures = sae_measures(self.base.model, sae, self.hook, windows, self.filters, losses=ev.full)
        results = {f"val_{k}": v for k, v in measures.items() if k != "tokens"}
        latest = -float(self.position or 0)  # lower is later
        return {**results, "val_choice": results["val_fvu"] if self.cfg.model.architecture == "topk" else latest}

    def summary(self, result: TrainResult) -> str:
        """The held-out measures, and what to run next."""
        f = result.final
        recovered = f"loss recovered {f['val_loss_recovered']:.1%}, " if "val_loss_recovered" in f else ""
        unfired = f" ({f['val_unfired_share']:.1%} never fired on held-out text)" if "val_unfired_share" in f else ""
        q = program()
        return "\n".join([
            f"\nheld-out FVU {f['val_fvu']:.4f}, L0 {f['val_l0']:.1f}, {recovered}dead {f['val_dead_share']:.1%}"
            f"{unfired} after {result.step} steps, "
            f"{result.took()} — run saved in {result.run_dir}",
            f"more: {q} eval {result.run_dir}  |  {q} interpret features {result.run_dir}"])

    def data_summary(self) -> dict[str, Any] | None:
        """The data directory, the hook and the filters: where the SAE belongs."""
        return {"directory": str(self.data.directory), "fingerprint": self.data.fingerprint, "hook": self.hook,
                "filters": self.cfg.filters}  # fmt: skip

    def base_summary(self) -> dict[str, Any] | None:
        """The model the SAE reads: path, sha256 of its weights, kind."""
        return self.base.reference


@dataclass
class SAERun(LoadedRun):
    """A trained SAE with the model it reads (hash-checked) and its data."""

    model: SparseAutoencoder  # type: ignore[assignment]
    config: SAETrainConfig
    config_class: ClassVar[type[RunConfig[Any]]] = SAETrainConfig

    def subject(self) -> tuple[Base, str, TokenData]:
        """The language model, hook and data the SAE was trained on, the model's weights checked."""
        stored = read_run_config(self.directory)
        cfg = dataclasses.replace(self.config, source=(stored.get("data") or {}).get("directory", self.config.source))
        return load_subject(cfg, stored.get("base"), self.device)

    def evaluate(self, options: EvalOptions) -> list[str]:
        """FVU, L0, the dead share and the loss recovered on the held-out windows."""
        options.refuse_beam_options(self.task)
        base, hook, data = self.subject()
        windows = eval_windows(data.split("val"), self.config.block_size, self.config.eval_windows)
        m = sae_measures(base.model, self.model, hook, windows, filters_of(self.config, base))
        return [f"{hook} of {Path(base.reference['path']).name}, {int(m['tokens']):,} held-out activations "
                f"({self.checkpoint} weights):",
                f"  FVU {m['fvu']:.4f}   L0 {m['l0']:.1f}   dead {m['dead_share']:.1%} (not fired in the last "
                f"{self.model.cfg.dead_window:,} training tokens), {m['unfired_share']:.1%} never fired here",
                f"  next-token loss {m['loss_clean']:.4f} clean, {m['loss_sae']:.4f} with the SAE, "
                f"{m['loss_zero']:.4f} zero-ablated: loss recovered {m['loss_recovered']:.1%}"]  # fmt: skip
