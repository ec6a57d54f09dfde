"""Supervised fine-tuning on conversations (`qkv train --init-from CHECKPOINT --data chat.jsonl`): the language
model's task, with a JSON Lines file of {"messages": […]} as its data.

Each conversation is rendered with the checkpoint's chat template (or --chat-template FILE) and tokenized whole;
the loss is the next-token cross-entropy over the assistant's tokens only (its replies and their end-of-turn
tokens, qkv.chat.data), averaged over all of them in the step. Everything else is the language model's: the
checkpoint, LoRA or full fine-tuning, the loop. The run keeps the template (chat_template.jinja) for `qkv chat`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qkv.chat import ChatSession, ChatTemplate, encode_splits, read_conversations, template_source
from qkv.chat.examples import IGNORE, ChatBatch, ChatExamples, ChatSplits
from qkv.chat.template import GIVE_TEMPLATE, TEMPLATE_FILE, read_template_file
from qkv.errors import QkvError
from qkv.generation import GREEDY
from qkv.io.files import file_sha256
from qkv.io.invocation import program
from qkv.tasks.base import EvalOptions
from qkv.tasks.finetune import FinetunedRun, FinetuneTask
from qkv.tasks.lm import LMConfig
from qkv.tokenizers import load_tokenizer
from qkv.training import Evaluation, TrainResult, perplexity

MAX_BLOCK_SIZE = 1024  # conversations' default context, within the checkpoint's: longer conversations are dropped


def recipe(cfg: LMConfig) -> LMConfig:
    """A fine-tuning recipe made a chat one: whole conversations as examples, up to the checkpoint's context (at most
    MAX_BLOCK_SIZE tokens) unless --block-size says otherwise."""
    return dataclasses.replace(cfg, block_size=None)

if TYPE_CHECKING:
    from torch import Tensor

    from qkv.training.distributed import DistContext


def assistant_loss(model: Callable[..., Tensor], val: ChatExamples, batch_size: int, device: torch.device,
                   max_tokens: int | None = None, ctx: DistContext | None = None) -> float:  # fmt: skip
    """The mean cross-entropy over the assistant tokens of the conversations (those up to max_tokens tokens);
    with several processes, rank r reads batches r, r + N, … and the sums are all-reduced."""
    plan = val.slices(batch_size, max_tokens)
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None and ctx.enabled else (1, 0)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for i in range(math.ceil(len(plan) / world)):
            index = rank + i * world  # a rank without a batch left re-runs the first (FSDP's collectives)
            batch = val.batch(plan[index if index < len(plan) else 0], device)
            logits = model(batch.x).flatten(0, 1).float()  # (B·T, V)
            loss = F.cross_entropy(logits, batch.y.flatten(), ignore_index=IGNORE, reduction="sum")
            if index < len(plan):
                sums += torch.stack([loss.double(), torch.tensor(float(batch.n_targets), device=device)])
    if world > 1:
        dist.all_reduce(sums)
    return float(sums[0] / sums[1])


class ChatTask(FinetuneTask):
    """Next-token prediction on the assistant's turns of conversations."""

    dynamic_shapes = True  # each batch is as wide as its longest conversation

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Load the checkpoint and its tokenizer, the template, and every conversation, encoded and split."""
        cfg = self.cfg
        assert cfg.source is not None
        conversations = read_conversations(cfg.source)  # checked before the checkpoint is read: mistakes show at once
        self.load_checkpoint(run_dir, resume)
        cfg = self.cfg
        assert self.tokenizer is not None
        self.splits: ChatSplits = encode_splits(conversations, self.template, self.tokenizer, cfg.window,
                                                cfg.model.context_length)  # fmt: skip

    def load_checkpoint(self, run_dir: Path, resume: bool) -> None:
        """The checkpoint (qkv.tasks.finetune), the block size its context allows, its tokenizer and chat template (a
        resumed run's own)."""
        self.load_base(run_dir, resume)
        self.cfg = dataclasses.replace(self.cfg, block_size=self._block_size())
        self.tokenizer = load_tokenizer(run_dir) if resume else self.base.tokenizer  # type: ignore[union-attr]
        self.template = self._template(run_dir if resume else None)

    def _block_size(self) -> int:
        """The context conversations get: --block-size, or the checkpoint's (at most MAX_BLOCK_SIZE); never more."""
        context = self.cfg.model.context_length
        if self.cfg.block_size is None:
            return min(MAX_BLOCK_SIZE, context)
        if self.cfg.block_size > context:
            raise QkvError(f"--block-size {self.cfg.block_size} is longer than --init-from's context of {context} "
                           f"tokens; give at most {context}")  # fmt: skip
        return self.cfg.block_size

    def _template(self, run_dir: Path | None) -> ChatTemplate:
        """--chat-template's file, a resumed run's own, or the checkpoint's; a one-line error if there is none."""
        cfg, tokenizer = self.cfg, self.tokenizer
        assert tokenizer is not None
        source: str | None
        if cfg.chat_template is not None:
            source = read_template_file(cfg.chat_template)
        elif run_dir is not None and (run_dir / TEMPLATE_FILE).is_file():
            source = (run_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            source = template_source(None, self.base.reference.get("metadata") if self.base else None)
        if source is None:
            raise QkvError(f"--init-from {cfg.init_from} has no chat template to render {cfg.source} with; "
                           f"{GIVE_TEMPLATE}")  # fmt: skip
        origin = f"--chat-template {cfg.chat_template}" if cfg.chat_template is not None else str(cfg.init_from)
        return ChatTemplate.of(source, tokenizer, origin)

    def describe(self) -> str:
        """Conversations, tokens, the share the loss trains on, and how many were too long."""
        train, val, s = self.splits.train, self.splits.val, self.splits
        dropped = f"; {s.dropped} longer than {self.cfg.block_size} tokens dropped" if s.dropped else ""
        share = train.trained() / max(train.tokens(), 1)
        return (f"{len(train):,} train / {len(val):,} val conversations ({train.tokens():,} / {val.tokens():,} "
                f"tokens, {share:.0%} of them the assistant's), vocab {self.tokenizer.vocab_size}{dropped}")  # type: ignore[union-attr]

    def data_summary(self) -> dict[str, Any] | None:
        """The conversation file read, its sha256, and what was kept of it."""
        assert self.cfg.source is not None
        s = self.splits
        return {"chat": self.cfg.source, "sha256": file_sha256(Path(self.cfg.source)),
                "train_conversations": len(s.train), "val_conversations": len(s.val), "dropped": s.dropped}

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> torch.Tensor:
        """`budget` training conversations drawn at random."""
        return torch.randint(len(self.splits.train), (budget,), generator=generator, device=generator.device)

    def collate(self, examples: Any, device: torch.device) -> ChatBatch:  # type: ignore[override]
        """The conversations drawn, padded to the longest (x and y as LMBatch's: the language model's loss)."""
        return self.splits.train.batch(examples.tolist(), device)

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """The mean loss over the validation conversations' assistant tokens (periodically over eval_tokens
        tokens of them, if set)."""
        max_tokens = None if ev.full else self.cfg.eval_tokens
        with ev.autocast():
            loss = assistant_loss(ev.forward, self.splits.val, self.cfg.data.batch_size, ev.ctx.device, max_tokens,
                                  ev.ctx)  # fmt: skip
        return {"val_loss": loss}

    def save(self, run_dir: Path) -> None:
        """The tokenizer and the chat template."""
        super().save(run_dir)
        self.template.save(run_dir)

    def summary(self, result: TrainResult) -> str:
        """The final validation loss, and the tuned model's greedy reply to the first validation conversation."""
        loss = result.val_loss
        lines = [f"\nvalidation loss {loss:.4f} on the assistant's tokens (perplexity {perplexity(loss):.2f}) after "
                 f"{result.step} steps, {result.took()} — run saved in {result.run_dir}"]  # fmt: skip
        conversation = self.splits.val_conversations[0].messages
        turn = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        if self.cfg.sample_tokens > 0 and turn > 0 and conversation[turn - 1]["role"] == "user":
            run = self.loaded(result.run_dir)
            session = ChatSession(run.model, run.require_tokenizer(), self.template, GREEDY, self.cfg.sample_tokens,
                                  history=list(conversation[:turn - 1]))  # fmt: skip
            try:
                tokens, _ = session.say(conversation[turn - 1]["content"])
            except QkvError:  # no room for sample_tokens in the model's context after this conversation
                q = program()
                return "\n".join([*lines, f"more: {q} chat {result.run_dir}  |  {q} eval {result.run_dir}"])
            reply = run.require_tokenizer().decode(list(tokens))
            lines += ["\n--- a validation conversation " + "-" * 41, f"{conversation[turn - 1]['role']}: "
                      f"{conversation[turn - 1]['content']}", f"reference: {conversation[turn]['content']}",
                      f"model:     {reply}", "-" * 71]  # fmt: skip
        q = program()
        lines.append(f"more: {q} chat {result.run_dir}  |  {q} eval {result.run_dir}  |  {q} explore {result.run_dir}")
        return "\n".join(lines)


class ChatRun(FinetunedRun):
    """A chat fine-tune: `qkv eval` measures the loss over its held-out conversations' replies."""

    def evaluate(self, options: EvalOptions) -> list[str]:
        """The validation loss over the held-out conversations' assistant tokens."""
        options.refuse_beam_options(self.task)
        cfg, tokenizer = self.config, self.require_tokenizer()
        source = (self.directory / TEMPLATE_FILE).read_text(encoding="utf-8")
        assert cfg.source is not None
        splits = encode_splits(read_conversations(cfg.source), ChatTemplate.of(source, tokenizer), tokenizer,
                               cfg.window)  # fmt: skip
        loss = assistant_loss(self.model, splits.val, options.batch_size, self.device)
        return [f"val loss {loss:.4f}  perplexity {perplexity(loss):.3f}  ({splits.val.trained():,} assistant tokens "
                f"of {len(splits.val):,} held-out conversations, {self.checkpoint} weights)"]  # fmt: skip
