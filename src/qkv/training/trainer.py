"""The training loop for DecoderLM: AdamW, warmup + cosine, clipping, accumulation, checkpoints.

Everything that makes a step depend on the past is in the checkpoint (weights, optimiser
moments, the data sampler's generator, the dropout RNG, counters), so a resumed run takes
exactly the steps an uninterrupted one would have taken. Under torchrun (or --nproc) the same loop
runs on every rank; training/distributed.py holds everything that differs (see its docstring).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkv.config import DecoderLMConfig
from qkv.data import random_batch
from qkv.errors import QkvError
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.training import distributed
from qkv.training.checkpoint import (
    STATE_FILE,
    atomic_save_safetensors,
    load_training_state,
    save_training_state,
)
from qkv.training.common import deferred_interrupt as _deferred_interrupt
from qkv.training.common import make_optimizer
from qkv.training.common import read_metrics as _read_metrics
from qkv.training.common import write_metrics as _write_metrics
from qkv.training.config import TrainConfig
from qkv.training.dataset import TextData, prepare_text_data
from qkv.training.plots import plot_losses
from qkv.training.progress import Progress
from qkv.training.run import BEST_FILE, LAST_FILE, check_weights, read_run_config, write_run_config
from qkv.training.schedule import LRSchedule


@dataclass
class TrainResult:
    """What a run achieved and where it lives."""

    run_dir: Path
    step: int
    val_loss: float  # over the whole validation split (the `qkv eval` protocol)
    best_val_loss: float
    elapsed_s: float
    interrupted: bool = False
    metrics: list[dict[str, Any]] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda if present, else cpu; anything else must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise QkvError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise QkvError("device cuda requested but no CUDA GPU is available; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise QkvError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise QkvError("device mps requested but Apple's MPS backend is not available here; use --device cpu")
    elif device.type != "cpu":
        raise QkvError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return device


def autocast_context(device: torch.device, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for bf16/fp16 (weights stay fp32); nothing for fp32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def default_run_dir(cfg: TrainConfig) -> Path:
    """runs/<data name>-<tokenizer>-<timestamp>."""
    name = "shakespeare" if cfg.data is None else Path(cfg.data).stem
    return Path("runs") / f"{name}-{cfg.tokenizer}-{datetime.now():%Y%m%d-%H%M%S}"


def _batches(data: TextData, block_size: int, global_batch: int, rows: slice, gen: torch.Generator,
             device: torch.device) -> Iterator[Any]:  # fmt: skip
    """Endless random training windows from the run's own generator: this rank's rows of each global batch."""
    while True:
        yield random_batch(data.train_ids, block_size, global_batch, gen, device, rows)


def train(cfg: TrainConfig | None = None, verbose: bool = True, **overrides: Any) -> TrainResult:
    """Train a DecoderLM as `cfg` (or TrainConfig(**overrides)) says; returns the result."""
    cfg = cfg if cfg is not None else TrainConfig(**overrides)
    if not cfg.out_dir and distributed.env_world_size() > 1:
        raise QkvError("several processes need one run directory: pass --out-dir (each would pick its own default)")
    run_dir = Path(cfg.out_dir) if cfg.out_dir else default_run_dir(cfg)
    if cfg.resume:
        stored = read_run_config(run_dir)
        # How to run (budget, device, process layout) may change on resume; what to train may not.
        # A launch setting left at its default keeps the stored value: `qkv.train(resume=True, out_dir=D)`
        # must not silently stretch a 500-step cosine schedule to the default 2000 steps.
        names = ("max_time", "device", "max_steps", "strategy", "dist_timeout")
        defaults = TrainConfig()
        launch = {name: getattr(cfg, name) for name in names if getattr(cfg, name) != getattr(defaults, name)}
        cfg = TrainConfig.from_dict({**stored["training"], **launch, "resume": True, "out_dir": str(run_dir)})
        tokenizer = load_tokenizer(run_dir)
    else:
        if (run_dir / STATE_FILE).exists() or (run_dir / BEST_FILE).exists():
            raise QkvError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
        tokenizer = None
    with distributed.process_group(resolve_device(cfg.device), cfg.strategy, cfg.dist_timeout) as ctx:
        return _train(cfg, run_dir, tokenizer, ctx, verbose)


def _train(
    cfg: TrainConfig, run_dir: Path, tokenizer: Tokenizer | None, ctx: distributed.DistContext, verbose: bool
) -> TrainResult:
    """The training loop proper, on one rank (of one or many)."""
    device = ctx.device
    torch.manual_seed(cfg.seed)
    data = prepare_text_data(cfg.data, cfg.tokenizer, cfg.bpe_vocab_size, tokenizer)
    if cfg.block_size + 1 > len(data.train_ids):
        raise QkvError(
            f"block size {cfg.block_size} is larger than the training data ({len(data.train_ids)} tokens); "
            "use a smaller --block-size or more text"
        )
    model_fields = {"vocab_size": data.tokenizer.vocab_size, "max_positions": cfg.block_size, **cfg.model}
    try:
        model_cfg = DecoderLMConfig(**model_fields)
    except TypeError as e:  # a value of the wrong type, e.g. --model dropout=abc
        raise QkvError(f"invalid model setting in {cfg.model}: {e}") from None
    if model_cfg.max_positions < cfg.block_size:
        raise QkvError(
            f"model max_positions={model_cfg.max_positions} is smaller than the block size {cfg.block_size}; "
            "drop --model max_positions or lower --block-size"
        )
    model = DecoderLM(model_cfg).to(device)  # the same seed on every rank: the same initial weights
    train_model = distributed.wrap_model(model, ctx)  # DDP wrapper, or `model` itself sharded by FSDP
    optimizer = make_optimizer(model, cfg)  # after wrapping: FSDP replaces the parameters
    schedule = LRSchedule(cfg.lr, min(cfg.warmup_steps, cfg.max_steps), cfg.max_steps, cfg.final_lr, cfg.schedule)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    step, tokens_seen, elapsed_before, best_val = 0, 0, 0.0, math.inf
    overhead_s = 0.0  # seconds spent evaluating and checkpointing, across resumes
    global_batch = cfg.batch_size * ctx.world_size  # sequences per micro-batch, all ranks together
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        consolidated = distributed.ConsolidatedOptimizer(train_model, optimizer, ctx)
        state, extra = load_training_state(run_dir, consolidated, {"data": data_gen})
        check_weights(model, state, run_dir / LAST_FILE)
        distributed.load_full_model_state(train_model, state, ctx)
        step, tokens_seen = extra["step"], extra["tokens_seen"]
        elapsed_before, best_val = extra["elapsed_s"], extra["best_val_loss"]
        overhead_s = elapsed_before - extra.get("train_s", elapsed_before)  # checkpoints before train_s: none
        # A resumed run keeps its global batch whatever the process count, so it takes the same steps.
        global_batch = extra.get("global_batch_size", cfg.batch_size)
    elif ctx.is_main:
        write_run_config(run_dir, model_cfg, cfg, data.tokenizer)
    rows = distributed.rows_per_rank(global_batch, ctx)
    distributed.seed_dropout(cfg.seed, step, ctx)
    metrics = _read_metrics(run_dir, step)
    step_model = torch.compile(train_model) if cfg.compile else train_model
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "float16")
    progress = Progress(cfg.max_steps, enabled=verbose and ctx.is_main)  # rank 0 speaks for the run
    n_params = sum(p.numel() for p in model.parameters())
    layout = f", {ctx.world_size} processes ({ctx.strategy}), global batch {global_batch}" if ctx.enabled else ""
    progress.log(
        f"qkv train: {n_params / 1e6:.2f} M parameters, {len(data.train_ids):,} train / {len(data.val_ids):,} val "
        f"tokens, vocab {data.tokenizer.vocab_size}, device {device}{layout}, run dir {run_dir}"
    )

    def evaluate(max_tokens: int | None) -> float:
        """Validation loss with dropout off (batches shared out over ranks), then back to training mode."""
        train_model.eval()
        with autocast_context(device, cfg.dtype):
            loss = distributed.sharded_eval_loss(step_model, data.val_ids, cfg.block_size, cfg.batch_size, ctx,
                                                 max_tokens)  # fmt: skip
        train_model.train()
        return loss

    def evaluate_and_checkpoint(train_loss: float) -> None:
        """Evaluate, then checkpoint; the time both take is logged apart from training time (train_s)."""
        nonlocal overhead_s
        began, train_s = time.monotonic(), elapsed() - overhead_s
        checkpoint(evaluate(cfg.eval_tokens), train_loss, train_s)
        overhead_s += time.monotonic() - began

    def checkpoint(val_loss: float, train_loss: float, train_s: float) -> None:
        """Log metrics, keep the best weights, save everything needed to resume (files: rank 0 only)."""
        nonlocal best_val
        train_loss = distributed.mean_over_ranks(train_loss, ctx)
        model_state, optimizer_state = distributed.full_state(train_model, optimizer, ctx)  # collective
        metrics.append(
            {
                "step": step,
                "tokens_seen": tokens_seen,
                "elapsed_s": round(elapsed(), 3),  # wall-clock, evaluations and checkpoints included
                "train_s": round(train_s, 3),  # training steps only (the time-to-target benchmark reads it)
                "train_loss": train_loss,
                "val_loss": val_loss,
                "lr": schedule.lr_at(max(0, step - 1)),
            }
        )
        improved, best_val = val_loss < best_val, min(best_val, val_loss)
        if not ctx.is_main:
            return
        _write_metrics(run_dir, metrics)
        if improved:
            atomic_save_safetensors(run_dir / BEST_FILE, model_state)
        extra = {"step": step, "tokens_seen": tokens_seen, "elapsed_s": elapsed(), "train_s": train_s,
                 "best_val_loss": best_val, "global_batch_size": global_batch}  # fmt: skip
        save_training_state(run_dir, model_state=model_state, optimizer=optimizer_state, extra=extra,
                            generators={"data": data_gen})  # fmt: skip
        plot_losses(metrics, run_dir / "loss.png", title=f"qkv train — {run_dir.name}")
        progress.log(f"step {step:>6}  train {train_loss:.4f}  val {val_loss:.4f}  lr {metrics[-1]['lr']:.2e}")

    start = time.monotonic()

    def elapsed() -> float:
        """Wall-clock seconds of training, across resumes."""
        return elapsed_before + time.monotonic() - start

    batches = _batches(data, cfg.block_size, global_batch, rows, data_gen, device)
    first_step = step
    train_model.train()
    loss_sum, loss_count, interrupted = 0.0, 0, False
    last_loss = float("nan")
    with _deferred_interrupt() as interrupt_requested:
        while step < cfg.max_steps:
            distributed.crash_for_test(step, ctx)
            # Checked between steps, so the checkpoint holds whole steps only; all ranks stop at the same one.
            if distributed.any_rank(interrupt_requested(), ctx):
                interrupted = True
                break
            lr = schedule.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(cfg.grad_accum):
                x, y = next(batches)
                # Gradients are averaged across ranks once per step, in the last micro-batch's backward.
                with distributed.gradient_sync(train_model, micro == cfg.grad_accum - 1):
                    with autocast_context(device, cfg.dtype):
                        logits = step_model(x)  # (B, T, V)
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                    scaler.scale(loss / cfg.grad_accum).backward()
                loss_sum += float(loss.detach()) / cfg.grad_accum
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_count += 1
            tokens_seen += global_batch * cfg.block_size * cfg.grad_accum
            last_loss = loss_sum / loss_count
            run_time = time.monotonic() - start  # this session only: resumed steps were timed before
            out_of_time = cfg.max_time is not None and distributed.any_rank(elapsed() >= cfg.max_time, ctx)
            seconds_per_step = run_time / (step - first_step)
            tokens_per_s = global_batch * cfg.block_size * cfg.grad_accum / seconds_per_step
            progress.update(step, last_loss, tokens_per_s, (cfg.max_steps - step) * seconds_per_step)
            if step % cfg.eval_interval == 0 or step == cfg.max_steps or out_of_time:
                evaluate_and_checkpoint(last_loss)
                loss_sum, loss_count = 0.0, 0
            if out_of_time:
                progress.log(f"time budget of {cfg.max_time:g} s reached at step {step}")
                break
        if interrupted:
            progress.close()
            if loss_count:
                evaluate_and_checkpoint(loss_sum / loss_count)
            if (run_dir / STATE_FILE).is_file():
                hint = f"interrupted at step {step}: checkpoint saved; continue with --resume --out-dir {run_dir}"
                progress.log(hint)
            else:
                progress.log(f"interrupted at step {step}, before the first checkpoint: nothing to --resume")
    progress.close()
    final_val = metrics[-1]["val_loss"] if metrics and cfg.eval_tokens is None else evaluate(None)
    return TrainResult(run_dir, step, final_val, best_val, elapsed(), interrupted, metrics)
