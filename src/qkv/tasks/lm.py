"""The language-model task (`qkv train`, the default): a decoder-only Transformer predicts the next token.

Data: a data directory written by `qkv prepare` (memory-mapped shards, any size), or a text file, or the
embedded Shakespeare corpus: a file is prepared into the cache on first use (qkv.data.cache), split by
characters (first 90 % train, last 10 % validation), character-, BPE- or GPT-2-tokenised. Batches are
random windows of block_size tokens; the loss is the mean next-token cross-entropy; the evaluation is the
validation split cut into consecutive windows, every position predicted once (qkv.training.evaluate),
which is what `qkv eval` reports too, with the bits per byte of the same windows where the tokenizer says
each token's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.chat import is_chat_file
from qkv.config import option
from qkv.data.batches import random_windows, to_device
from qkv.data.options import TokenizerRecipe
from qkv.data.tokens import TokenData, TokenSplit
from qkv.engine import continuations
from qkv.errors import QkvError
from qkv.generation import Sampling
from qkv.io.invocation import program
from qkv.io.progress import ProgressLine, batch_progress
from qkv.io.run_dir import read_metrics
from qkv.lora import LoRAConfig
from qkv.models import DecoderLM, DecoderLMConfig, EmbeddingConfig
from qkv.norms import NormConfig
from qkv.positional import RotaryPositionsConfig
from qkv.tasks.base import EvalOptions, LoadedRun
from qkv.tasks.text import TextConfig, check_window_fits, data_record, text_data, vocabulary
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.training import Evaluation, RunConfig, Task, TrainResult, evaluate_loss, evaluate_sums, perplexity
from qkv.training.config import EvalConfig, OptimConfig, ScheduleConfig
from qkv.training.evaluate import LossSums, eval_rows, token_bytes_of

TokenizerName = Literal["char", "bpe", "gpt2"]  # of a text file; a data directory has its own


@dataclass(frozen=True, kw_only=True)
class LMConfig(TextConfig[DecoderLMConfig]):
    """How to train a language model: the shared settings plus its text, tokenizer, context and sample, and what a
    fine-tuning run starts from (qkv.tasks.finetune, qkv.tasks.chat)."""

    task: ClassVar[str] = "lm"
    model_class: ClassVar[type[DecoderLMConfig]] = DecoderLMConfig
    paths: ClassVar[tuple[str, ...]] = ("source", "init_from", "chat_template")

    tokenizer: TokenizerName | None = option(None, "a text file's: char, bpe (a byte-level BPE learnt from its "
                                             "training split) or gpt2; none: char (a data directory has its own)",
                                             fixed=True)  # fmt: skip
    eval_tokens: int | None = option(8192, "validation tokens read by periodic evaluations, spread over the split "
                                     "(none: all)")  # fmt: skip
    final_eval_tokens: int | None = option(None, "validation tokens read by the last evaluation and `qkv eval` "
                                           "(none: the whole split, or as many tokens as the run trained on when "
                                           "the split is longer and --eval-tokens is set; 0: always the whole "
                                           "split)")  # fmt: skip
    sample_tokens: int = option(400, "tokens sampled when training ends (0 = none)")
    init_from: str | None = option(None, "fine-tune this checkpoint: a .gguf file, a Hugging Face directory, a `qkv "
                                   "convert` directory or a qkv run; its architecture and tokenizer are the run's",
                                   fixed=True)  # fmt: skip
    lora: LoRAConfig | None = option(None, "LoRA adapters beside the frozen weights of --init-from (none: every "
                                     "weight trains)", fixed=True, prefix="lora")  # fmt: skip
    chat_template: str | None = option(None, "a Jinja chat template file for conversation data (--data chat.jsonl) "
                                       "on a checkpoint without one", fixed=True)  # fmt: skip

    @classmethod
    def _from_flat(cls, flat: Mapping[str, Any]) -> dict[str, Any]:
        """A flat (qkv-run/1) config; its last evaluation read the whole split when final_eval_tokens was none."""
        return super()._from_flat({**flat, "final_eval_tokens": flat.get("final_eval_tokens") or 0})

    def final_budget(self, tokens_seen: int | None) -> int | None:
        """The tokens the last evaluation reads (None: the whole split) after a run that trained on tokens_seen."""
        if self.final_eval_tokens is not None:
            return self.final_eval_tokens or None
        if self.eval_tokens is None or not tokens_seen:  # periodic evaluations read it all: so does the last
            return None
        return max(tokens_seen, self.eval_tokens)

    def check(self) -> None:
        """The shared checks, then the language model's own."""
        super().check()
        for name in ("eval_tokens", "final_eval_tokens"):
            value = getattr(self, name)
            if value is not None and value < 2 and not (name == "final_eval_tokens" and value == 0):
                raise QkvError(f"{name.replace('_', '-')} must be ≥ 2, got {value}")
        if self.sample_tokens < 0:
            raise QkvError(f"sample-tokens must be ≥ 0, got {self.sample_tokens}")
        if self.lora is not None and self.system.strategy == "fsdp":
            raise QkvError("LoRA trains on one process or with --strategy ddp (its frozen base is not sharded); drop "
                           "--strategy fsdp")  # fmt: skip
        if self.init_from is None and self.lora is not None:
            raise QkvError("--lora-rank and the other LoRA settings adapt a pretrained model; add --init-from "
                           "CHECKPOINT")  # fmt: skip
        if self.init_from is not None and (self.tokenizer is not None or self.vocab_size != 1024):
            flags = " and ".join(f for f, off in (("--tokenizer", self.tokenizer is None),
                                                  ("--vocab-size", self.vocab_size == 1024)) if not off)  # fmt: skip
            raise QkvError(f"{flags} contradict(s) --init-from: the tokenizer is the checkpoint's; drop {flags}")


def recipe() -> LMConfig:
    """The default recipe, a speedrun (benchmarks/SPEEDRUN.md): the fastest way found on a 2-core CPU to the
    full-validation loss nanoGPT's CPU recipe ends at on the embedded Shakespeare (1.96).

    nanoGPT's width (128) with a modern block: three layers instead of four, one key/value head (multi-query
    attention: fewer multiply-adds per token), Muon for the blocks' matrices at a high learning rate, windows of
    128 characters in batches of 8 and a cosine schedule as long as the run; periodic evaluations read a sample of
    the validation split, the last one all of it.
    """
    block = BlockConfig(attention=MultiHeadAttentionConfig(n_heads=4, n_kv_heads=1, bias=False, dropout=0.0),
                        ffn=FeedForwardConfig(activation="swiglu", bias=False, dropout=0.0),
                        norm=NormConfig(kind="rms", bias=False), norm_placement="pre", dropout=0.0)  # fmt: skip
    model = DecoderLMConfig(d_model=128, max_positions=None,  # None: the block size
                            embedding=EmbeddingConfig(positions=RotaryPositionsConfig(), dropout=0.0),
                            decoder=StackConfig(n_layers=3, block=block))  # fmt: skip
    # Four Newton–Schulz iterations do as well as five here, and a step is faster (benchmarks/SPEEDRUN.md).
    return LMConfig(model=model, optim=OptimConfig(name="muon", lr=1e-2, newton_schulz_steps=4),
                    schedule=ScheduleConfig(max_steps=350), eval=EvalConfig(interval=100))


@dataclass
class LMBatch:
    """Windows x (B, T) and their next tokens y (B, T): every position is a target."""

    x: Tensor
    y: Tensor

    @property
    def n_targets(self) -> int:
        """B · T."""
        return self.y.numel()

    @property
    def n_tokens(self) -> int:
        """B · T."""
        return self.x.numel()


class NextToken:
    """The loss of a task whose batches are LMBatch: next-token cross-entropy at every position."""

    def logits(self, model: Callable[..., Any], batch: LMBatch) -> Tensor:
        """Next-token logits (B, T, V)."""
        return cast(Tensor, model(batch.x))

    def criterion(self, logits: Tensor, batch: LMBatch) -> Tensor:
        """Mean next-token cross-entropy (computed in float32 whatever the autocast dtype)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), batch.y.flatten())


class LMTask(NextToken, Task):
    """Next-token prediction with a new DecoderLM on text (qkv.tasks.finetune starts from a checkpoint instead)."""

    name = "lm"

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__(cfg)
        self.cfg: LMConfig = cfg
        self.data: TokenData | None = None
        self.train: TokenSplit | None = None
        self.token_bytes: Tensor | None = None  # each token's UTF-8 bytes, for bits per byte (None: not known)

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """<data file or directory name, or shakespeare>-<tokenizer>."""
        assert isinstance(cfg, LMConfig)
        return f"{cfg.text_name()}-{'data' if cfg.data_dir else cfg.tokenizer or 'char'}"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Open the data (a text file is prepared with the run's own tokenizer on resume); check a window fits."""
        cfg = self.cfg
        if cfg.data_dir and not resume and (cfg.tokenizer is not None or cfg.vocab_size != 1024):
            flags = " and ".join(f for f, unset in (("--tokenizer", cfg.tokenizer is None),
                                                    ("--vocab-size", cfg.vocab_size == 1024)) if not unset)  # fmt: skip
            raise QkvError(f"{cfg.source} is a data directory: its tokenizer is the one it was prepared with; drop "
                           f"{flags}")  # fmt: skip
        stored = load_tokenizer(run_dir) if resume else None
        self.open_data(run_dir if resume else None, stored, new_tokenizer(cfg), cfg.tokenizer or "char")

    def open_data(self, run_dir: Path | None, stored: Tokenizer | None, new: Tokenizer | TokenizerRecipe,
                  name: str) -> None:  # fmt: skip
        """The run's data, its tokenizer and the training split; refuses a window longer than any shard."""
        if is_chat_file(self.cfg.source):
            raise QkvError("a chat file fine-tunes a pretrained model on conversations; add --init-from CHECKPOINT")
        if self.cfg.chat_template is not None:
            raise QkvError("--chat-template renders conversations: give --data a JSON Lines file of "
                           '{"messages": [{"role": …, "content": …}, …]}')  # fmt: skip
        self.data = text_data(self.cfg, run_dir, stored, new, name)
        self.tokenizer = self.data.tokenizer
        self.token_bytes = token_bytes_of(self.tokenizer)
        self.train = self.data.split("train")
        check_window_fits(self.cfg.window, self.train)
        for split in (self.train, self.data.split("val")):  # before the run directory exists: nothing left behind
            split.check_ids()

    def model_config(self) -> DecoderLMConfig:
        """The run's model over the tokenizer's vocabulary, with a context of block_size tokens unless it has one."""
        assert self.tokenizer is not None
        model = self.cfg.model
        vocab = vocabulary(model.vocab_size, self.tokenizer)
        cfg = replace(model, vocab_size=vocab, max_positions=model.max_positions or self.cfg.window)
        if cfg.context_length < self.cfg.window and self.cfg.init_from is not None:
            raise QkvError(f"--block-size {self.cfg.window} is longer than --init-from's context of "
                           f"{cfg.context_length} tokens; give at most {cfg.context_length}")  # fmt: skip
        if cfg.context_length < self.cfg.window:
            raise QkvError(f"--block-size {self.cfg.window} is longer than the model's context of {cfg.context_length} "
                           "tokens (--model max_positions); lower --block-size or raise max_positions")  # fmt: skip
        return cfg

    def describe(self) -> str:
        """Token counts and the vocabulary."""
        assert self.data is not None
        return self.data.describe()

    def data_summary(self) -> dict[str, Any] | None:
        """The data directory read, and its tokenizer."""
        assert self.data is not None
        return data_record(self.cfg, self.data)

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Tensor:
        """`budget` random windows of the training split (numbered across its shards)."""
        assert self.train is not None
        return random_windows(self.train.window_count(self.cfg.window), budget, generator)

    def collate(self, examples: Sequence[Any], device: torch.device) -> LMBatch:
        """The windows drawn."""
        assert self.train is not None and isinstance(examples, Tensor)
        x, y = self.train.windows(examples, self.cfg.window)
        return LMBatch(to_device(x, device), to_device(y, device))

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """The validation loss by `qkv eval`'s protocol (periodically over eval_tokens tokens, if set), and its bits
        per byte where the tokenizer says each token's bytes."""
        assert self.data is not None
        cfg = self.cfg
        max_tokens = cfg.final_budget(ev.tokens_seen) if ev.full else cfg.eval_tokens
        rows = eval_rows(cfg.data.batch_size, cfg.window, self.data.tokenizer.vocab_size)
        with ev.autocast():
            sums = evaluate_sums(ev.forward, self.data.split("val"), cfg.window, rows, ev.ctx.device, max_tokens,
                                 ev.ctx, self.token_bytes, ev.progress)  # fmt: skip
        return {"val_loss": sums.mean, **_bpb(sums)}

    @property
    def partial_evaluation(self) -> bool:
        """Periodic evaluations read fewer tokens than the last one."""
        return self.cfg.eval_tokens != self.cfg.final_eval_tokens

    def summary(self, result: TrainResult) -> str:
        """The final validation loss and perplexity, a sample of the best weights, and what to try next."""
        loss, bpb = result.val_loss, result.final.get("val_bpb")
        also = "" if bpb is None else f", {bpb:.3f} bits per byte"
        lines = [f"\nvalidation loss {loss:.4f} (perplexity {perplexity(loss):.2f}{also}) after {result.step} steps, "
                 f"{result.took()} — run saved in {result.run_dir}"]  # fmt: skip
        if self.cfg.sample_tokens > 0:
            lines += self.sample(result.run_dir)
        prompt, q = ("ROMEO:" if self.cfg.source is None else "The"), program()
        lines.append(f"more: {q} generate {result.run_dir} --prompt '{prompt}'  |  {q} eval {result.run_dir}  |  "
                     f"{q} explore {result.run_dir}")  # fmt: skip
        return "\n".join(lines)

    def loaded(self, run_dir: Path) -> LMRun:
        """The run this task trained, loaded back (its best weights)."""
        return LMRun.load(run_dir)

    def sample(self, run_dir: Path) -> list[str]:
        """A sample of the best weights, framed: from a new line for characters, else after a BPE's end-of-text token
        (a document begins); a pretrained model fine-tuned on the embedded Shakespeare, from a speaker's name."""
        run = self.loaded(run_dir)
        tokenizer = run.require_tokenizer()
        eos = tokenizer.eos_id
        prompt = "\n" if eos is None and "\n" in getattr(tokenizer, "chars", "\n") else tokenizer.decode([eos or 0])
        shown = "ROMEO:" if self.cfg.init_from is not None and self.cfg.source is None else ""
        sample = run.generate(shown or prompt, self.cfg.sample_tokens, temperature=0.8, seed=self.cfg.system.seed)
        return ["\n--- sample " + "-" * 60, shown + sample, "-" * 71]


@dataclass
class LMRun(LoadedRun):
    """A trained language model: generate text, or measure the validation loss."""

    model: DecoderLM
    config: LMConfig
    config_class: ClassVar[type[RunConfig[Any]]] = LMConfig

    def generate(self, prompt: str, max_new_tokens: int = 200, **sampling: Any) -> str:
        """The prompt's continuation as text, up to end-of-text (qkv.engine); sampling: Sampling's fields (temperature
        0.8 unless given)."""
        sampled, tokenizer = Sampling(**{"temperature": 0.8, **sampling}), self.require_tokenizer()
        (tokens,) = continuations(self.model, tokenizer, tokenizer.encode(prompt), max_new_tokens, sampled)
        return tokenizer.decode(tokens)

    def validation_data(self) -> TokenSplit:
        """The run's validation split, as training read it (no training shard is opened, nothing is tokenized
        when the data directory is still there)."""
        cfg = self.config
        tokenizer = self.require_tokenizer()
        return text_data(cfg, self.directory, tokenizer, tokenizer, cfg.tokenizer or "char").split("val")

    def evaluate(self, options: EvalOptions) -> list[str]:
        """Loss, perplexity and bits per byte (where the tokenizer says its tokens' bytes) over the validation split
        (final_eval_tokens of it, if set), in windows of the training block size: training's last evaluation."""
        options.refuse_beam_options(self.task)
        cfg, val, budget = self.config, self.validation_data(), self.final_budget()
        rows = eval_rows(options.batch_size, cfg.window, self.model.embed.vocab_size)
        show = ProgressLine(log_every_s=10)
        sums = evaluate_sums(self.model, val, cfg.window, rows, self.device, budget,
                             token_bytes=token_bytes_of(self.require_tokenizer()),
                             progress=batch_progress(show, "evaluating"))  # fmt: skip
        show.close_if_drawn()
        loss, bpb = sums.mean, _bpb(sums).get("val_bpb")
        also = "" if bpb is None else f"  bits per byte {bpb:.3f}"
        read = len(val) if budget is None else min(len(val), budget)
        return [f"val loss {loss:.4f}  perplexity {perplexity(loss):.3f}{also}  ({read - 1:,} positions, "
                f"block size {cfg.window}, {self.checkpoint} weights)"]  # fmt: skip

    def final_budget(self) -> int | None:
        """The tokens training's last evaluation read (None: the whole split), from the tokens the run trained on."""
        rows = read_metrics(self.directory)
        return self.config.final_budget(rows[-1].get("tokens_seen") if rows else None)

    def val_loss(self, batch_size: int = 32, val: TokenSplit | None = None) -> float:
        """The validation loss training's last evaluation measures: final_eval_tokens of the split, or all of it."""
        cfg = self.config
        val = self.validation_data() if val is None else val
        rows = eval_rows(batch_size, cfg.window, self.model.embed.vocab_size)
        return evaluate_loss(self.model, val, cfg.window, rows, self.device, self.final_budget())


def _bpb(sums: LossSums) -> dict[str, float]:
    """{"val_bpb": bits per byte} when the sums counted the text's bytes; nothing when the tokenizer cannot say them."""
    return {"val_bpb": sums.bits_per_byte()} if sums.text_bytes > 0 else {}


def new_tokenizer(cfg: LMConfig) -> Tokenizer | TokenizerRecipe:
    """The tokenizer a new run on a text file gets: a char or BPE vocabulary of the text, or GPT-2's."""
    if cfg.tokenizer == "gpt2":
        from qkv.tokenizers.gpt2 import gpt2_tokenizer

        return gpt2_tokenizer()
    return TokenizerRecipe("char") if cfg.tokenizer in (None, "char") else TokenizerRecipe("bpe", cfg.vocab_size)
