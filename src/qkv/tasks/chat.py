"""Supervised fine-tuning on conversations (`qkv train --init-from CHECKPOINT --data chat.jsonl`): the language
model's task, with a JSON Lines file of {"messages": […]} as its data.

Each conversation is rendered with the checkpoint's chat template (or --chat-template FILE) and tokenized whole;
the loss is the next-token cross-entropy over the assistant's tokens only (its replies and their end-of-turn
tokens, qkv.chat.data), averaged over all of them in the step. Everything else is the language model's: the
checkpoint, LoRA or full fine-tuning, the loop. The run keeps the template (chat_template.jinja) for `qkv chat`.
"""

from __future__ import annotations

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
from qkv.tasks.lm import LMRun, LMTask
from qkv.tokenizers import load_tokenizer
from qkv.training import Evaluation, TrainResult, perplexity

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


def evaluate_run(run: LMRun, batch_size: int) -> list[str]:
    """`qkv eval` of a chat run: the validation loss over the held-out conversations' assistant tokens."""
    cfg, tokenizer = run.config, run.require_tokenizer()
    source = (run.directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    assert cfg.data is not None
    splits = encode_splits(read_conversations(cfg.data), ChatTemplate.of(source, tokenizer), tokenizer, cfg.block_size)
    loss = assistant_loss(run.model, splits.val, batch_size, run.device)
    return [f"val loss {loss:.4f}  perplexity {perplexity(loss):.3f}  ({splits.val.trained():,} assistant tokens of "
            f"{len(splits.val):,} held-out conversations, {run.checkpoint} weights)"]  # fmt: skip


class ChatTask(LMTask):
    """Next-token prediction on the assistant's turns of conversations."""

    dynamic_shapes = True  # each batch is as wide as its longest conversation

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Load the checkpoint and its tokenizer, the template, and every conversation, encoded and split."""
        cfg = self.cfg
        if cfg.init_from is None:
            raise QkvError("a chat file fine-tunes a pretrained model on conversations; add --init-from CHECKPOINT")
        assert cfg.data is not None
        conversations = read_conversations(cfg.data)  # checked before the checkpoint is read: mistakes show at once
        if not resume or cfg.lora_rank is not None:
            self.load_base(run_dir, resume)
        if self.base is not None and "block_size" not in cfg.given:  # the default, within the model's context
            cfg.block_size = min(cfg.block_size, self.base.model.cfg.max_positions)
        self.tokenizer = load_tokenizer(run_dir) if resume else self.base.tokenizer  # type: ignore[union-attr]
        self.template = self._template(run_dir if resume else None)
        self.splits: ChatSplits = encode_splits(conversations, self.template, self.tokenizer, cfg.block_size)

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
            raise QkvError(f"--init-from {cfg.init_from} has no chat template to render {cfg.data} with; "
                           f"{GIVE_TEMPLATE}")  # fmt: skip
        return ChatTemplate.of(source, tokenizer)

    def describe(self) -> str:
        """Conversations, tokens, the share the loss trains on, and how many were too long."""
        train, val, s = self.splits.train, self.splits.val, self.splits
        dropped = f"; {s.dropped} longer than {self.cfg.block_size} tokens dropped" if s.dropped else ""
        share = train.trained() / max(train.tokens(), 1)
        return (f"{len(train):,} train / {len(val):,} val conversations ({train.tokens():,} / {val.tokens():,} "
                f"tokens, {share:.0%} of them the assistant's), vocab {self.tokenizer.vocab_size}{dropped}")  # type: ignore[union-attr]

    def data_summary(self) -> dict[str, Any] | None:
        """The conversation file read, its sha256, and what was kept of it."""
        assert self.cfg.data is not None
        s = self.splits
        return {"chat": self.cfg.data, "sha256": file_sha256(Path(self.cfg.data)), "train_conversations": len(s.train),
                "val_conversations": len(s.val), "dropped": s.dropped}  # fmt: skip

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
            loss = assistant_loss(ev.forward, self.splits.val, self.cfg.batch_size, ev.ctx.device, max_tokens, ev.ctx)
        return {"val_loss": loss}

    def save(self, run_dir: Path) -> None:
        """The tokenizer and the chat template."""
        super().save(run_dir)
        self.template.save(run_dir)

    def summary(self, result: TrainResult) -> str:
        """The final validation loss, and the tuned model's greedy reply to the first validation conversation."""
        loss = result.val_loss
        lines = [f"\nvalidation loss {loss:.4f} on the assistant's tokens (perplexity {perplexity(loss):.2f}) after "
                 f"{result.step} steps, {result.elapsed_s:.0f} s — run saved in {result.run_dir}"]  # fmt: skip
        conversation = self.splits.val_conversations[0].messages
        turn = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        if self.cfg.sample_tokens > 0 and turn > 0 and conversation[turn - 1]["role"] == "user":
            run = LMRun.load(result.run_dir)
            session = ChatSession(run.model, run.require_tokenizer(), self.template, GREEDY, self.cfg.sample_tokens,
                                  history=list(conversation[:turn - 1]))  # fmt: skip
            try:
                tokens, _ = session.say(conversation[turn - 1]["content"])
            except QkvError:  # no room for sample_tokens in the model's context after this conversation
                return "\n".join([*lines, f"more: qkv chat {result.run_dir}  |  qkv eval {result.run_dir}"])
            reply = run.require_tokenizer().decode(list(tokens))
            lines += ["\n--- a validation conversation " + "-" * 41, f"{conversation[turn - 1]['role']}: "
                      f"{conversation[turn - 1]['content']}", f"reference: {conversation[turn]['content']}",
                      f"model:     {reply}", "-" * 71]  # fmt: skip
        lines.append(f"more: qkv chat {result.run_dir}  |  qkv eval {result.run_dir}  |  qkv explore {result.run_dir}")
        return "\n".join(lines)
