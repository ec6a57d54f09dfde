"""The masked-language-model task (`qkv train mlm`): BERT's pretraining of the encoder-only EncoderModel.

An encoder sees the whole sequence at once (no causal mask), so it cannot be trained to predict the
next token: it would simply read it. BERT hides some tokens instead and trains the encoder to restore
them from both sides. Per window of block_size tokens, as in BERT's create_pretraining_data.py:
- 15 % of the positions are selected (round(0.15 · T), at least one);
- of those, 80 % are replaced by <mask>, 10 % by a random token and 10 % left as they are, so the
  model cannot learn that only <mask> positions matter (there is no <mask> when it is used later);
- the loss is the cross-entropy of the selected positions only, and so is the masked-token accuracy.
The evaluation masks the validation windows with a fixed seed, so every evaluation sees the same task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.config import option
from qkv.data.batches import random_windows
from qkv.data.options import TokenizerRecipe
from qkv.data.tokens import TokenData, TokenSplit
from qkv.errors import QkvError
from qkv.io.invocation import program
from qkv.models import EmbeddingConfig, EncoderConfig, EncoderModel
from qkv.norms import NormConfig
from qkv.positional import RotaryPositionsConfig
from qkv.tasks.base import EvalOptions, LoadedRun
from qkv.tasks.text import TextConfig, check_window_fits, data_record, text_data, vocabulary
from qkv.tokenizers import ENDOFTEXT, Tokenizer, load_tokenizer
from qkv.training import Evaluation, RunConfig, Task, TrainResult
from qkv.training.config import DataConfig, EvalConfig, ScheduleConfig

MASK = "<mask>"
SPECIAL_TOKENS = (ENDOFTEXT, MASK)  # ids 0 and 1; random replacements are drawn from the other ids


@dataclass(frozen=True, kw_only=True)
class MLMConfig(TextConfig[EncoderConfig]):
    """How to pretrain a masked language model: the shared settings plus its text, vocabulary and masking."""

    task: ClassVar[str] = "mlm"
    model_class: ClassVar[type[EncoderConfig]] = EncoderConfig
    paths: ClassVar[tuple[str, ...]] = ("source",)

    mask_prob: float = option(0.15, "share of positions selected for prediction (BERT's 15 %)", fixed=True)

    def check(self) -> None:
        """The shared checks, then the masking's."""
        super().check()
        if not 0 < self.mask_prob < 1:
            raise QkvError(f"mask-prob must be in (0, 1), got {self.mask_prob}")

    def n_selected(self, length: int) -> int:
        """How many positions of a window of `length` tokens are predicted (BERT: round(p · T), at least 1)."""
        return max(1, round(self.mask_prob * length))


def recipe() -> MLMConfig:
    """The language model's modern block as an encoder with BERT's masked-LM head: 4 layers × 128 wide, rotary
    positions, pre-norm RMSNorm, SwiGLU, no biases or dropout, and no token types, embedding norm or pooler."""
    block = BlockConfig(attention=MultiHeadAttentionConfig(n_heads=4, bias=False, dropout=0.0),
                        ffn=FeedForwardConfig(activation="swiglu", bias=False, dropout=0.0),
                        norm=NormConfig(kind="rms", bias=False), norm_placement="pre", dropout=0.0)  # fmt: skip
    model = EncoderConfig(d_model=128, max_positions=None,  # None: the block size
                          embedding=EmbeddingConfig(positions=RotaryPositionsConfig(), dropout=0.0),
                          encoder=StackConfig(n_layers=4, block=block), pooler=False, mlm_head=True)  # fmt: skip
    return MLMConfig(model=model, vocab_size=384, data=DataConfig(batch_size=32),
                     schedule=ScheduleConfig(max_steps=600, max_time=270.0), eval=EvalConfig(interval=300))


def mask_tokens(
    ids: Tensor, order: Tensor, choice: Tensor, random_ids: Tensor, n_selected: int, mask_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """BERT's masking of windows ids (B, T) → (inputs (B, T), positions (B, k), labels (B, k)), from uniform draws.

    order (B, T): the n_selected = k positions with the smallest values are predicted (positions, in order);
    choice (B, T) in [0, 1): < 0.8 → <mask>, < 0.9 → random_ids, else the token stays; labels are the
    original ids at the predicted positions.
    """
    positions = order.argsort(dim=1)[:, :n_selected].sort(dim=1).values  # (B, k)
    selected = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, positions, True)
    inputs = torch.where(selected & (choice < 0.8), mask_id, ids)
    inputs = torch.where(selected & (choice >= 0.8) & (choice < 0.9), random_ids, inputs)
    return inputs, positions, ids.gather(1, positions)


@dataclass
class MaskedDraw:
    """A step's windows and every random number their masking needs (sliceable into micro-batches)."""

    starts: Tensor  # (N,)
    order: Tensor  # (N, T) uniform
    choice: Tensor  # (N, T) uniform
    random_ids: Tensor  # (N, T) ids the random replacements take

    def __len__(self) -> int:
        """Windows."""
        return len(self.starts)

    def __getitem__(self, rows: slice) -> MaskedDraw:
        """Some of the windows, with their draws."""
        return MaskedDraw(self.starts[rows], self.order[rows], self.choice[rows], self.random_ids[rows])


@dataclass
class MaskedBatch:
    """Masked inputs (B, T), the positions to restore (B, k) and the original tokens there, the labels (B, k)."""

    inputs: Tensor
    positions: Tensor
    labels: Tensor

    @property
    def n_targets(self) -> int:
        """B · k."""
        return self.labels.numel()

    @property
    def n_tokens(self) -> int:
        """B · T."""
        return self.inputs.numel()

    def to(self, device: torch.device) -> MaskedBatch:
        """The same batch on `device`."""
        return MaskedBatch(self.inputs.to(device), self.positions.to(device), self.labels.to(device))


class MLMTask(Task):
    """Masked-token prediction with an EncoderModel and BERT's masking; the best validation loss keeps it."""

    name = "mlm"

    def __init__(self, cfg: MLMConfig) -> None:
        super().__init__(cfg)
        self.cfg: MLMConfig = cfg
        self.data: TokenData | None = None
        self.train: TokenSplit | None = None
        self.mask_id = 1
        self._val_batches: list[MaskedBatch] = []

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """<data file name, or shakespeare>-mlm."""
        assert isinstance(cfg, MLMConfig)
        return f"{cfg.text_name()}-mlm"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """The data: a BPE vocabulary with <mask> (learnt from a text file's training split, or the run's or the
        data directory's); check a window fits."""
        if self.cfg.data_dir and not resume and self.cfg.vocab_size != recipe().vocab_size:
            raise QkvError(f"{self.cfg.source} is a data directory: its tokenizer is the one it was prepared with; "
                           "drop --vocab-size")  # fmt: skip
        stored = load_tokenizer(run_dir) if resume else None
        self.data = text_data(self.cfg, run_dir if resume else None, stored, new_tokenizer(self.cfg), "bpe")
        self.tokenizer = self.data.tokenizer
        self.mask_id = mask_id_of(self.tokenizer)
        self.train = self.data.split("train")
        check_window_fits(self.cfg.window, self.train)

    def model_config(self) -> EncoderConfig:
        """The run's encoder with the masked-LM head over the tokenizer's vocabulary, a context of block_size tokens
        unless it has one."""
        assert self.tokenizer is not None
        model = self.cfg.model
        vocab = vocabulary(model.vocab_size, self.tokenizer)
        return replace(model, vocab_size=vocab, max_positions=model.max_positions or self.cfg.window)

    def describe(self) -> str:
        """Token counts, the vocabulary, and how many positions of a window are predicted."""
        assert self.data is not None
        return f"{self.data.describe()}, {self.cfg.n_selected(self.cfg.window)} predicted per window"

    def data_summary(self) -> dict[str, Any] | None:
        """The data directory read, and its tokenizer."""
        assert self.data is not None
        return data_record(self.cfg, self.data)

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> MaskedDraw:
        """`budget` random windows and the uniform draws that mask them."""
        assert self.train is not None and self.tokenizer is not None
        t = self.cfg.window
        starts = random_windows(self.train.window_count(t), budget, generator)
        order, choice = torch.rand(budget, t, generator=generator), torch.rand(budget, t, generator=generator)
        random_ids = torch.randint(len(SPECIAL_TOKENS), self.tokenizer.vocab_size, (budget, t), generator=generator)
        return MaskedDraw(starts, order, choice, random_ids)

    def collate(self, examples: Sequence[Any], device: torch.device) -> MaskedBatch:
        """The windows, masked."""
        assert self.train is not None and isinstance(examples, MaskedDraw)
        ids, _ = self.train.windows(examples.starts, self.cfg.window)
        n = self.cfg.n_selected(self.cfg.window)
        masked = mask_tokens(ids, examples.order, examples.choice, examples.random_ids, n, self.mask_id)
        return MaskedBatch(*masked).to(device)

    def logits(self, model: Callable[..., Any], batch: MaskedBatch) -> Tensor:
        """The logits (B, k, V) of the selected positions."""
        return cast(Tensor, model(batch.inputs, mlm_positions=batch.positions).logits)

    def criterion(self, logits: Tensor, batch: MaskedBatch) -> Tensor:
        """Cross-entropy of the selected positions."""
        return F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten())

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """Loss and masked-token accuracy on the validation windows, masked with a fixed seed."""
        assert self.data is not None
        with ev.autocast():
            loss, accuracy, _ = masked_scores(ev.forward, self.validation_batches(ev.ctx.device))
        return {"val_loss": loss, "val_accuracy": accuracy}

    def validation_batches(self, device: torch.device) -> list[MaskedBatch]:
        """The validation split in consecutive windows, each masked by BERT's rule from a fixed seed (made once)."""
        assert self.data is not None
        if not self._val_batches or self._val_batches[0].inputs.device != device:
            val = self.data.split("val")
            self._val_batches = masked_windows(val[0 : len(val)], self.cfg, self.data.tokenizer,
                                               self.cfg.data.batch_size, device)  # fmt: skip
        return self._val_batches

    def baseline(self) -> float:
        """The accuracy of always predicting the training split's commonest token, on the validation targets."""
        assert self.data is not None
        device = self._val_batches[0].inputs.device if self._val_batches else torch.device("cpu")
        return baseline_accuracy(commonest_token(self.data), self.validation_batches(device))

    def summary(self, result: TrainResult) -> str:
        """Accuracy against the commonest-token baseline, a few restored tokens, and what to try next."""
        accuracy, base = result.final["val_accuracy"], self.baseline()
        lines = [f"\nmasked-token accuracy {accuracy:.1%} (always guessing the commonest token: {base:.1%}, "
                 f"{accuracy / base:.1f}×), val loss {result.val_loss:.4f} after {result.step} steps, "
                 f"{result.took()} — run saved in {result.run_dir}"]  # fmt: skip
        run = MLMRun.load(result.run_dir)
        for text in ("My lord, I <mask> you.", "What is your <mask>?"):
            lines.append(f"{text!r} → {run.fill_mask(text)}")
        q = program()
        lines.append(f"more: {q} eval {result.run_dir}   |   {q} lab attention-map {result.run_dir} --text 'ROMEO:'")
        return "\n".join(lines)


def mask_id_of(tokenizer: Tokenizer) -> int:
    """The id of <mask>, or a one-line error for a tokenizer without one."""
    ids = [tokenizer.encode(MASK)] if tokenizer.kind == "bpe" else []
    if not ids or len(ids[0]) != 1:
        raise QkvError(f"a masked-language-model run needs a BPE tokenizer with the special token {MASK}: prepare the "
                       f"data with `qkv prepare … --tokenizer bpe --special-tokens '{ENDOFTEXT},{MASK}'`")  # fmt: skip
    return ids[0][0]


def new_tokenizer(cfg: MLMConfig) -> TokenizerRecipe:
    """A new run's BPE, learnt from a text file's training split, with <mask> among its special tokens."""
    return TokenizerRecipe("bpe", cfg.vocab_size, special_tokens=SPECIAL_TOKENS)


def masked_windows(
    ids: Tensor, cfg: MLMConfig, tokenizer: Tokenizer, batch_size: int, device: torch.device
) -> list[MaskedBatch]:
    """Consecutive windows of block_size ids (the last one shorter), masked by BERT's rule, in batches.

    The draws come from a generator seeded by cfg.seed, window by window, so the masks do not depend on
    the batch size: training's evaluation and `qkv eval --batch-size N` score the same task.
    """
    mask_id, generator, t = mask_id_of(tokenizer), torch.Generator().manual_seed(cfg.system.seed), cfg.window
    full = len(ids) // t * t
    windows = [ids[:full].view(-1, t)] + ([ids[full:][None]] if len(ids) > full else [])  # (N, T), (1, r)
    batches = []
    for group in windows:
        order, choice = torch.rand(group.shape, generator=generator), torch.rand(group.shape, generator=generator)
        random_ids = torch.randint(len(SPECIAL_TOKENS), tokenizer.vocab_size, group.shape, generator=generator)
        masked = mask_tokens(group, order, choice, random_ids, cfg.n_selected(group.shape[1]), mask_id)
        for rows in range(0, len(group), batch_size):
            batches.append(MaskedBatch(*(m[rows : rows + batch_size] for m in masked)).to(device))
    return batches


@torch.no_grad()
def masked_scores(model: Callable[..., Any], batches: list[MaskedBatch]) -> tuple[float, float, int]:
    """Mean loss, accuracy and count over the predicted positions of the batches."""
    total, correct, count = 0.0, 0, 0
    for batch in batches:
        logits = model(batch.inputs, mlm_positions=batch.positions).logits.float()  # (B, k, V)
        total += float(F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum"))
        correct += int((logits.argmax(-1) == batch.labels).sum())
        count += batch.n_targets
    return total / count, correct / count, count


def commonest_token(data: TokenData) -> int:
    """The training split's commonest token, as `qkv prepare` counted it (llm.c's shards have no <mask> for MLM)."""
    return int(data.meta["commonest_train_token"])


def baseline_accuracy(commonest: int, batches: list[MaskedBatch]) -> float:
    """How often the training split's commonest token is the answer at the batches' predicted positions."""
    labels = torch.cat([b.labels.flatten().cpu() for b in batches])
    return float((labels == commonest).float().mean())


@dataclass
class MLMRun(LoadedRun):
    """A trained masked language model: restore masked tokens, or measure accuracy on the validation split."""

    model: EncoderModel
    config: MLMConfig
    config_class: ClassVar[type[RunConfig[Any]]] = MLMConfig

    @torch.no_grad()
    def fill_mask(self, text: str, top_k: int = 3) -> list[list[str]]:
        """For each <mask> in the text, the top_k tokens the model would put there.

        A byte-level BPE token carries the space before a word (" lord"), so the space before a <mask>
        belongs to the masked token: "I <mask> you" asks for the token after "I", space included.
        """
        tokenizer = self.require_tokenizer()
        text = text.replace(f" {MASK}", MASK)
        ids = tokenizer.encode_tensor(text)[None, : self.config.window].to(self.device)
        where = (ids[0] == mask_id_of(tokenizer)).nonzero().flatten()
        logits = self.model(ids, mlm_positions=where[None]).logits  # (1, masks, V)
        assert logits is not None
        return [[tokenizer.decode([int(i)]) for i in row.topk(top_k).indices] for row in logits[0]]

    def evaluate(self, options: EvalOptions) -> list[str]:
        """Masked-token accuracy and loss on the validation split, against the commonest-token baseline."""
        options.refuse_beam_options(self.task)
        tokenizer = self.require_tokenizer()
        cfg = self.config
        data = text_data(cfg, self.directory, tokenizer, tokenizer, "bpe")
        val = data.split("val")
        batches = masked_windows(val[0 : len(val)], cfg, tokenizer, options.batch_size, self.device)
        loss, accuracy, count = masked_scores(self.model, batches)
        base = baseline_accuracy(commonest_token(data), batches)
        return [
            f"masked-token accuracy {accuracy:.4f}  loss {loss:.4f}  ({count:,} predicted positions, "
            f"{self.checkpoint} weights); always the commonest token: {base:.4f} ({accuracy / base:.1f}×)"
        ]
