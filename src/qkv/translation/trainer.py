"""The training loop for German → English translation with the encoder–decoder Transformer.

It shares the language model's pieces (optimiser, schedule, checkpoints, metrics log, progress bar,
loss plot, run directory) and adds what translation needs: a shared BPE vocabulary, length-bucketed
batches, label smoothing, and validation BLEU. Resume restores weights, optimiser, RNGs and the
batch sampler, so a resumed run takes the steps an uninterrupted one would have taken.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from qkv.config import TransformerConfig
from qkv.errors import QkvError
from qkv.models import Transformer
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.training.checkpoint import STATE_FILE, atomic_save_safetensors, load_training_state, save_training_state
from qkv.training.common import deferred_interrupt, make_optimizer, read_metrics, write_metrics
from qkv.training.plots import plot_losses
from qkv.training.progress import Progress
from qkv.training.run import BEST_FILE, load_weights, read_run_config
from qkv.training.schedule import LRSchedule
from qkv.training.trainer import resolve_device
from qkv.translation.batching import Seq2SeqBatch, Specials, length_buckets, make_batch
from qkv.translation.config import TranslateConfig
from qkv.translation.corpus import split_de_en
from qkv.translation.decoding import greedy_decode
from qkv.translation.metrics import corpus_bleu
from qkv.translation.run import specials_of, train_tokenizer, write_translation_config
from qkv.translation.step import evaluate_batches, train_step

Pairs = list[tuple[list[int], list[int]]]


@dataclass
class TranslateResult:
    """What a translation run achieved and where it lives."""

    run_dir: Path
    step: int
    val_loss: float
    val_bleu: float
    best_val_bleu: float
    elapsed_s: float
    interrupted: bool = False


def encode_pairs(tokenizer: Tokenizer, pairs: list[tuple[str, str]], max_len: int) -> Pairs:
    """Token ids of (german, english) pairs, each side cut to max_len − 1 tokens (room for <s> or </s>)."""
    return [(tokenizer.encode(de)[: max_len - 1], tokenizer.encode(en)[: max_len - 1]) for de, en in pairs]


def batches_of(pairs: Pairs, max_tokens: int, sp: Specials) -> list[Seq2SeqBatch]:
    """Length-bucketed batches of the pairs, every pair exactly once."""
    return [
        make_batch([pairs[i][0] for i in b], [pairs[i][1] for i in b], sp) for b in length_buckets(pairs, max_tokens)
    ]


def validation_bleu(model: Transformer, batches: list[Seq2SeqBatch], tokenizer: Tokenizer, sp: Specials) -> float:
    """Greedy BLEU over the validation batches (references decoded from the same tokens)."""
    model.eval()
    hyps, refs = [], []
    for batch in batches:
        hyps += [tokenizer.decode(ids).strip() for ids in greedy_decode(model, batch.src, sp)]
        refs += [
            tokenizer.decode([t for t in row if t not in (sp.pad, sp.eos)]).strip() for row in batch.tgt_out.tolist()
        ]
    model.train()
    return corpus_bleu(hyps, refs)


def _setup(cfg: TranslateConfig) -> tuple[TranslateConfig, Path, Tokenizer | None]:
    """The effective config (the stored one on --resume), the run directory, the stored tokenizer."""
    run_dir = Path(cfg.out_dir) if cfg.out_dir else Path("runs") / f"de-en-{datetime.now():%Y%m%d-%H%M%S}"
    if cfg.resume:
        stored = read_run_config(run_dir)
        if stored.get("model_type") != "transformer":
            raise QkvError(f"{run_dir} is not a translation run; resume it with `qkv train --resume`")
        budget = {"max_time": cfg.max_time, "device": cfg.device, "max_steps": cfg.max_steps}
        merged = {**stored["training"], **budget, "resume": True, "out_dir": str(run_dir)}
        return TranslateConfig.from_dict(merged), run_dir, load_tokenizer(run_dir)
    if (run_dir / STATE_FILE).exists() or (run_dir / BEST_FILE).exists():
        raise QkvError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out-dir")
    return cfg, run_dir, None


def train_translation(cfg: TranslateConfig, verbose: bool = True) -> TranslateResult:
    """Train German → English as `cfg` says; returns the result (the run directory holds everything)."""
    cfg, run_dir, tokenizer = _setup(cfg)
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(cfg.seed)
    splits = split_de_en()
    if tokenizer is None:  # the vocabulary sees the training split only, both languages
        tokenizer = train_tokenizer([s for pair in splits.train for s in pair], cfg.vocab_size)
    sp = specials_of(tokenizer)
    try:
        model_cfg = TransformerConfig(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
                                      share_embeddings=True, pad_id=sp.pad, **cfg.model)  # fmt: skip
    except TypeError as e:
        raise QkvError(f"invalid model setting in {cfg.model}: {e}") from None
    train_pairs = encode_pairs(tokenizer, splits.train, model_cfg.max_positions)
    train_buckets = length_buckets(train_pairs, cfg.batch_tokens)
    val_batches = [b.to(device) for b in batches_of(encode_pairs(tokenizer, splits.val, model_cfg.max_positions),
                                                   cfg.batch_tokens, sp)]  # fmt: skip
    model = Transformer(model_cfg).to(device)
    optimizer = make_optimizer(model, cfg)
    schedule = LRSchedule(cfg.lr, min(cfg.warmup_steps, cfg.max_steps), cfg.max_steps, cfg.min_lr, cfg.schedule)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    step, tokens_seen, elapsed_before, best_bleu = 0, 0, 0.0, -math.inf
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        state, extra = load_training_state(run_dir, optimizer, {"data": data_gen})
        load_weights(model, state, run_dir / "last.safetensors")
        step, tokens_seen, elapsed_before, best_bleu = (
            extra[k] for k in ("step", "tokens_seen", "elapsed_s", "best_val_bleu")
        )
    else:
        write_translation_config(run_dir, model_cfg, cfg, tokenizer)
    metrics = read_metrics(run_dir, step)
    progress = Progress(cfg.max_steps, enabled=verbose)
    n_params = sum(p.numel() for p in model.parameters())
    sizes = f"{len(train_pairs):,} train / {len(splits.val):,} val pairs, vocab {tokenizer.vocab_size}"
    progress.log(f"qkv train translate: {n_params / 1e6:.2f} M parameters, {sizes}, device {device}, run dir {run_dir}")
    start = time.monotonic()

    def elapsed() -> float:
        """Wall-clock seconds of training, across resumes."""
        return elapsed_before + time.monotonic() - start

    def checkpoint(train_loss: float) -> None:
        """Evaluate (loss and greedy BLEU), log, keep the best-BLEU weights, save everything to resume."""
        nonlocal best_bleu
        val_loss, bleu = evaluate_batches(model, val_batches), validation_bleu(model, val_batches, tokenizer, sp)
        row: dict[str, Any] = {"step": step, "tokens_seen": tokens_seen, "elapsed_s": round(elapsed(), 3),
                               "train_loss": train_loss, "val_loss": val_loss, "val_bleu": bleu,
                               "lr": schedule.lr_at(max(0, step - 1))}  # fmt: skip
        metrics.append(row)
        write_metrics(run_dir, metrics)
        if bleu > best_bleu:
            best_bleu = bleu
            atomic_save_safetensors(run_dir / BEST_FILE, model.state_dict())
        extra = {"step": step, "tokens_seen": tokens_seen, "elapsed_s": elapsed(), "best_val_bleu": best_bleu}
        save_training_state(run_dir, model_state=model.state_dict(), optimizer=optimizer, extra=extra,
                            generators={"data": data_gen})  # fmt: skip
        plot_losses(metrics, run_dir / "loss.png", title=f"qkv train translate — {run_dir.name}")
        progress.log(f"step {step:>6}  train {train_loss:.4f}  val {val_loss:.4f}  val BLEU {bleu:.2f}  "
                     f"lr {row['lr']:.2e}  {elapsed():.0f} s")  # fmt: skip

    first_step, loss_sum, loss_count, interrupted = step, 0.0, 0, False
    model.train()
    with deferred_interrupt() as interrupt_requested:
        while step < cfg.max_steps:
            if interrupt_requested():  # between steps, so the checkpoint holds whole steps only
                interrupted = True
                break
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr_at(step)
            bucket = train_buckets[int(torch.randint(len(train_buckets), (1,), generator=data_gen))]
            batch = make_batch([train_pairs[i][0] for i in bucket], [train_pairs[i][1] for i in bucket], sp).to(device)
            loss_sum += train_step(model, optimizer, batch, cfg.label_smoothing, cfg.grad_clip)
            step, loss_count, tokens_seen = step + 1, loss_count + 1, tokens_seen + batch.n_tokens
            out_of_time = cfg.max_time is not None and elapsed() >= cfg.max_time
            seconds_per_step = (time.monotonic() - start) / (step - first_step)
            progress.update(step, loss_sum / loss_count, tokens_seen / max(elapsed(), 1e-9),
                            (cfg.max_steps - step) * seconds_per_step)  # fmt: skip
            if step % cfg.eval_interval == 0 or step == cfg.max_steps or out_of_time:
                checkpoint(loss_sum / loss_count)
                loss_sum, loss_count = 0.0, 0
            if out_of_time:
                progress.log(f"time budget of {cfg.max_time:g} s reached at step {step}")
                break
        if interrupted and loss_count:
            progress.close()
            checkpoint(loss_sum / loss_count)
            progress.log(f"interrupted at step {step}: continue with --resume --out-dir {run_dir}")
    progress.close()
    last = metrics[-1] if metrics else {"val_loss": math.nan, "val_bleu": math.nan}
    return TranslateResult(run_dir, step, last["val_loss"], last["val_bleu"], best_bleu, elapsed(), interrupted)
