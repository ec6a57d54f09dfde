"""The state of a `qkv prepare` run on disk: progress.json while it works, meta.json once it is done.

A directory with meta.json is finished: training reads it. A directory with progress.json (and no
meta.json) is unfinished: training refuses it, and the same `qkv prepare` command goes on with it.
Anything else that is not empty is not ours, and is never written into.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qkv.data.shards import HEADER_BYTES, dtype_of
from qkv.data.sources import InputStats, Position
from qkv.errors import QkvError
from qkv.io.files import atomic_write_json, fsync_directory, load_json
from qkv.tokenizers import Tokenizer

FORMAT = "qkv-data/1"
META_FILE = "meta.json"
PROGRESS_FILE = "progress.json"
SPLITS = ("train", "val")


def _per_split(value: int = 0) -> dict[str, int]:
    return dict.fromkeys(SPLITS, value)


@dataclass
class Counters:
    """Documents, tokens and text written so far, and the document being written when a chunk ended."""

    documents: int = 0  # every document begun and ended, empty ones included (the index of the next)
    empty: int = 0
    docs: dict[str, int] = field(default_factory=_per_split)
    tokens: dict[str, int] = field(default_factory=_per_split)
    text_bytes: dict[str, int] = field(default_factory=_per_split)
    in_document: bool = False  # a document goes on in the next chunk (a long text cut into pieces)
    document_tokens: int = 0
    split: str = "train"


@dataclass
class PrepareState:
    """Where a preparation stands: what is committed, where the input goes on, the counters at that place."""

    settings: dict[str, Any]
    meta: dict[str, Any] | None = None  # finished already
    created: bool = False  # the directory was made by this run (and holds nothing else)
    tokenizer_ready: bool = False
    position: Position = Position()
    boundary: int | None = None  # a single document: its first `boundary` characters train
    files: list[dict[str, Any]] = field(default_factory=list)
    c: Counters = field(default_factory=Counters)
    counts: np.ndarray | None = None  # how often each token occurs in the training split
    stats: list[InputStats] = field(default_factory=list)
    magic: int = 0  # the shards' format, set when encoding starts (qkv.data.shards.magic_for)


def open_output(out: Path, settings: dict[str, Any]) -> PrepareState:
    """The state of DATA_DIR for these settings: new, to be finished, or finished; refused if it holds other work."""
    fresh = PrepareState(settings, stats=[InputStats() for _ in settings["inputs"]])
    if out.exists() and not out.is_dir():
        raise QkvError(f"--out {out} is a file; give a directory (a new one, or one qkv prepare started)")
    if (out / META_FILE).is_file():
        meta = load_json(out / META_FILE)
        if meta.get("settings") != settings:
            raise QkvError(f"{out} holds a different preparation ({_difference(meta.get('settings'), settings)}); "
                           "choose another --out, or delete it first")  # fmt: skip
        fresh.meta = meta
        return fresh
    if (out / PROGRESS_FILE).is_file():
        saved = load_json(out / PROGRESS_FILE)
        if saved.get("settings") != settings:
            what = _difference(saved.get("settings"), settings)
            raise QkvError(f"{out} holds an unfinished preparation with {what}; finish it with its own command, "
                           "choose another --out, or delete it first")  # fmt: skip
        state = _restore(saved, fresh)
        _clean(out, state)
        return state
    if out.is_dir() and any(out.iterdir()):
        raise QkvError(f"--out {out} is not empty and holds no qkv preparation; give a new directory")
    out.mkdir(parents=True, exist_ok=True)
    fresh.created = True
    write_progress(out, fresh)
    return fresh


def _difference(old: Any, new: dict[str, Any]) -> str:
    """What differs between two settings, in words."""
    if not isinstance(old, dict):
        return "settings qkv cannot read"
    names = {"inputs": "other inputs (or inputs changed since)", "tokenizer": "another tokenizer",
             "read": "other reading options", "split": "another validation split", "shard_tokens": "another shard size"}
    return next((text for key, text in names.items() if old.get(key) != new.get(key)), "other settings")


def _restore(saved: dict[str, Any], state: PrepareState) -> PrepareState:
    """The state progress.json recorded (the place after the last committed shards)."""
    state.tokenizer_ready = bool(saved.get("tokenizer_ready"))
    state.position = Position(**saved["position"])
    state.boundary = saved.get("boundary")
    state.files = list(saved["files"])
    state.c = Counters(**saved["counters"])
    state.counts = None if saved.get("counts") is None else np.array(saved["counts"], dtype=np.int64)
    state.stats = [InputStats(**s) for s in saved["stats"]]
    return state


def _clean(out: Path, state: PrepareState) -> None:
    """Delete what an interrupted run wrote after its last record: unlisted shards and hidden temporary files."""
    listed = {f["file"] for f in state.files}
    for path in out.iterdir():
        stray = path.suffix == ".bin" and path.name not in listed
        if stray or (path.name.startswith(".") and path.name.endswith(".tmp")):
            path.unlink()
    fsync_directory(out)


def write_progress(out: Path, state: PrepareState) -> None:
    """Record the state atomically (the commit point of the shards written before it)."""
    atomic_write_json(out / PROGRESS_FILE, {
        "format": FORMAT, "settings": state.settings, "tokenizer_ready": state.tokenizer_ready,
        "position": dataclasses.asdict(state.position), "boundary": state.boundary, "files": state.files,
        "counters": dataclasses.asdict(state.c), "counts": None if state.counts is None else state.counts.tolist(),
        "stats": [dataclasses.asdict(s) for s in state.stats],
    })  # fmt: skip


def finished_meta(out: Path, state: PrepareState, tok: Tokenizer, name: str, settings: dict[str, Any]
                  ) -> dict[str, Any]:  # fmt: skip
    """Write meta.json (the directory is finished from then on) and drop progress.json; returns the meta."""
    c = state.c
    for split in SPLITS:
        if c.tokens[split] == 0:
            raise QkvError(_empty_split_message(split, state))
    counts = state.counts if state.counts is not None else np.zeros(1, dtype=np.int64)
    meta = {
        "format": FORMAT,
        "tokenizer": {"name": name, "kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "fingerprint": tok.fingerprint()},
        "shard_format": {"magic": state.magic, "dtype": dtype_of(state.magic).name, "header_bytes": HEADER_BYTES},
        "splits": {s: {"documents": c.docs[s], "tokens": c.tokens[s], "text_bytes": c.text_bytes[s]} for s in SPLITS},
        "split_by": "documents" if state.boundary is None else "characters",
        "split_rule": _split_rule(state),
        "empty_documents": c.empty,
        "commonest_train_token": int(np.argmax(counts)),
        "files": state.files,
        "inputs": [{"path": i["path"], "bytes": s.size, "sha256": s.sha256}
                   for i, s in zip(settings["inputs"], state.stats, strict=True)],
        "settings": settings,
    }  # fmt: skip
    atomic_write_json(out / META_FILE, meta)
    (out / PROGRESS_FILE).unlink()
    fsync_directory(out)
    return meta


def _split_rule(state: PrepareState) -> str:
    """How the validation split was chosen, in words."""
    split = state.settings["split"]
    if state.boundary is not None:
        return f"the last 10 % of one text's characters (from character {state.boundary:,} on)"
    if split["val_tokens"] is not None:
        return f"the first documents, until {split['val_tokens']:,} tokens"
    return f"{split['val_fraction'] * 100:g} % of the documents, spread over the corpus, the first one included"


def _empty_split_message(split: str, state: PrepareState) -> str:
    """Why a split came out empty, and what to do."""
    c = state.c
    if c.tokens["train"] + c.tokens["val"] == 0:
        return "the inputs hold no text: every document is empty"
    if state.boundary is not None:
        return "the text is too short to split: its first 90 % of characters train, the rest validates; give more text"
    if split == "train":
        return (f"all {c.documents:,} documents went to validation, none is left to train on; give more documents, or "
                "a smaller --val-tokens or --val-fraction")  # fmt: skip
    return "no document went to validation; give a larger --val-fraction or --val-tokens"
