"""The training loop: one loop for every task (qkv.tasks), on one process or many.

A task says what differs (its data, model, batches, loss, evaluation, best checkpoint and final
report: qkv.training.task). This loop owns everything else:
- the optimiser (AdamW, or Muon for the blocks' matrices: qkv.training.optim) and the learning-rate schedule;
- gradient accumulation, with the loss normalised by the target positions of the whole step, over
  every micro-batch and every process, so that 2 micro-batches of B train exactly like one batch of 2B;
- the autocast dtype, torch.compile, and DDP/FSDP under torchrun (qkv.training.distributed);
- the time budget and Ctrl-C (finish the step, save, stop);
- evaluation and checkpoints every eval_interval steps, and exact, SIGKILL-safe resume;
- metrics.jsonl, loss.png, the progress bar, and hooks that benchmarks time steps with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qkv.errors import QkvError
from qkv.io.devices import (
    autocast_context,
    cpu_threads,
    keep_freed_memory,
    map_first_allocations,
    matmul_precision,
    out_of_memory_advice,
    resolve_device,
    resolve_dtype,
)
from qkv.io.progress import batch_progress
from qkv.io.run_dir import (
    BEST_FILE,
    LAST_FILE,
    PLOT_FILE,
    new_run_refusal,
    read_metrics,
    read_run_config,
    write_metrics,
    write_run_config,
)
from qkv.models import config_of, model_type_of
from qkv.training import distributed
from qkv.training.checkpoint import PendingSave, has_checkpoint, load_checkpoint, save_checkpoint
from qkv.training.config import RunConfig
from qkv.training.hooks import Hooks, StepInfo
from qkv.training.optim import apply_settings, group_settings, make_optimizer
from qkv.training.parallelize import prepare
from qkv.training.plots import plot_losses
from qkv.training.progress import Progress
from qkv.training.schedule import LRSchedule
from qkv.training.signals import deferred_interrupt
from qkv.training.state import RunState
from qkv.training.task import Batch, Evaluation, Task, TrainResult, split

PLOT_EVERY_S = 30.0  # loss.png is redrawn at most this often: a short run evaluates often, and drawing is not free


MEMORY_ADVICE = ("lower --batch-size (raising --grad-accum keeps the examples per step) or the sequence length, or "
                 "add --activation-checkpointing (a checkpoint the run saved is kept)")


def default_run_dir(task: type[Task], cfg: RunConfig[Any]) -> Path:
    """runs/<the task's run name>-<date>-<time>."""
    return Path("runs") / f"{task.run_name(cfg)}-{datetime.now():%Y%m%d-%H%M%S}"


def fit(task: type[Task], cfg: RunConfig[Any], verbose: bool = True, hooks: Hooks | None = None) -> TrainResult:
    """Train `task` as `cfg` says, on this process (and its peers under torchrun); returns the result.

    A resumed run's cfg is its stored config with the settings given on resume over it (qkv.tasks.resumed).
    """
    began = time.monotonic()
    stored = stored_run(task, cfg) if cfg.checkpoint.resume else None  # the config.json of the run to continue
    if stored is not None and type(cfg).from_stored(stored).model != cfg.model:
        raise QkvError(f"this config's model is not the one the run in {cfg.checkpoint.out_dir} trains; resume it "
                       "with qkv.train(task=…, resume=True, out_dir=…, settings to change), or from its own config "
                       "(RunConfig.from_stored)")  # fmt: skip
    system = cfg.system
    with distributed.process_group(resolve_device(system.device), system.strategy, system.dist_timeout) as ctx:
        if ctx.device.type == "cpu":
            keep_freed_memory()
        out_dir = cfg.checkpoint.out_dir
        run_dir = Path(out_dir) if out_dir else Path(distributed.agree(str(default_run_dir(task, cfg)), ctx))
        refusal = new_run_refusal(run_dir) if stored is None and ctx.rank == 0 else ""
        if refusal := distributed.agree(refusal, ctx):  # decided once: rank 0 may start writing the run first
            raise QkvError(refusal)
        cfg = cfg.override({"system.dtype": resolve_dtype(system.dtype, ctx.device)})  # the run says what it used
        with cpu_threads(system.cpu_threads, ctx.device), matmul_precision(ctx.device, cfg.system.dtype), \
                out_of_memory_advice(ctx.device, MEMORY_ADVICE):  # fmt: skip
            result = _Trainer(task(cfg), run_dir, ctx, verbose, hooks or Hooks(), stored).run()
    return dataclasses.replace(result, started=began)


def stored_run(task: type[Task], cfg: RunConfig[Any]) -> dict[str, Any]:
    """The config.json of the run that cfg resumes, which must be a run of this task."""
    out_dir = cfg.checkpoint.out_dir
    if not out_dir:
        raise QkvError("--resume needs --out-dir: the run directory to continue")
    stored = read_run_config(Path(out_dir))
    if stored["task"] != task.name:
        raise QkvError(f"{out_dir} holds a {stored['task']} run; continue it with `qkv train {stored['task']} "
                       f"--resume --out-dir {out_dir}`")  # fmt: skip
    return stored


def _mean(losses: list[torch.Tensor]) -> float:
    """The mean of step losses held on the device, summed as Python floats (one wait for the device, here)."""
    return sum(float(loss) for loss in losses) / len(losses)


class _Trainer:
    """One training run on this process: the model, its optimiser and the loop's state."""

    def __init__(self, task: Task, run_dir: Path, ctx: distributed.DistContext, verbose: bool, hooks: Hooks,
                 stored: dict[str, Any] | None) -> None:  # fmt: skip
        self.task, self.run_dir, self.ctx, self.hooks = task, run_dir, ctx, hooks
        self.stored = stored  # a resumed run's config.json
        seed, resume = task.cfg.system.seed, stored is not None
        torch.manual_seed(seed)  # the same seed on every rank: the same initial weights
        random.seed(seed)  # and Python's and NumPy's generators, which a checkpoint saves, for hooks that draw
        np.random.seed(seed % 2**32)
        task.setup(run_dir, resume)
        self.cfg = cfg = task.cfg  # as the task resolved it (a chat run's block size comes from its checkpoint)
        prepared = prepare(task, cfg, ctx, hooks.on_model)
        self.model, self.train_model, self.loss_of, self.frozen = (prepared.model, prepared.train_model,
                                                                   prepared.loss_of, prepared.frozen)  # fmt: skip
        self.pending: PendingSave | None = None  # a checkpoint being written in the background
        self.optimizer = make_optimizer(self.model, cfg.optim)  # after wrapping: FSDP replaces the parameters
        schedule = cfg.schedule
        self.schedule = LRSchedule(cfg.optim.lr, min(schedule.warmup_steps, schedule.max_steps), schedule.max_steps,
                                   cfg.final_lr, schedule.decay)  # fmt: skip
        self.data_gen = torch.Generator().manual_seed(seed)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.system.dtype == "float16")
        self.state = RunState(global_batch=cfg.data.batch_size * ctx.world_size)  # per micro-batch, all ranks
        if hooks.evaluate:
            run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self._restore()
        if ctx.is_main and hooks.evaluate:
            self._write_config()
        distributed.seed_dropout(seed, self.state.step, ctx)
        self.metrics = read_metrics(run_dir, self.state.step)
        self.progress = Progress(schedule.max_steps, enabled=verbose and ctx.is_main)  # rank 0 speaks for the run
        self.start = time.monotonic()
        self.last_plot = self.start  # a short run draws loss.png once, at its end

    def _write_config(self) -> None:
        """config.json (and the tokenizer) for a new run; for a resumed run, only if its settings changed."""
        settings = self.cfg.override({"checkpoint.resume": False}).training_dict()
        data = self.task.data_summary()
        if self.stored is not None:
            stored = self.stored["training"]
            settings["checkpoint"]["out_dir"] = (stored.get("checkpoint") or {}).get("out_dir")
            if {**stored, "checkpoint": {**stored.get("checkpoint", {}), "resume": False}} == settings and \
                    self.stored.get("data") == data:  # fmt: skip
                return
        else:
            self.task.save(self.run_dir)
        write_run_config(self.run_dir, self.task.name, model_type_of(self.model), config_of(self.model).to_dict(),
                         settings, self.task.tokenizer_summary(), data, self.task.base_summary())  # fmt: skip

    def _restore(self) -> None:
        """Load the last checkpoint: weights, optimiser, RNGs, the data generator and the counters."""
        settings = group_settings(self.optimizer)  # the stored param groups would bring back the old ones
        extra = load_checkpoint(self.run_dir, self.model, self.optimizer, {"data": self.data_gen}, self.ctx,
                                self.frozen)  # fmt: skip
        apply_settings(self.optimizer, settings)  # settings given on resume replace the stored ones
        self.state = RunState.of(extra, self.cfg.data.batch_size)

    def elapsed(self) -> float:
        """Wall-clock seconds of training, across resumes."""
        return self.state.elapsed_before + time.monotonic() - self.start

    def _announce(self) -> None:
        """The run's first line: parameters, data, device, precision and processes; and a note on its schedule."""
        n_params = sum(p.numel() for p in self.model.parameters())
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        counted = f"{n_params / 1e6:.2f} M parameters" + (f" ({trained / 1e6:.2f} M train)" if self.frozen else "")
        layout = ""
        if self.ctx.enabled:
            layout = f", {self.ctx.world_size} processes ({self.ctx.strategy}), global batch {self.state.global_batch}"
        described = self.task.describe()
        data = f"{described}, " if described else ""
        tf32 = ", TF32 matmuls" if torch.backends.cuda.matmul.allow_tf32 and self.ctx.device.type == "cuda" else ""
        dtype = self.cfg.system.dtype
        precision = "" if dtype == "float32" and not tf32 else f" ({dtype} autocast{tf32})"
        self.progress.log(f"qkv train {self.task.name}: {counted}, {data}device "
                          f"{self.ctx.device}{precision}{layout}, run dir {self.run_dir}")  # fmt: skip
        if note := self.cfg.schedule.warm_up_note(self.cfg.optim.lr):
            self.progress.log(note)

    def run(self) -> TrainResult:
        """Train until max_steps, the time budget or Ctrl-C; evaluate and checkpoint on the way."""
        self._announce()
        self.model.train()
        first_step, first_tokens = self.state.step, self.state.tokens_seen
        if self.state.step >= self.cfg.schedule.max_steps:
            self.progress.log(f"the run is already at step {self.state.step} of --max-steps "
                              f"{self.cfg.schedule.max_steps}: "
                              "nothing to train (raise --max-steps to continue it)")  # fmt: skip
        losses: list[torch.Tensor] = []  # each step's mean loss, on the device: read when shown or averaged
        interrupted = False
        dynamo = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True) if self.cfg.system.compile else None
        with deferred_interrupt() as interrupt_requested, dynamo or contextlib.nullcontext():
            while self.state.step < self.cfg.schedule.max_steps:
                distributed.crash_for_test(self.state.step, self.ctx)
                # Checked between steps, so the checkpoint holds whole steps only; all ranks stop at the same one.
                if distributed.any_rank(interrupt_requested(), self.ctx):
                    interrupted = True
                    break
                # FSDP creates its per-layer buffers in the first step: mapped, they fragment no heap (CPU only).
                first = self.state.step == first_step and self.ctx.sharded and self.ctx.device.type == "cpu"
                with map_first_allocations(first):
                    losses.append(self._timed_step())
                if self.pending is not None and self.pending.done():  # a background save finished: commit it
                    self._finish_save()
                out_of_time = self.cfg.schedule.max_time is not None and distributed.any_rank(
                    self.elapsed() >= self.cfg.schedule.max_time, self.ctx
                )
                self._show_progress(losses, first_step, first_tokens)
                step = self.state.step
                last = step == self.cfg.schedule.max_steps or out_of_time
                if step % self.cfg.eval.interval == 0 or last:
                    self._evaluate_and_checkpoint(losses, full=last)
                    losses = []
                if out_of_time:
                    self.progress.log(f"time budget of {self.cfg.schedule.max_time:g} s reached at step {step}")
                    break
            if interrupted:
                self._stop_cleanly(losses)
            self._finish_save()
            self.progress.close()
            return self._result(interrupted)

    def _timed_step(self) -> torch.Tensor:
        """One optimiser step, reported to the on_step hook; returns its mean training loss (on the device)."""
        began, tokens_before = time.perf_counter(), self.state.tokens_seen
        loss = self._step()
        if self.hooks.on_step is not None:
            seconds = time.perf_counter() - began
            self.hooks.on_step(StepInfo(self.state.step, seconds, self.state.tokens_seen - tokens_before))
        return loss

    def _step(self) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, then one optimiser update; returns the mean loss, a
        0-d tensor on the device (reading it would make the host wait for the device at every step)."""
        cfg, ctx = self.cfg, self.ctx
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(self.state.step)
        batches = self._micro_batches()
        local = sum(b.n_targets for b in batches)
        total, tokens = distributed.sum_over_ranks([local, sum(b.n_tokens for b in batches)], ctx)
        # Summed on the device in float64, as a Python float would be (MPS has no float64).
        precise = torch.float32 if ctx.device.type == "mps" else torch.float64
        loss_sum = torch.zeros((), dtype=precise, device=ctx.device)
        for i, batch in enumerate(batches):
            # Gradients are averaged across ranks once per step, in the last micro-batch's backward.
            with distributed.gradient_sync(self.train_model, i == len(batches) - 1):
                with autocast_context(ctx.device, cfg.system.dtype):
                    loss = self.loss_of(batch)
                # Each micro-batch counts by its share of the step's targets, all ranks together (DDP then
                # averages over ranks): the mean over every target of the step, however the batch was cut.
                self.scaler.scale(loss * (batch.n_targets * ctx.world_size / total)).backward()
            loss_sum += loss.detach().to(loss_sum.dtype) * batch.n_targets
        if cfg.optim.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += tokens
        self.task.after_step(self.state.step, ctx.is_main)
        return loss_sum / local

    def _micro_batches(self) -> list[Batch]:
        """This rank's micro-batches of the step: slices micro × world + rank of one global draw."""
        world, accum = self.ctx.world_size, self.cfg.data.grad_accum
        examples = self.task.draw(self.data_gen, self.state.global_batch * accum, world * accum)
        pieces = split(examples, world * accum)
        return [self.task.collate(pieces[m * world + self.ctx.rank], self.ctx.device) for m in range(accum)]

    def _show_progress(self, losses: list[torch.Tensor], first_step: int, first_tokens: int) -> None:
        """Redraw the progress bar: loss, tokens/s and the time left. The loss is read only when the bar is drawn,
        and on a GPU it is the step before the newest: reading that one never leaves the GPU idle while the host
        prepares the next step, as waiting for the newest would."""
        final = self.state.step >= self.cfg.schedule.max_steps
        if not self.progress.due(final):
            return
        loss = losses[-2] if self.ctx.device.type == "cuda" and len(losses) > 1 and not final else losses[-1]
        run_time = time.monotonic() - self.start  # this session only: resumed steps were timed before
        steps = self.state.step - first_step
        tokens_per_s = (self.state.tokens_seen - first_tokens) / max(run_time, 1e-9)
        eta = (self.cfg.schedule.max_steps - self.state.step) * run_time / steps
        self.progress.update_step(self.state.step, float(loss), tokens_per_s, eta, self.task.progress_note())

    def _evaluate(self, full: bool) -> dict[str, float]:
        """The task's evaluation with dropout off, then back to training mode."""
        self.model.eval()
        with torch.no_grad():
            show = batch_progress(self.progress, "last evaluation" if full else "evaluating")
            ev = Evaluation(self.model, self.train_model, self.ctx, self.cfg.system.dtype, full,
                            self.state.tokens_seen, show)  # fmt: skip
            results = self.task.evaluate(ev)
            self.progress.clear()
        self.model.train()
        return results

    def _evaluate_and_checkpoint(self, losses: list[torch.Tensor], full: bool) -> None:
        """Evaluate, log, keep the best weights, save everything needed to resume; timed apart from training.

        losses: the steps' losses since the last evaluation. full: the run's last evaluation, over the whole split
        even where periodic ones read a part of it.
        """
        if not self.hooks.evaluate:
            return
        began, train_s = time.monotonic(), self.elapsed() - self.state.overhead_s
        full = full or not self.task.partial_evaluation
        results = self._evaluate(full)
        train_loss = distributed.mean_over_ranks(_mean(losses), self.ctx)
        row = {"step": self.state.step, "tokens_seen": self.state.tokens_seen, "elapsed_s": round(self.elapsed(), 3),
               "train_s": round(train_s, 3), "train_loss": train_loss, **results, "full_eval": full,
               "lr": self.schedule.lr_at(max(0, self.state.step - 1))}  # fmt: skip
        self.metrics.append(row)
        score, best = results[self.task.best_metric], self.state.best
        improved = best is None or (score > best if self.task.higher_is_better else score < best)
        if improved:
            self.state.best = score
        self._write_checkpoint(improved, train_s)  # every rank writes its part
        if self.ctx.is_main:  # the checkpoint, then its log line (a line seen is a step saved), then the plot
            shown = "  ".join(f"{'val' if k == 'val_loss' else k.replace('_', ' ')} {v:.4f}"
                              for k, v in results.items())  # fmt: skip
            part = "" if full else " (part of the split)"
            self.progress.log(f"step {self.state.step:>6}  train {train_loss:.4f}  {shown}{part}  lr {row['lr']:.2e}")
            if full or self._plot_due():
                plot_losses(self.metrics, self.run_dir / PLOT_FILE,
                            title=f"qkv train {self.task.name} — {self.run_dir.name}")  # fmt: skip
        self.state.overhead_s += time.monotonic() - began

    def _plot_due(self) -> bool:
        """Whether loss.png is due again: redrawn at most every PLOT_EVERY_S seconds, and after the last evaluation."""
        if time.monotonic() - self.last_plot < PLOT_EVERY_S:
            return False
        self.last_plot = time.monotonic()
        return True

    def _write_checkpoint(self, improved: bool, train_s: float) -> None:
        """metrics.jsonl, the weights' exports (last, and best if they improved) and the sharded training state."""
        if self.ctx.is_main:
            write_metrics(self.run_dir, self.metrics)
        exports = [self.run_dir / LAST_FILE] + ([self.run_dir / BEST_FILE] if improved else [])
        distributed.export_weights(self.model, exports, self.ctx, skip=self.frozen)
        self._finish_save()  # one save at a time: the previous background save is committed first
        extra = self.state.extra(self.elapsed(), train_s)
        self.pending = save_checkpoint(self.run_dir, self.model, self.optimizer, extra, {"data": self.data_gen},
                                       self.ctx, frozen=bool(self.frozen),
                                       asynchronous=self.cfg.checkpoint.async_save)  # fmt: skip
        if not self.cfg.checkpoint.async_save:
            self._finish_save()

    def _finish_save(self) -> None:
        """Wait for the checkpoint being written, if any, and commit it."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def _stop_cleanly(self, losses: list[torch.Tensor]) -> None:
        """After Ctrl-C: checkpoint the steps taken since the last one, and say how to continue."""
        self.progress.close()
        if losses:
            self._evaluate_and_checkpoint(losses, full=True)
        self._finish_save()
        if has_checkpoint(self.run_dir):
            hint = f"continue with --resume --out-dir {self.run_dir}"
            self.progress.log(f"interrupted at step {self.state.step}: checkpoint saved; {hint}")
        else:
            step = self.state.step
            self.progress.log(f"interrupted at step {step}, before the first checkpoint: nothing to --resume")

    def _result(self, interrupted: bool) -> TrainResult:
        """The final evaluation (over whole splits), and where the run lives."""
        final: dict[str, float] = {}
        if self.hooks.evaluate:
            last = self.metrics[-1] if self.metrics else None
            if last is None or last["step"] != self.state.step or not last.get("full_eval", True):
                final = self._evaluate(full=True)
            else:
                final = {k: v for k, v in last.items() if k.startswith("val_")}
        return TrainResult(self.run_dir, self.task.name, self.state.step, final, self.state.best, self.elapsed(),
                           interrupted, self.metrics, self.task)  # fmt: skip
