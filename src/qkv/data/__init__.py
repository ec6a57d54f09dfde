"""Training data: corpora on disk tokenized into shards (`qkv prepare`), read back as windows for training.

    sources.py   the inputs: text, .gz, JSON Lines and Parquet files, read as a stream of chunks
    options.py   what `qkv prepare` is asked for: the tokenizer to make, the split, the shard size
    shards.py    llm.c's .bin token shards: the header, a writer that cannot leave half a shard, the reader
    workers.py   what a worker process does with a chunk: parse its documents, encode them
    prepare.py   `qkv prepare`: the parallel, resumable pipeline that writes a data directory
    prepare_state.py   its state on disk: progress.json while it works, meta.json once it is done
    tokens.py    a data directory opened for training: memory-mapped splits, random windows, evaluation windows
    cache.py     a text file (or the embedded Shakespeare) prepared once into a cache keyed by its content
    corpus.py    the embedded Shakespeare corpus
    batches.py   windows of a token sequence: random ones for training, consecutive ones for evaluation

`import qkv.data` is light (names load on first use): `qkv prepare`'s workers never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv.lazy import lazy_exports

_EXPORTS = {
    "SHAKESPEARE_SHA256": "qkv.data.corpus",
    "load_shakespeare": "qkv.data.corpus",
    "read_text_file": "qkv.data.corpus",
    "eval_windows": "qkv.data.batches",
    "random_batch": "qkv.data.batches",
}

if TYPE_CHECKING:
    from qkv.data.batches import eval_windows, random_batch
    from qkv.data.corpus import SHAKESPEARE_SHA256, load_shakespeare, read_text_file


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = [
    "SHAKESPEARE_SHA256",
    "eval_windows",
    "load_shakespeare",
    "random_batch",
    "read_text_file",
]
