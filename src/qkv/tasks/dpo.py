"""Direct preference optimisation (`qkv train dpo --init-from CHECKPOINT --data prefs.jsonl`): chat fine-tuning's
checkpoint, template and masks, with pairs of replies as data and DPO's loss (qkv.posttrain.losses).

The reference is the checkpoint as it was loaded: its log-probability of every reply is computed once, before the
first step, and kept in the run (reference_logps.safetensors), so a resumed run and `qkv eval` read the same
numbers and no second copy of the model is held. With LoRA the frozen base is that reference (adapters start at
zero), as TRL's adapters-off reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from qkv.config import option
from qkv.errors import QkvError
from qkv.io.devices import autocast_context, resolve_device, resolve_dtype
from qkv.io.files import file_sha256
from qkv.io.invocation import program
from qkv.io.progress import ProgressLine, batch_progress
from qkv.posttrain.losses import DPOLossKind, dpo_losses, token_logps
from qkv.posttrain.preferences import PairBatch, PairExamples, PairSplits, encode_pairs, read_preferences
from qkv.tasks.base import EvalOptions
from qkv.tasks.chat import ChatTask
from qkv.tasks.finetune import FinetunedRun, post_training, recipe_as
from qkv.tasks.lm import LMConfig
from qkv.training import Evaluation, RunConfig, TrainResult
from qkv.training.distributed import DistContext

REFERENCE_FILE = "reference_logps.safetensors"
# DPO moves a model far with few steps: TRL's rate for full fine-tuning, ten times it for LoRA's adapters.
SETTINGS = {"optim.lr": 1e-6, "schedule.warmup_steps": 5, "data.batch_size": 4, "eval.interval": 25}
LORA_LR = 1e-5


@dataclass(frozen=True, kw_only=True)
class DPOConfig(LMConfig):
    """A language model's settings with DPO's: β and the loss."""

    task: ClassVar[str] = "dpo"

    beta: float = option(0.1, "β: how far from the reference the policy may move (larger: closer)")
    dpo_loss: DPOLossKind = option("sigmoid", "sigmoid (DPO's) or ipo (IPO's squared loss, per-token log-ratios)")

    def check(self) -> None:
        """The language model's checks, and a positive β."""
        super().check()
        if self.beta <= 0:
            raise QkvError(f"--beta must be positive, got {self.beta}")


def recipe() -> DPOConfig:
    """The language model's recipe as a DPO config (`qkv train dpo --help` shows it; --init-from makes it tune)."""
    return recipe_as(DPOConfig)


def tuned(cfg: DPOConfig) -> DPOConfig:
    """A fine-tuning recipe made a DPO one: whole pairs up to the checkpoint's context, and DPO's rates."""
    return post_training(cfg, SETTINGS, LORA_LR)


def reply_logps(model: Callable[..., Tensor], examples: PairExamples, batch_size: int, device: torch.device,
                progress: Callable[[int, int], None] | None = None) -> Tensor:  # fmt: skip
    """Each sequence row's summed log-probability of its reply (2N,) float64, read batch_size pairs at a time."""
    plan = [list(range(s, min(s + batch_size, len(examples)))) for s in range(0, len(examples), batch_size)]
    out = torch.empty(2 * len(examples), dtype=torch.float64)
    with torch.no_grad():
        for done, pairs in enumerate(plan, 1):
            rows = examples.rows(pairs)
            x, y = examples.inputs(rows)
            out[rows] = token_logps(model(x.to(device)), y.to(device)).sum(-1).double().cpu()
            if progress is not None:
                progress(done, len(plan))
    return out


def _require_checkpoint_and_pairs(cfg: RunConfig[Any]) -> None:
    """A one-line error for a DPO run without a checkpoint or pairs."""
    if getattr(cfg, "init_from", None) is None or getattr(cfg, "source", None) is None:
        raise QkvError("qkv train dpo tunes a checkpoint on preference pairs: give --init-from CHECKPOINT and "
                       "--data prefs.jsonl")  # fmt: skip


class DPOTask(ChatTask):
    """Prefer the chosen reply over the rejected one, relative to the checkpoint."""

    name = "dpo"

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """<pairs file>-<checkpoint>[-lora]-dpo."""
        _require_checkpoint_and_pairs(cfg)
        return f"{super().run_name(cfg)}-dpo"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Read and check the pairs, load the checkpoint and its template, encode the pairs, and take the reference's
        log-probabilities: computed by the checkpoint for a new run, read back from the run on resume."""
        cfg = self.cfg
        _require_checkpoint_and_pairs(cfg)
        assert cfg.source is not None
        pairs = read_preferences(cfg.source)  # checked before the checkpoint is read: mistakes show at once
        self.load_checkpoint(run_dir, resume)
        assert self.tokenizer is not None
        self.pairs: PairSplits = encode_pairs(pairs, self.template, self.tokenizer, self.cfg.window)
        if resume:
            self._read_reference(run_dir)
        else:
            self._compute_reference()

    def _compute_reference(self) -> None:
        """The checkpoint's log-probability of every reply, on the run's device and under the run's mixed precision
        (so that step 1's log-ratio is 0, as TRL's is), with progress on a long read."""
        assert self.base is not None
        device = resolve_device(self.cfg.system.device)
        model = self.base.model.to(device).eval()
        line = ProgressLine()
        for part, examples in (("training", self.pairs.train), ("validation", self.pairs.val)):
            show = batch_progress(line, f"reference log-probabilities of the {part} pairs")
            with autocast_context(device, resolve_dtype(self.cfg.system.dtype, device)):
                examples.reference = reply_logps(model, examples, self.cfg.data.batch_size, device, show)
        line.close_if_drawn()
        model.cpu()

    def _read_reference(self, run_dir: Path) -> None:
        """A resumed run's reference log-probabilities, which must match its pairs."""
        stored = load_file(run_dir / REFERENCE_FILE)
        for part, examples in (("train", self.pairs.train), ("val", self.pairs.val)):
            if stored[part].numel() != 2 * len(examples):
                raise QkvError(f"{self.cfg.source} no longer gives the pairs {run_dir} was trained on; resume with "
                               "the same --data file")  # fmt: skip
            examples.reference = stored[part]

    @property
    def partial_evaluation(self) -> bool:
        """Every evaluation reads all the validation pairs."""
        return False

    def describe(self) -> str:
        """Pairs, tokens and how many were too long."""
        p = self.pairs
        dropped = f"; {p.dropped} longer than {self.cfg.block_size} tokens dropped" if p.dropped else ""
        cfg = cast(DPOConfig, self.cfg)
        return (f"{len(p.train):,} train / {len(p.val):,} val preference pairs ({p.train.tokens():,} / "
                f"{p.val.tokens():,} tokens), {cfg.dpo_loss} loss, β {cfg.beta:g}{dropped}")  # fmt: skip

    def data_summary(self) -> dict[str, Any] | None:
        """The preference file read, its sha256, and what was kept of it."""
        assert self.cfg.source is not None
        p = self.pairs
        return {"preferences": self.cfg.source, "sha256": file_sha256(Path(self.cfg.source)),
                "train_pairs": len(p.train), "val_pairs": len(p.val), "dropped": p.dropped}  # fmt: skip

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Tensor:
        """`budget` training pairs drawn at random."""
        return torch.randint(len(self.pairs.train), (budget,), generator=generator, device=generator.device)

    def collate(self, examples: Any, device: torch.device) -> PairBatch:  # type: ignore[override]
        """The pairs drawn: chosen rows then rejected rows, padded to the longest, with their reference numbers."""
        return self.pairs.train.batch(examples.tolist(), device)

    def logits(self, model: Callable[..., Any], batch: PairBatch) -> Tensor:  # type: ignore[override]
        """Next-token logits of every row (2B, T, V)."""
        return cast(Tensor, model(batch.x))

    def criterion(self, logits: Tensor, batch: PairBatch) -> Tensor:  # type: ignore[override]
        """The mean DPO loss over the batch's pairs."""
        cfg = cast(DPOConfig, self.cfg)
        losses, _ = dpo_losses(token_logps(logits, batch.y).sum(-1), batch.reference, batch.lengths, cfg.beta,
                               cfg.dpo_loss)  # fmt: skip
        return losses.mean()

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """The DPO loss over the validation pairs, how often the chosen reply's reward is the higher, and the mean
        reward margin."""
        with ev.autocast():
            return preference_measures(ev.forward, self.pairs.val, cast(DPOConfig, self.cfg), ev.ctx.device, ev.ctx)

    def save(self, run_dir: Path) -> None:
        """The tokenizer, the chat template and the reference's log-probabilities."""
        super().save(run_dir)
        assert self.pairs.train.reference is not None and self.pairs.val.reference is not None
        save_file({"train": self.pairs.train.reference, "val": self.pairs.val.reference}, run_dir / REFERENCE_FILE)

    def summary(self, result: TrainResult) -> str:
        """The final validation measures and what to try next."""
        f = result.final
        q = program()
        return "\n".join([
            f"\nvalidation DPO loss {f['val_loss']:.4f}, chosen preferred {f['val_accuracy']:.1%} of "
            f"{len(self.pairs.val)} held-out pairs, mean reward margin {f['val_margin']:+.4f} after {result.step} "
            f"steps, {result.took()} — run saved in {result.run_dir}",
            f"more: {q} chat {result.run_dir}  |  {q} eval {result.run_dir}  |  {q} serve {result.run_dir}"])


def preference_measures(model: Callable[..., Tensor], val: PairExamples, cfg: DPOConfig, device: torch.device,
                        ctx: DistContext | None = None) -> dict[str, float]:  # fmt: skip
    """val_loss (the mean DPO loss), val_accuracy (pairs whose chosen reward is the higher) and val_margin (the mean
    reward difference) over the pairs; with several processes rank r reads batches r, r + N, … and sums are reduced."""
    size = cfg.data.batch_size
    plan = [list(range(s, min(s + size, len(val)))) for s in range(0, len(val), size)]
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None and ctx.enabled else (1, 0)
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, wins, margin, pairs
    with torch.no_grad():
        for i in range(math.ceil(len(plan) / world)):
            index = rank + i * world  # a rank without a batch left re-runs the first (FSDP's collectives)
            batch = val.batch(plan[index if index < len(plan) else 0], device)
            losses, rewards = dpo_losses(token_logps(model(batch.x), batch.y).sum(-1), batch.reference,
                                         batch.lengths, cfg.beta, cfg.dpo_loss)  # fmt: skip
            chosen, rejected = rewards.chunk(2)
            if index < len(plan):
                n = losses.new_tensor(len(losses))
                counted = [losses.sum(), (chosen > rejected).sum(), (chosen - rejected).sum(), n]
                sums += torch.stack([c.double() for c in counted])
    if world > 1:
        dist.all_reduce(sums)
    loss, wins, margin, n = sums.tolist()
    return {"val_loss": loss / n, "val_accuracy": wins / n, "val_margin": margin / n}


class DPORun(FinetunedRun):
    """A DPO run: `qkv eval` measures its held-out pairs against the stored reference."""

    config_class: ClassVar[type[RunConfig[Any]]] = DPOConfig

    def evaluate(self, options: EvalOptions) -> list[str]:
        """The validation DPO loss, preference accuracy and reward margin."""
        options.refuse_beam_options("dpo")
        cfg = cast(DPOConfig, self.config)
        tokenizer = self.require_tokenizer()
        from qkv.chat import ChatTemplate
        from qkv.chat.template import TEMPLATE_FILE

        assert cfg.source is not None and cfg.block_size is not None
        template = ChatTemplate.of((self.directory / TEMPLATE_FILE).read_text(encoding="utf-8"), tokenizer)
        val = encode_pairs(read_preferences(cfg.source), template, tokenizer, cfg.block_size).val
        val.reference = load_file(self.directory / REFERENCE_FILE)["val"]
        if val.reference.numel() != 2 * len(val):
            raise QkvError(f"{cfg.source} no longer gives the pairs {self.directory} was trained on; restore it")
        m = preference_measures(cast(nn.Module, self.model), val, dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, batch_size=options.batch_size)), self.device)  # fmt: skip
        return [f"val DPO loss {m['val_loss']:.4f}  chosen preferred {m['val_accuracy']:.1%}  mean reward margin "
                f"{m['val_margin']:+.4f}  ({len(val)} held-out pairs, {self.checkpoint} weights)"]  # fmt: skip
