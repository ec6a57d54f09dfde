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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.blocks.lora import DEFAULT_TARGETS, add_lora
from qkv.chat import is_chat_file
from qkv.config import DecoderLMConfig
from qkv.data.batches import random_windows, to_device
from qkv.data.options import TokenizerRecipe
from qkv.data.tokens import TokenData, TokenSplit
from qkv.errors import QkvError
from qkv.finetune import Base, check_reference, load_base, load_lora_run, lora_spec_of
from qkv.finetune.settings import FINETUNE_DEFAULTS, check_data_tokenizer, finetuned_config
from qkv.generation import Sampling, stream
from qkv.io.run_dir import read_run_config
from qkv.models import DecoderLM, QkvModel
from qkv.tasks.base import EvalOptions, LoadedRun, read_tokenizer
from qkv.tasks.text import TextConfig, check_window_fits, data_record, text_data
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.training import Evaluation, RunConfig, Task, TrainResult, evaluate_loss, evaluate_sums, option, perplexity
from qkv.training.config import OPTIMIZERS, absolute, dashed
from qkv.training.evaluate import LossSums, eval_rows, token_bytes_of

TOKENIZERS = ("char", "bpe", "gpt2")  # of a text file; a data directory has its own
CHAT_BLOCK_SIZE = 1024  # conversation data's context: longer conversations are dropped

# The default recipe is a speedrun (benchmarks/SPEEDRUN.md): the fastest way found on a 2-core CPU to the
# full-validation loss nanoGPT's CPU recipe ends at on the embedded Shakespeare (1.96): nanoGPT's width (128)
# with a modern block, three layers instead of four and one key/value head (multi-query attention: fewer
# multiply-adds per token), Muon for the blocks' matrices at a high learning rate, windows of 128 characters
# in batches of 8 and a cosine schedule as long as the run; periodic evaluations read a sample of the
# validation split, the last one all of it.

DEFAULT_MODEL: dict[str, Any] = {
    "n_layers": 3,
    "d_model": 128,
    "n_heads": 4,
    "n_kv_heads": 1,
    "positions": "rotary",
    "norm": "rms",
    "activation": "swiglu",
    "bias": False,
    "dropout": 0.0,
}


@dataclass(kw_only=True)
class LMConfig(TextConfig):
    """How to train a language model: the shared settings plus its text, tokenizer, context and sample."""

    task: ClassVar[str] = "lm"
    model_config: ClassVar[type[DecoderLMConfig]] = DecoderLMConfig
    default_model: ClassVar[dict[str, Any]] = DEFAULT_MODEL
    newton_schulz_steps: ClassVar[int] = 4  # as good as 5 here, and 6 % faster a step (benchmarks/SPEEDRUN.md)

    model: dict[str, Any] = option(factory=dict, help="DecoderLMConfig fields over the recipe's", fixed=True)
    tokenizer: str | None = option(None, "a text file's: char, bpe (a byte-level BPE learnt from its training split) "
                                   "or gpt2; none: char (a data directory has its own)", fixed=True,
                                   choices=TOKENIZERS)  # fmt: skip
    vocab_size: int = option(1024, "the BPE vocabulary's size (bpe only)", fixed=True)
    block_size: int = option(128, "context length in tokens", fixed=True)
    max_steps: int = option(350, "optimiser steps (the schedule's length)")
    lr: float = option(1e-2, "peak learning rate")
    optimizer: str = option("muon", "adamw, or muon: Muon for the blocks' matrices, AdamW for the rest", fixed=True,
                            choices=OPTIMIZERS)  # fmt: skip
    eval_interval: int = option(100, "steps between evaluations and checkpoints")
    eval_tokens: int | None = option(8192, "validation tokens read by periodic evaluations, spread over the split "
                                     "(none: all)")  # fmt: skip
    final_eval_tokens: int | None = option(None, "validation tokens read by the last evaluation and `qkv eval` "
                                           "(none: all)")  # fmt: skip
    sample_tokens: int = option(400, "tokens sampled when training ends (0 = none)")
    init_from: str | None = option(None, "fine-tune this checkpoint: a .gguf file, a Hugging Face directory, a `qkv "
                                   "convert` directory or a qkv run; its architecture and tokenizer are the run's",
                                   fixed=True)  # fmt: skip
    lora_rank: int | None = option(None, "LoRA: train rank-R adapters beside the frozen weights of --init-from "
                                   "(none: train every weight)", fixed=True)  # fmt: skip
    lora_alpha: float | None = option(None, "LoRA's α: the update is scaled by α / rank (none: 2 × rank)", fixed=True)
    lora_dropout: float = option(0.0, "LoRA: dropout on the adapters' input", fixed=True)
    chat_template: str | None = option(None, "a Jinja chat template file for conversation data (--data chat.jsonl) "
                                       "on a checkpoint without one", fixed=True)  # fmt: skip
    lora_targets: str = option(",".join(DEFAULT_TARGETS), "LoRA: the Linear layers adapted, comma-separated (a "
                               "plain name matches a module name's last part, a regex the whole name)",
                               fixed=True)  # fmt: skip

    def recipe(self) -> dict[str, Any]:
        """The speedrun's model for a new model; nothing for a fine-tuning run (its checkpoint's model)."""
        return {} if self.init_from is not None else super().recipe()

    def __post_init__(self) -> None:
        """The shared checks, then the language model's own."""
        if self.init_from is not None:  # fine-tuning's defaults for the settings not given, never the speedrun's
            for name, value in FINETUNE_DEFAULTS[self.lora_rank is not None].items():
                if name not in self.given:
                    setattr(self, name, value)
            self.init_from = absolute(self.init_from)
            if is_chat_file(self.data) and "block_size" not in self.given:
                self.block_size = CHAT_BLOCK_SIZE  # whole conversations, not windows: the longest that fit
        self.chat_template = absolute(self.chat_template)
        if self.chat_template is not None and not is_chat_file(self.data):
            raise QkvError("--chat-template renders conversations: give --data a JSON Lines file of "
                           '{"messages": [{"role": …, "content": …}, …]}')  # fmt: skip
        if self.lora_rank is not None and self.lora_alpha is None:
            self.lora_alpha = 2.0 * self.lora_rank
        super().__post_init__()
        self._check_finetuning()
        for name in ("eval_tokens", "final_eval_tokens"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise QkvError(f"{name.replace('_', '-')} must be ≥ 2, got {value}")
        if self.sample_tokens < 0:
            raise QkvError(f"sample-tokens must be ≥ 0, got {self.sample_tokens}")

    def _check_finetuning(self) -> None:
        """--init-from fixes the architecture and the tokenizer; the LoRA settings need it and a valid spec."""
        unset = {"lora_rank": None, "lora_alpha": None, "lora_dropout": 0.0, "lora_targets": ",".join(DEFAULT_TARGETS)}
        lora = sorted(n for n, value in unset.items() if getattr(self, n) != value)  # (a stored config gives them all)
        if self.lora_rank is not None:
            lora_spec_of(self.to_dict())  # refuses a rank below 1, a bad dropout, alpha or regex, no targets
            if self.strategy == "fsdp":
                raise QkvError("LoRA trains on one process or with --strategy ddp (its frozen base is not sharded); "
                               "drop --strategy fsdp")  # fmt: skip
        if self.init_from is None:  # (on --resume the stored run's settings come later, and are checked then)
            if not self.resume and (self.lora_rank is not None or lora):
                raise QkvError("--lora-rank and the other LoRA settings adapt a pretrained model; add --init-from "
                               "CHECKPOINT")  # fmt: skip
            return
        defaults = {"tokenizer": None, "vocab_size": 1024}  # a stored run's config holds these, unset
        contradicting = sorted(n for n, unset in defaults.items() if getattr(self, n) != unset)
        if contradicting:
            flags = " and ".join(f"--{dashed(n)}" for n in contradicting)
            raise QkvError(f"{flags} contradict(s) --init-from: the tokenizer is the checkpoint's; drop {flags}")
        if self.lora_rank is None and lora:
            raise QkvError(f"--{dashed(lora[0])} needs --lora-rank R (without it every weight trains)")


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
    """Next-token prediction with a DecoderLM."""

    name = "lm"

    def __init__(self, cfg: LMConfig, stored_model: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, stored_model)
        self.cfg: LMConfig = cfg
        self.data: TokenData | None = None
        self.train: TokenSplit | None = None
        self.base: Base | None = None  # the checkpoint a fine-tuning run starts from
        self.stored_base: dict[str, Any] | None = None  # a resumed run's record of it
        self.token_bytes: Tensor | None = None  # each token's UTF-8 bytes, for bits per byte (None: not known)

    @classmethod
    def run_name(cls, cfg: RunConfig) -> str:
        """<data file or directory name, or shakespeare>-<tokenizer>."""
        assert isinstance(cfg, LMConfig)
        if cfg.init_from is not None:  # e.g. shakespeare-SmolLM2-135M-Instruct.Q4_1-lora
            return f"{cfg.text_name()}-{Path(cfg.init_from).stem}{'-lora' if cfg.lora_rank is not None else ''}"
        return f"{cfg.text_name()}-{'data' if cfg.data_dir else cfg.tokenizer or 'char'}"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Open the data (a text file is prepared with the run's own tokenizer on resume); check a window fits.

        A fine-tuning run loads its checkpoint first (on resume too, for a LoRA run: only its adapters were saved),
        whose tokenizer the data must have been prepared with.
        """
        cfg = self.cfg
        if cfg.init_from is not None and (not resume or cfg.lora_rank is not None):
            self.load_base(run_dir, resume)
        elif resume:
            self.stored_base = read_run_config(run_dir).get("base")
        stored = load_tokenizer(run_dir) if resume else None
        new = self.base.tokenizer if self.base is not None else new_tokenizer(cfg)
        name = Path(cfg.init_from).name if cfg.init_from is not None else cfg.tokenizer or "char"
        if cfg.init_from is not None and self.base is not None and not resume and cfg.data_dir:
            check_data_tokenizer(str(cfg.data), self.base.tokenizer, cfg.init_from)
        self.data = text_data(cfg, run_dir if resume else None, stored, new, name)
        self.tokenizer = self.data.tokenizer
        self.token_bytes = token_bytes_of(self.tokenizer)
        self.train = self.data.split("train")
        check_window_fits(self.cfg.block_size, self.train)

    def load_base(self, run_dir: Path, resume: bool) -> None:
        """The checkpoint --init-from names; on resume, the very weights the run was trained on (hash-checked)."""
        assert self.cfg.init_from is not None
        reference = self.stored_base = read_run_config(run_dir).get("base") if resume else None
        if reference is not None:
            check_reference(reference, run_dir)
        self.base = load_base(self.cfg.init_from, reference)

    @classmethod
    def for_config(cls, cfg: RunConfig) -> type[Task]:
        """ChatTask for a JSON Lines file of conversations; this task for text."""
        from qkv.tasks.chat import ChatTask

        assert isinstance(cfg, LMConfig)
        return ChatTask if is_chat_file(cfg.data) else cls

    def new_model_config(self) -> DecoderLMConfig:
        """A DecoderLM over the tokenizer's vocabulary with a context of block_size tokens (a fine-tuning run: its
        checkpoint's, with only dropout changeable)."""
        assert self.tokenizer is not None
        if self.base is not None:
            model_cfg = finetuned_config(self.base.model.cfg, self.cfg.model)
        else:
            model_cfg = self.cfg.build_model_config(vocab_size=self.tokenizer.vocab_size,
                                                    max_positions=self.cfg.block_size)  # fmt: skip
        assert isinstance(model_cfg, DecoderLMConfig)
        if model_cfg.max_positions < self.cfg.block_size:
            raise QkvError(f"model max_positions={model_cfg.max_positions} is smaller than the block size "
                           f"{self.cfg.block_size}; drop --model max_positions or lower --block-size")  # fmt: skip
        return model_cfg

    def build_model(self) -> QkvModel:
        """A new model; a fine-tuning run's checkpoint (with LoRA adapters beside its frozen weights, if asked)."""
        if self.base is None:
            return super().build_model()
        cfg, model = self.model_config(), self.base.model
        if cfg != model.cfg:
            model = DecoderLM(cfg)  # type: ignore[arg-type]
            model.load_state_dict(self.base.model.state_dict())
        spec = lora_spec_of(self.cfg.to_dict())
        if spec is not None:
            add_lora(model, spec)
        return model.train()

    def base_summary(self) -> dict[str, Any] | None:
        """The checkpoint a fine-tuning run started from: path, sha256 of its weights, kind, metadata."""
        return self.base.reference if self.base is not None else self.stored_base

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
        return random_windows(self.train.window_count(self.cfg.block_size), budget, generator)

    def collate(self, examples: Sequence[Any], device: torch.device) -> LMBatch:
        """The windows drawn."""
        assert self.train is not None and isinstance(examples, Tensor)
        x, y = self.train.windows(examples, self.cfg.block_size)
        return LMBatch(to_device(x, device), to_device(y, device))

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """The validation loss by `qkv eval`'s protocol (periodically over eval_tokens tokens, if set), and its bits
        per byte where the tokenizer says each token's bytes."""
        assert self.data is not None
        cfg, max_tokens = self.cfg, self.cfg.final_eval_tokens if ev.full else self.cfg.eval_tokens
        rows = eval_rows(cfg.batch_size, cfg.block_size, self.data.tokenizer.vocab_size)
        with ev.autocast():
            sums = evaluate_sums(ev.forward, self.data.split("val"), cfg.block_size, rows, ev.ctx.device, max_tokens,
                                 ev.ctx, self.token_bytes)  # fmt: skip
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
                 f"{result.elapsed_s:.0f} s — run saved in {result.run_dir}"]  # fmt: skip
        if self.cfg.sample_tokens > 0:
            run = LMRun.load(result.run_dir)
            tokenizer = run.require_tokenizer()
            # A new line for characters; a BPE's end-of-text token, after which a document begins; a pretrained
            # model fine-tuned on the embedded Shakespeare, a speaker's name (its end-of-text token ends a chat turn).
            eos = tokenizer.eos_id
            prompt = "\n" if eos is None and "\n" in getattr(tokenizer, "chars", "\n") else tokenizer.decode([eos or 0])
            shown = "ROMEO:" if self.cfg.init_from is not None and self.cfg.data is None else ""
            sample = run.generate(shown or prompt, self.cfg.sample_tokens, temperature=0.8, seed=self.cfg.seed)
            lines += ["\n--- sample " + "-" * 60, shown + sample, "-" * 71]
        run_dir = result.run_dir
        prompt = "ROMEO:" if self.cfg.data is None else "The"
        lines.append(f"more: qkv generate {run_dir} --prompt '{prompt}'  |  qkv eval {run_dir}  |  "
                     f"qkv explore {run_dir}")  # fmt: skip
        return "\n".join(lines)


@dataclass
class LMRun(LoadedRun):
    """A trained language model: generate text, or measure the validation loss."""

    model: DecoderLM
    config: LMConfig
    config_class: ClassVar[type[RunConfig]] = LMConfig

    @classmethod
    def load(cls, directory: Path, checkpoint: str = "best", device: str | torch.device = "cpu",
             stored: dict[str, Any] | None = None) -> LMRun:  # fmt: skip
        """A run directory's model; a LoRA run's base (hash-checked) with its adapters, merged."""
        stored = read_run_config(directory) if stored is None else stored
        if lora_spec_of(stored["training"]) is None:
            return super().load(directory, checkpoint, device, stored)
        model = load_lora_run(directory, stored, checkpoint)
        config = LMConfig.from_dict(stored["training"])
        assert isinstance(config, LMConfig)
        return cls(model.to(device), read_tokenizer(Path(directory)), config, Path(directory), checkpoint)

    def generate(self, prompt: str, max_new_tokens: int = 200, **sampling: Any) -> str:
        """The prompt's continuation as text; sampling: Sampling's fields (temperature 0.8 unless given)."""
        tokenizer = self.require_tokenizer()
        ids = tokenizer.encode_tensor(prompt)[None, :].to(self.device)
        steps = stream(self.model, ids, max_new_tokens, Sampling(**{"temperature": 0.8, **sampling}),
                       eos_id=tokenizer.eos_id)  # fmt: skip
        tokens = [int(t) for t in torch.stack(list(steps))[:, 0].tolist()] if max_new_tokens else []
        eos = tokenizer.eos_id
        return tokenizer.decode(tokens[: tokens.index(eos)] if eos in tokens else tokens)

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
        if is_chat_file(self.config.data):  # a chat run: the loss over its held-out conversations' replies
            from qkv.tasks.chat import evaluate_run

            return evaluate_run(self, options.batch_size)
        cfg, val = self.config, self.validation_data()
        rows = eval_rows(options.batch_size, cfg.block_size, self.model.cfg.vocab_size)
        sums = evaluate_sums(self.model, val, cfg.block_size, rows, self.device, cfg.final_eval_tokens,
                             token_bytes=token_bytes_of(self.require_tokenizer()))  # fmt: skip
        loss, bpb = sums.mean, _bpb(sums).get("val_bpb")
        also = "" if bpb is None else f"  bits per byte {bpb:.3f}"
        read = len(val) if cfg.final_eval_tokens is None else min(len(val), cfg.final_eval_tokens)
        return [f"val loss {loss:.4f}  perplexity {perplexity(loss):.3f}{also}  ({read - 1:,} positions, "
                f"block size {cfg.block_size}, {self.checkpoint} weights)"]  # fmt: skip

    def val_loss(self, batch_size: int = 32, val: TokenSplit | None = None) -> float:
        """The validation loss training's last evaluation measures: final_eval_tokens of the split, or all of it."""
        cfg = self.config
        val = self.validation_data() if val is None else val
        rows = eval_rows(batch_size, cfg.block_size, self.model.cfg.vocab_size)
        return evaluate_loss(self.model, val, cfg.block_size, rows, self.device, cfg.final_eval_tokens)


def _bpb(sums: LossSums) -> dict[str, float]:
    """{"val_bpb": bits per byte} when the sums counted the text's bytes; nothing when the tokenizer cannot say them."""
    return {"val_bpb": sums.bits_per_byte()} if sums.text_bytes > 0 else {}


def new_tokenizer(cfg: LMConfig) -> Tokenizer | TokenizerRecipe:
    """The tokenizer a new run on a text file gets: a char or BPE vocabulary of the text, or GPT-2's."""
    if cfg.tokenizer == "gpt2":
        from qkv.tokenizers.gpt2 import gpt2_tokenizer

        return gpt2_tokenizer()
    return TokenizerRecipe("char") if cfg.tokenizer in (None, "char") else TokenizerRecipe("bpe", cfg.vocab_size)
