"""German → English translation with the encoder–decoder Transformer: corpus, training, decoding, evaluation.

One module per concept: corpus (the Ding sentence pairs and their split), batching, step (loss and
training step), decoding (greedy and beam search), trainer, run (run directories), metrics (BLEU,
chrF), attention_maps, toy (copy/reverse sanity tasks), cli.
"""

from qkv.translation.batching import Seq2SeqBatch, Specials, make_batch
from qkv.translation.config import TranslateConfig
from qkv.translation.decoding import beam_search, greedy_decode
from qkv.translation.run import TranslationRun, load_translation
from qkv.translation.trainer import TranslateResult, train_translation

__all__ = [
    "Seq2SeqBatch",
    "Specials",
    "TranslateConfig",
    "TranslateResult",
    "TranslationRun",
    "beam_search",
    "greedy_decode",
    "load_translation",
    "make_batch",
    "train_translation",
]
