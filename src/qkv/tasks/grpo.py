"""Reinforcement learning with verifiable rewards (`qkv train grpo --init-from CHECKPOINT --data prompts.jsonl
--reward numeric`): GRPO on the one training loop.

Each step draws prompts, and the policy being trained (the float weights themselves, never a compiled or quantised
copy) samples G replies to each through the batched engine (qkv.engine), each reply seeded by its prompt's draw,
so that how the prompts are split across processes never changes a reply. The reward scores every reply; the
advantages are normalised within each group (a group whose rewards are all equal teaches nothing, and is counted);
the loss is GRPO's clipped policy loss over the replies' tokens, with an optional KL penalty to the checkpoint
(qkv.posttrain.losses). One gradient step per batch of samples, so the policy ratio is 1 where it is taken (TRL's
default). The progress bar and rollouts.jsonl show each step's reward mean and spread, KL, reply length and share
of all-equal groups; evaluations decode the held-out prompts greedily and report their mean reward.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.chat import stop_ids
from qkv.chat.examples import IGNORE, VAL_FRACTION, padded
from qkv.chat.template import ChatTemplate
from qkv.config import option
from qkv.engine import Engine, Request
from qkv.errors import QkvError
from qkv.generation import Sampling
from qkv.io.files import file_sha256
from qkv.io.invocation import program
from qkv.lora import adapters_off
from qkv.models import DecoderLM
from qkv.posttrain.losses import group_advantages, grpo_loss, grpo_token_losses, token_logps
from qkv.posttrain.prompts import Prompt, encode_prompts, read_prompts
from qkv.posttrain.rewards import Reward, load_reward, score
from qkv.tasks.base import EvalOptions
from qkv.tasks.chat import ChatTask
from qkv.tasks.finetune import FinetunedRun, post_training, recipe_as
from qkv.tasks.lm import LMConfig
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.training import Evaluation, RunConfig, TrainResult

ROLLOUTS_FILE = "rollouts.jsonl"
MAX_SLOTS = 32  # replies decoded together at most
# TRL's GRPO rate for full fine-tuning, twenty times it for LoRA's adapters; a step is a batch of prompts × G replies.
SETTINGS = {"optim.lr": 1e-6, "schedule.warmup_steps": 0, "data.batch_size": 4, "eval.interval": 10,
            "schedule.max_steps": 50, "sample_tokens": 0}  # fmt: skip
LORA_LR = 2e-5


@dataclass(frozen=True, kw_only=True)
class GRPOConfig(LMConfig):
    """A language model's settings with GRPO's: the reward, the group, the sampling and the clipped loss."""

    task: ClassVar[str] = "grpo"

    reward: str = option("numeric", "numeric (the reply's last number equals the answer), format (\"The answer is "
                         "N\"), or FILE.py:FUNCTION called as FUNCTION(reply=, prompt=, answer=)")  # fmt: skip
    group: int = option(8, "replies sampled per prompt (G ≥ 2: advantages compare replies to the same prompt)")
    max_completion_tokens: int = option(256, "the longest reply sampled, in tokens")
    temperature: float = option(1.0, "the sampling temperature of the replies")
    epsilon: float = option(0.2, "the policy ratio's clip range: [1 − ε, 1 + ε]")
    beta: float = option(0.0, "weight of the KL penalty to the checkpoint (0: none, TRL's default)")
    reward_timeout: float = option(10.0, "seconds one reward call may take (0: no limit)")

    def check(self) -> None:
        """The language model's checks, and GRPO's."""
        super().check()
        if self.group < 2:
            raise QkvError(f"--group must be at least 2, got {self.group}: advantages compare replies to one prompt")
        if self.max_completion_tokens < 1 or self.temperature <= 0 or not 0 < self.epsilon < 1 or self.beta < 0:
            raise QkvError("--max-completion-tokens must be ≥ 1, --temperature > 0, --epsilon in (0, 1) and --beta ≥ 0")
        if self.reward_timeout < 0:
            raise QkvError(f"--reward-timeout must be ≥ 0 seconds, got {self.reward_timeout}")


def recipe() -> GRPOConfig:
    """The language model's recipe as a GRPO config (`qkv train grpo --help` shows it; --init-from makes it tune)."""
    return recipe_as(GRPOConfig)


def tuned(cfg: GRPOConfig) -> GRPOConfig:
    """A fine-tuning recipe made a GRPO one: GRPO's rates and lengths, no sample at the end."""
    return post_training(cfg, SETTINGS, LORA_LR)


@dataclass
class RolloutBatch:
    """Prompts with their sampled replies: inputs x (B, T), targets y (B, T) (IGNORE outside the replies), each
    reply's advantage (B,), and the reference's log-probabilities of the reply tokens (B, T) where a KL is asked."""

    x: Tensor
    y: Tensor
    advantages: Tensor
    reference: Tensor | None
    n_targets: int  # reply tokens: the loss is a mean over them
    n_tokens: int


def sample(model: DecoderLM, tokenizer: Tokenizer, prompts: list[list[int]], seeds: list[int], group: int,
           max_tokens: int, temperature: float, stops: frozenset[int]) -> list[tuple[list[int], bool]]:  # fmt: skip
    """`group` replies to each prompt (reply k of a prompt seeded seed + k), decoded together; each reply's ids
    (with the stop token that ended it) and whether it ended by itself. `temperature` 0: one greedy reply each."""
    requests = [Request(ids, max_tokens, Sampling(temperature, seed=seed + k), stops)
                for ids, seed in zip(prompts, seeds, strict=True) for k in range(group)]  # fmt: skip
    slots = min(len(requests), MAX_SLOTS)
    room = max(len(r.ids) for r in requests) + max_tokens
    engine = Engine(model, tokenizer, max_batch=slots, kv_cache_tokens=slots * room, max_queue=len(requests),
                    reuse_prompts=False)  # fmt: skip
    out = []
    for tokens, finished in engine.generate(requests):
        end = [] if finished.stop_id is None else [finished.stop_id]  # trained too: the policy learns to stop
        out.append(([t.id for t in tokens] + end, finished.stop_id is not None))
    return out


class GRPOTask(ChatTask):
    """Raise the reward of the policy's own replies, group by group."""

    name = "grpo"
    best_metric: ClassVar[str] = "val_reward"
    higher_is_better: ClassVar[bool] = True

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """<prompts file>-<checkpoint>[-lora]-grpo."""
        _require(cfg)
        return f"{super().run_name(cfg)}-grpo"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Read and check the prompts and the reward, load the checkpoint, its template (if any) and encode."""
        _require(self.cfg)
        cfg = cast(GRPOConfig, self.cfg)
        if cfg.system.strategy == "fsdp":
            raise QkvError("GRPO samples with the whole policy on each process; use --strategy ddp, not fsdp")
        if cfg.system.compile:
            raise QkvError("GRPO samples with the eager policy and does not compile its training step; drop --compile")
        assert cfg.source is not None
        prompts = read_prompts(cfg.source)  # checked before the checkpoint is read: mistakes show at once
        self.reward: Reward = load_reward(cfg.reward)
        self.load_base(run_dir, resume)
        self.cfg = cfg = dataclasses.replace(cfg, block_size=cfg.model.context_length)
        self.tokenizer = load_tokenizer(run_dir) if resume else self.base.tokenizer  # type: ignore[union-attr]
        self.chat: ChatTemplate | None = self._optional_template(run_dir if resume else None)
        encoded = encode_prompts(prompts, self.chat, self.tokenizer, cfg.model.context_length,
                                 cfg.max_completion_tokens, str(cfg.source))  # fmt: skip
        n_val = max(1, round(len(prompts) * VAL_FRACTION))
        self.train_prompts, self.val_prompts = prompts[:-n_val], prompts[-n_val:]
        self.train_ids, self.val_ids = encoded[:-n_val], encoded[-n_val:]
        self.stops = frozenset(stop_ids(self.tokenizer))
        self.run_dir, self.policy, self.reference = run_dir, cast(DecoderLM | None, None), cast(nn.Module | None, None)
        self.last: dict[str, Any] = {}
        self.kl: list[Tensor] = []  # the step's micro-batches' mean KL, read once the step is done
        self.logged = False  # whether this session has written to rollouts.jsonl

    def _optional_template(self, run_dir: Path | None) -> ChatTemplate | None:
        """The chat template (--chat-template's, the run's or the checkpoint's), or None: prompts read as written."""
        try:
            return self._template(run_dir)
        except QkvError:
            if self.cfg.chat_template is not None:
                raise
            return None

    def build_model(self) -> nn.Module:
        """The checkpoint's model, kept for sampling; a frozen copy as the reference where a full fine-tune asks for a
        KL penalty (with LoRA the reference is the base itself, adapters off)."""
        model = super().build_model()
        self.policy = cast(DecoderLM, model)
        if cast(GRPOConfig, self.cfg).beta > 0 and self.cfg.lora is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        return model

    def describe(self) -> str:
        """Prompts, the reward and the group."""
        cfg = cast(GRPOConfig, self.cfg)
        return (f"{len(self.train_prompts):,} train / {len(self.val_prompts):,} val prompts, reward {cfg.reward}, "
                f"{cfg.group} replies each of up to {cfg.max_completion_tokens} tokens, β {cfg.beta:g}")  # fmt: skip

    def data_summary(self) -> dict[str, Any] | None:
        """The prompt file read and its sha256."""
        assert self.cfg.source is not None
        return {"prompts": self.cfg.source, "sha256": file_sha256(Path(self.cfg.source)),
                "train_prompts": len(self.train_prompts), "val_prompts": len(self.val_prompts)}  # fmt: skip

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Tensor:
        """`budget` training prompts drawn at random, each with the seed its replies are sampled from: (budget, 2)."""
        index = torch.randint(len(self.train_prompts), (budget,), generator=generator, device=generator.device)
        seeds = torch.randint(2**31 - 2**16, (budget,), generator=generator, device=generator.device)
        return torch.stack([index, seeds], dim=1)

    def collate(self, examples: Any, device: torch.device) -> RolloutBatch:  # type: ignore[override]
        """Sample G replies to each prompt with the policy as it is now, score them, and batch them."""
        cfg, policy = cast(GRPOConfig, self.cfg), self.policy
        assert policy is not None and self.tokenizer is not None
        chosen = [(int(i), int(s)) for i, s in examples.tolist()]
        prompts = [self.train_ids[i] for i, _ in chosen]
        rows = [p for p in prompts for _ in range(cfg.group)]
        was_training = policy.training
        policy.eval()  # sampling, and the reference's log-probabilities, without dropout
        with torch.no_grad():
            replies = sample(policy, self.tokenizer, prompts, [s for _, s in chosen], cfg.group,
                             cfg.max_completion_tokens, cfg.temperature, self.stops)  # fmt: skip
            x, y = padded([p + r for p, (r, _) in zip(rows, replies, strict=True)],
                          [[False] * len(p) + [True] * len(r) for p, (r, _) in zip(rows, replies, strict=True)])
            on = next(policy.parameters()).device
            reference = self._reference(x.to(on), y.to(on)) if cfg.beta > 0 else None
        policy.train(was_training)
        rewards = torch.tensor(self._scores(chosen, replies))
        advantages, equal = group_advantages(rewards, cfg.group)
        self._record(rewards, equal, replies)
        n_targets = int((y != IGNORE).sum())
        return RolloutBatch(x.to(device), y.to(device), advantages.to(device),
                            None if reference is None else reference.to(device), max(n_targets, 1),
                            sum(len(p) + len(r) - 1 for p, (r, _) in zip(rows, replies, strict=True)))  # fmt: skip

    def _scores(self, chosen: list[tuple[int, int]], replies: list[tuple[list[int], bool]]) -> list[float]:
        """The reward of every reply, prompt by prompt."""
        cfg = cast(GRPOConfig, self.cfg)
        out = []
        for n, (i, _) in enumerate(chosen):
            for ids, _ in replies[n * cfg.group : (n + 1) * cfg.group]:
                out.append(self._score(self.train_prompts[i], ids))
        return out

    def _score(self, prompt: Prompt, ids: list[int]) -> float:
        """One reply's reward; a one-line error naming the prompt, and where the run's last checkpoint is."""
        assert self.tokenizer is not None
        cfg = cast(GRPOConfig, self.cfg)
        reply = self.tokenizer.decode([t for t in ids if t not in self.stops])
        where = (f"the prompt on {cfg.source} line {prompt.line}; the run's last checkpoint is kept in {self.run_dir} "
                 f"(continue it with {program()} train --resume --out-dir {self.run_dir})")  # fmt: skip
        return score(self.reward, reply, prompt.messages[-1]["content"], prompt.answer, cfg.reward_timeout, where)

    def _reference(self, x: Tensor, y: Tensor) -> Tensor:
        """The reference's log-probabilities of the reply tokens (B, T): the checkpoint's copy, or the base with the
        adapters off."""
        assert self.policy is not None
        with torch.no_grad():
            if self.reference is not None:
                return token_logps(self.reference(x), y)
            with adapters_off(self.policy):
                return token_logps(self.policy(x), y)

    def _record(self, rewards: Tensor, equal: Tensor, replies: list[tuple[list[int], bool]]) -> None:
        """This micro-batch's measures (this process's), for the progress bar and rollouts.jsonl."""
        self.last = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
                     "equal_groups": equal.float().mean().item(),
                     "reply_tokens": sum(len(ids) for ids, _ in replies) / len(replies),
                     "ended": sum(ended for _, ended in replies) / len(replies)}  # fmt: skip

    def after_step(self, step: int, is_main: bool) -> None:
        """The step's measures into rollouts.jsonl (the first process's; a resumed run drops rows past its
        checkpoint first)."""
        if self.kl:
            self.last["kl"] = float(torch.stack(self.kl).mean())
            self.kl = []
        path = self.run_dir / ROLLOUTS_FILE
        if not is_main or not self.last or not self.run_dir.is_dir():
            return
        if not self.logged and path.is_file():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines() if json.loads(line)["step"] < step]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self.logged = True
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in self.last.items()}}) + "\n")

    def logits(self, model: Callable[..., Any], batch: RolloutBatch) -> Tensor:  # type: ignore[override]
        """Next-token logits of every row (B, T, V)."""
        return cast(Tensor, model(batch.x))

    def criterion(self, logits: Tensor, batch: RolloutBatch) -> Tensor:  # type: ignore[override]
        """GRPO's clipped policy loss (and KL penalty), the mean over the batch's reply tokens."""
        cfg = cast(GRPOConfig, self.cfg)
        logps = token_logps(logits, batch.y)  # (B, T), 0 outside the replies
        mask = (batch.y != IGNORE).to(logps.dtype)
        losses, kl = grpo_token_losses(logps, None, batch.reference, batch.advantages, (cfg.epsilon, cfg.epsilon),
                                       cfg.beta)  # fmt: skip
        if kl is not None:
            self.kl.append((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        return grpo_loss(losses, mask)

    def progress_note(self) -> str:
        """The latest step's reward mean ± spread, all-equal groups, reply length and KL."""
        if not self.last:
            return ""
        m = self.last
        kl = f"  kl {m['kl']:.4f}" if "kl" in m else ""
        return (f"reward {m['reward_mean']:.3f}±{m['reward_std']:.3f}  equal groups {m['equal_groups']:.0%}  "
                f"reply {m['reply_tokens']:.0f} tok{kl}  ")  # fmt: skip

    @property
    def partial_evaluation(self) -> bool:
        """Every evaluation decodes all the held-out prompts."""
        return False

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """The mean reward of the greedy replies to the held-out prompts."""
        assert self.tokenizer is not None
        ranks = (ev.ctx.world_size, ev.ctx.rank) if ev.ctx.enabled else (1, 0)
        return {"val_reward": held_out_reward(cast(DecoderLM, ev.model), self.tokenizer, self.val_prompts,
                                              self.val_ids, self, ranks)}  # fmt: skip

    def save(self, run_dir: Path) -> None:
        """The tokenizer and the chat template (if any)."""
        if self.tokenizer is not None:
            self.tokenizer.save(run_dir)
        if self.chat is not None:
            self.chat.save(run_dir)

    def summary(self, result: TrainResult) -> str:
        """The held-out reward and what to try next."""
        q = program()
        return (f"\nvalidation reward {result.final['val_reward']:.4f} (greedy, {len(self.val_prompts)} held-out "
                f"prompts) after {result.step} steps, {result.took()} — run saved in {result.run_dir}; each step's "
                f"rewards in {result.run_dir / ROLLOUTS_FILE}\nmore: {q} chat {result.run_dir}  |  {q} eval "
                f"{result.run_dir} --bench gsm8k")  # fmt: skip


def held_out_reward(model: DecoderLM, tokenizer: Tokenizer, prompts: list[Prompt], ids: list[list[int]],
                    task: GRPOTask, ranks: tuple[int, int] = (1, 0)) -> float:  # fmt: skip
    """The mean reward of greedy replies to `prompts`; with (world, rank) = ranks, rank r decodes every world-th."""
    world, rank = ranks
    cfg = cast(GRPOConfig, task.cfg)
    mine = list(range(rank, len(prompts), world))
    total = 0.0
    if mine:
        replies = sample(model, tokenizer, [ids[i] for i in mine], [0] * len(mine), 1, cfg.max_completion_tokens,
                         0.0, task.stops)  # fmt: skip
        total = sum(task._score(prompts[i], r) for i, (r, _) in zip(mine, replies, strict=True))
    sums = torch.tensor([total], dtype=torch.float64, device=next(model.parameters()).device)  # NCCL: on the GPU
    if world > 1:
        dist.all_reduce(sums)
    return float(sums[0]) / len(prompts)


def _require(cfg: RunConfig[Any]) -> None:
    """A one-line error for a GRPO run without a checkpoint or prompts."""
    if getattr(cfg, "init_from", None) is None or getattr(cfg, "source", None) is None:
        raise QkvError("qkv train grpo tunes a checkpoint on prompts: give --init-from CHECKPOINT, --data "
                       "prompts.jsonl and --reward numeric|format|FILE.py:FUNCTION")  # fmt: skip


class GRPORun(FinetunedRun):
    """A GRPO run: `qkv eval` decodes its held-out prompts greedily and reports their mean reward."""

    config_class: ClassVar[type[RunConfig[Any]]] = GRPOConfig

    def evaluate(self, options: EvalOptions) -> list[str]:
        """The held-out prompts' mean reward."""
        options.refuse_beam_options("grpo")
        task = GRPOTask(cast(GRPOConfig, self.config))
        task.setup(self.directory, resume=True)
        reward = held_out_reward(cast(DecoderLM, self.model), self.require_tokenizer(), task.val_prompts,
                                 task.val_ids, task)  # fmt: skip
        return [f"val reward {reward:.4f}  ({len(task.val_prompts)} held-out prompts, greedy, {self.checkpoint} "
                "weights)"]  # fmt: skip


__all__ = ["GRPOConfig", "GRPORun", "GRPOTask", "held_out_reward", "recipe", "tuned"]
