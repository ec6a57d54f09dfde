"""The translation task (`qkv train translate`): the encoder–decoder Transformer of the paper, German → English.

Data: the embedded corpora (the Ding dictionary's example sentences and the Bible's verses, together by
default), or a TSV file of source<TAB>target pairs; one byte-level BPE vocabulary for both sides, trained
on the training split (or the vocabulary of the run or MarianMT model that --init-from names). Batches are
buckets of pairs of similar length holding about batch_size tokens per side; the loss is label-smoothed
cross-entropy per target token (padding excluded); the evaluation is the validation loss and the greedy
BLEU of the validation pairs, and the best BLEU keeps model.safetensors. The recipe trains the blocks'
matrices with Muon (qkv.training.optim); benchmarks/TRANSLATION.md measures each of its choices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, FeedForwardConfig, StackConfig
from qkv.config import option
from qkv.errors import QkvError
from qkv.extras import require
from qkv.io.invocation import program
from qkv.models import EmbeddingConfig, Transformer, TransformerConfig
from qkv.positional import SinusoidalPositionsConfig
from qkv.tasks.base import EvalOptions, LoadedRun, read_tokenizer
from qkv.tokenizers import Tokenizer
from qkv.training import Evaluation, RunConfig, Task, TrainResult
from qkv.training.config import DataConfig, EvalConfig, OptimConfig, ScheduleConfig
from qkv.translation.batching import (
    Seq2SeqBatch,
    Specials,
    batches_of,
    encode_pairs,
    length_buckets,
    make_batch,
    pad_sequences,
)
from qkv.translation.bible import split_bible
from qkv.translation.corpus import Splits, combine, split_de_en, split_pairs_file
from qkv.translation.decoding import COVERAGE_PENALTY, LENGTH_PENALTY, check_penalties, greedy_decode
from qkv.translation.metrics import corpus_bleu, corpus_chrf, paired_bootstrap_bleu
from qkv.translation.run import Translator, rescored, specials_of, train_tokenizer
from qkv.translation.step import batch_logits, evaluate_batches, label_smoothed_loss

Corpus = Literal["ding", "bible", "ding+bible"]  # the embedded German–English corpora (qkv/data/DE_EN.md, BIBLE.md)
DEFAULT_CORPUS = "ding+bible"  # everyday sentences and verses: the model learns both kinds of German


@dataclass(frozen=True, kw_only=True)
class TranslateConfig(RunConfig[TransformerConfig]):
    """How to train a translation model: the shared settings and its own."""

    task: ClassVar[str] = "translate"
    model_class: ClassVar[type[TransformerConfig]] = TransformerConfig
    paths: ClassVar[tuple[str, ...]] = ("source", "init_from")

    corpus: Corpus = option(DEFAULT_CORPUS, "the embedded corpus: the Ding sentences, the Bible's verses, or both",
                            fixed=True)  # fmt: skip
    source: str | None = option(None, "a UTF-8 file of source<TAB>target pairs (none: the embedded --corpus)",
                                fixed=True, flag="data")  # fmt: skip
    src_lang: str = option("de", "the source language's label, for display")
    tgt_lang: str = option("en", "the target language's label, for display")
    init_from: str | None = option(None, "start from the weights, model and tokenizer of this translation run or "
                                   "MarianMT (OPUS-MT) directory (none: from scratch)", fixed=True)  # fmt: skip
    vocab_size: int = option(4000, "the shared byte-level BPE vocabulary's size", fixed=True)
    label_smoothing: float = option(0.1, "label smoothing ε (the paper's)")
    beam_size: int = option(4, "beam size of `qkv translate` and `qkv eval` (1 = greedy)")
    length_penalty: float = option(LENGTH_PENALTY, "beam search: GNMT's length penalty α")
    coverage_penalty: float = option(COVERAGE_PENALTY, "beam search: GNMT's coverage penalty β (unattended "
                                     "source tokens)")  # fmt: skip

    def check(self) -> None:
        """The shared checks, then the translation task's own."""
        super().check()
        if self.vocab_size < 1 or self.beam_size < 1:
            raise QkvError(f"vocab-size and beam-size must be positive integers, got {self.vocab_size} and "
                           f"{self.beam_size}")  # fmt: skip
        if not 0 <= self.label_smoothing < 1:
            raise QkvError(f"label smoothing must be in [0, 1), got {self.label_smoothing}")
        check_penalties(self.length_penalty, self.coverage_penalty)
        if self.source is not None and self.corpus != DEFAULT_CORPUS:
            raise QkvError("--data and --corpus both name the training pairs; give one")

    def override(self, settings: Mapping[str, Any]) -> TranslateConfig:
        """The shared override; a run that starts --init-from takes that run's model and vocabulary as they are."""
        if settings.get("init_from") is not None and any(k == "vocab_size" or k.startswith("model") for k in settings):
            raise QkvError("--init-from takes the model and vocabulary of the run it names; leave --vocab-size and "
                           "the model options unset")  # fmt: skip
        return super().override(settings)

    def splits(self) -> Splits:
        """The run's train / validation / test pairs."""
        if self.source is not None:
            return split_pairs_file(self.source)
        corpora = {name: split() for name, split in (("bible", split_bible), ("ding", split_de_en))
                   if name in self.corpus.split("+")}  # fmt: skip
        return combine(corpora) if len(corpora) > 1 else next(iter(corpora.values()))


def recipe() -> TranslateConfig:
    """Sized for a 2-core CPU and a 15-minute budget: 2 + 2 pre-norm layers × 128 wide, 1.44 M parameters with the
    shared 4,000-token vocabulary, no dropout, Muon for the blocks' matrices with the paper's β₂
    (benchmarks/TRANSLATION.md has the measurements behind each choice)."""
    block = BlockConfig(attention=MultiHeadAttentionConfig(n_heads=4, dropout=0.0),
                        ffn=FeedForwardConfig(d_ff=512, dropout=0.0), norm_placement="pre", dropout=0.0)  # fmt: skip
    side = StackConfig(n_layers=2, block=block)
    model = TransformerConfig(d_model=128, embedding=EmbeddingConfig(positions=SinusoidalPositionsConfig(), scale=True,
                              dropout=0.0), encoder=side, decoder=side)  # fmt: skip
    return TranslateConfig(model=model, data=DataConfig(batch_size=1500), optim=OptimConfig(name="muon", beta2=0.98),
                           schedule=ScheduleConfig(max_steps=4000, max_time=840.0, min_lr=0.0, warmup_steps=200),
                           eval=EvalConfig(interval=2000))  # fmt: skip


def starting_point(path: str) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer that --init-from names: a translation run's, or a MarianMT (OPUS-MT) directory's."""
    from qkv.interop.marian import is_marian_dir

    if not is_marian_dir(path):
        from qkv.tasks import load  # the registry imports this module

        run = load(path, expect="translate")
        return run.model, run.require_tokenizer()
    from qkv.interop import from_hf
    from qkv.interop.marian import generation_settings
    from qkv.interop.marian_tokenizer import MarianTokenizer

    tokenizer, gen = MarianTokenizer(path), generation_settings(path)
    if (gen.pad, gen.start, gen.eos) != (tokenizer.pad_id, tokenizer.pad_id, tokenizer.eos_id):
        raise QkvError(f"{path}: qkv fine-tunes Marian models whose decoder starts with <pad> "
                       f"({tokenizer.pad_id}) and ends with </s> ({tokenizer.eos_id}); this one has start "
                       f"{gen.start}, pad {gen.pad}, end {gen.eos}")  # fmt: skip
    model = from_hf(path)
    assert isinstance(model, Transformer)
    return model, tokenizer


def validation_bleu(model: Transformer, batches: list[Seq2SeqBatch], translator: Translator) -> float:
    """Greedy BLEU over the validation batches (references decoded from the same tokens)."""
    sp, tokenizer = translator.specials, translator.tokenizer
    sources = [[t for t in row if t != sp.pad] for batch in batches for row in batch.src.tolist()]  # decoded together
    src = pad_sequences(sources, sp.pad).to(next(model.parameters()).device)
    hyps = [tokenizer.decode(ids).strip() for ids in greedy_decode(model, src, sp)]
    refs = [tokenizer.decode([t for t in row if t not in (sp.pad, sp.eos)]).strip()
            for batch in batches for row in batch.tgt_out.tolist()]  # fmt: skip
    return corpus_bleu(hyps, refs)


class TranslateTask(Task):
    """Teacher-forced translation with label smoothing; the best validation BLEU keeps the weights."""

    name = "translate"
    best_metric = "val_bleu"
    higher_is_better = True
    dynamic_shapes = True

    def __init__(self, cfg: TranslateConfig) -> None:
        super().__init__(cfg)
        self.cfg: TranslateConfig = cfg
        self.pairs: list[tuple[list[int], list[int]]] = []
        self.val_batches: list[Seq2SeqBatch] = []
        self.specials = Specials()
        self._buckets: dict[tuple[int, int], list[list[int]]] = {}
        self.initial: Transformer | None = None  # the model --init-from names (a new run only)

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """de-en for the Ding sentences, bible-de-en for the Bible (ding-bible-de-en for both), else the file's name."""
        assert isinstance(cfg, TranslateConfig)
        if cfg.source is not None:
            return Path(cfg.source).stem
        return "de-en" if cfg.corpus == "ding" else f"{cfg.corpus.replace('+', '-')}-de-en"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Split the pairs, train the shared BPE on the training split (or load the run's), tokenize both splits."""
        require("sacrebleu", "translate", "validation BLEU")  # fail now, not at the first evaluation
        splits = self.cfg.splits()
        if resume:
            self.tokenizer = read_tokenizer(run_dir)
            if self.tokenizer is None:
                raise QkvError(f"{run_dir} has no tokenizer: it is not a translation run to --resume")
        elif self.cfg.init_from is not None:
            self.initial, self.tokenizer = starting_point(self.cfg.init_from)
        else:  # the vocabulary sees the training split only, both languages
            self.tokenizer = train_tokenizer([s for pair in splits.train for s in pair], self.cfg.vocab_size)
        self.specials = specials_of(self.tokenizer)
        max_len = self.model_config().context_length
        self.pairs = encode_pairs(self.tokenizer, splits.train, max_len)
        self.val_batches = batches_of(encode_pairs(self.tokenizer, splits.val, max_len), self.cfg.data.batch_size,
                                      self.specials)  # fmt: skip

    def model_config(self) -> TransformerConfig:
        """An encoder–decoder over the shared vocabulary, its embeddings shared and tied to the output layer (the
        model --init-from names, as it is)."""
        if self.initial is not None:
            return self.initial.cfg
        assert self.tokenizer is not None
        model, size = self.cfg.model, self.tokenizer.vocab_size
        for name in ("src_vocab_size", "tgt_vocab_size"):
            if getattr(model, name) not in (None, size):
                raise QkvError(f"--model {name} is set by the task (one vocabulary for both sides); use --vocab-size")
        return replace(model, src_vocab_size=size, tgt_vocab_size=size, share_embeddings=True, pad_id=self.specials.pad)

    def build_model(self) -> Transformer:
        """A new model, or the weights of the run --init-from names (a resumed run loads its own checkpoint)."""
        model = super().build_model()
        assert isinstance(model, Transformer)
        if self.initial is not None:
            model.load_state_dict(self.initial.state_dict())
        return model

    def describe(self) -> str:
        """Pair counts and the vocabulary."""
        assert self.tokenizer is not None
        n_val = sum(b.src.shape[0] for b in self.val_batches)
        return (f"{len(self.pairs):,} train / {n_val:,} val pairs ({self.cfg.src_lang} → {self.cfg.tgt_lang}), "
                f"vocab {self.tokenizer.vocab_size}")  # fmt: skip

    def draw(self, generator: torch.Generator, budget: int, parts: int) -> list[int]:
        """One random bucket: pairs of similar length, about `budget` tokens per side."""
        if (budget, parts) not in self._buckets:
            buckets = length_buckets(self.pairs, budget, min_rows=parts)
            if min(len(b) for b in buckets) < parts:  # a pair longer than a micro-batch's share fills a bucket
                longest = max(max(len(s), len(t)) + 1 for s, t in self.pairs)
                raise QkvError(f"--batch-size {budget // parts} tokens per micro-batch and process is less than the "
                               f"longest training pair ({longest} tokens); raise it")  # fmt: skip
            self._buckets[budget, parts] = buckets
        buckets = self._buckets[budget, parts]
        return buckets[int(torch.randint(len(buckets), (1,), generator=generator))]

    def collate(self, examples: Sequence[Any], device: torch.device) -> Seq2SeqBatch:
        """Padded source, <s> + target and target + </s>."""
        pairs = [self.pairs[i] for i in examples]
        return make_batch([s for s, _ in pairs], [t for _, t in pairs], self.specials).to(device)

    def logits(self, model: Callable[..., Any], batch: Seq2SeqBatch) -> Tensor:
        """Teacher-forced logits (B, T, V) of the target."""
        return batch_logits(model, batch)

    def criterion(self, logits: Tensor, batch: Seq2SeqBatch) -> Tensor:
        """Label-smoothed cross-entropy per target token."""
        return label_smoothed_loss(logits, batch.tgt_out, batch.pad, self.cfg.label_smoothing)

    def translator(self, model: Transformer) -> Translator:
        """Text in, text out, with the run's beam settings."""
        assert self.tokenizer is not None
        return Translator(model, self.tokenizer, self.specials, self.cfg.length_penalty, self.cfg.coverage_penalty)

    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """Validation loss and greedy validation BLEU."""
        assert isinstance(ev.model, Transformer)
        if self.val_batches[0].src.device != ev.ctx.device:  # moved once, at the first evaluation
            self.val_batches = [b.to(ev.ctx.device) for b in self.val_batches]
        with ev.autocast():
            loss = evaluate_batches(ev.forward, self.val_batches)
        return {"val_loss": loss, "val_bleu": validation_bleu(ev.model, self.val_batches, self.translator(ev.model))}

    def summary(self, result: TrainResult) -> str:
        """The final validation loss and BLEU, and what to try next."""
        final, q = result.final, program()
        return (f"\nval loss {final['val_loss']:.4f}, val BLEU {final['val_bleu']:.2f} (best {result.best or 0:.2f}) "
                f"after {result.step} steps, {result.took()} — run saved in {result.run_dir}\n"
                f"more: {q} translate {result.run_dir} 'Wie geht es dir?'   |   {q} eval {result.run_dir}")  # fmt: skip


@dataclass
class TranslationRun(LoadedRun):
    """A trained translation model: translate sentences, or measure BLEU on the test split."""

    model: Transformer
    config: TranslateConfig
    config_class: ClassVar[type[RunConfig[Any]]] = TranslateConfig

    def translator(self, length_penalty: float | None = None, coverage_penalty: float | None = None) -> Translator:
        """A translator with the run's beam settings, or the penalties given."""
        tokenizer = self.require_tokenizer()
        alpha = self.config.length_penalty if length_penalty is None else length_penalty
        beta = self.config.coverage_penalty if coverage_penalty is None else coverage_penalty
        return Translator(self.model, tokenizer, specials_of(tokenizer), alpha, beta)

    def evaluate(self, options: EvalOptions) -> list[str]:
        """BLEU and chrF (sacrebleu, detokenised), greedy and beam, on each test split of the run's corpus.

        With a beam, a last line per split says by how much it beats greedy decoding, with the 95 % interval
        of a paired bootstrap: whether the difference is more than the test set's noise.
        """
        translator = rescored(self.translator(options.length_penalty, options.coverage_penalty), options.beam_scoring,
                              options.length_penalty, options.coverage_penalty)  # fmt: skip
        lines = []
        for split, pairs in self.config.splits().tests.items():
            sources, references = [src for src, _ in pairs], [tgt for _, tgt in pairs]
            outputs = {
                beam: translator.translate(sources, beam, options.batch_size) for beam in sorted({1, options.beam})
            }
            for beam, hyps in outputs.items():
                name = "greedy" if beam == 1 else f"beam {beam}"
                lines.append(f"{split} {name:>7}: BLEU {corpus_bleu(hyps, references):5.2f}  "
                             f"chrF {corpus_chrf(hyps, references):5.2f}  ({len(pairs)} sentences, "
                             f"{self.checkpoint} weights)")  # fmt: skip
            if options.beam > 1:
                gain = paired_bootstrap_bleu(outputs[1], outputs[options.beam], references)
                lines.append(f"{split} beam {options.beam} − greedy: {gain}")
        return lines
