"""Training data: the embedded Shakespeare corpus, text files, splits and batches."""

from qkv.data.batches import eval_windows, random_batch
from qkv.data.corpus import SHAKESPEARE_SHA256, load_shakespeare, read_text_file, train_val_split

__all__ = [
    "SHAKESPEARE_SHA256",
    "eval_windows",
    "load_shakespeare",
    "random_batch",
    "read_text_file",
    "train_val_split",
]
