"""`qkv prepare`: a corpus tokenized once, in parallel, into llm.c shards that training memory-maps.

    DATA_DIR/
        meta.json            what the directory holds; written last, so a directory without it is unfinished
        tokenizer.json …     the tokenizer (what qkv.tokenizers.load_tokenizer reads)
        train_000000.bin …   the training split, in shards of about --shard-tokens tokens (qkv.data.shards)
        val_000000.bin …     the validation split
        progress.json        while unfinished: the settings, the shards written so far and where to go on

Documents (qkv.data.sources) are held out whole for validation: every k-th one for --val-fraction 1/k,
starting with the first, or the first ones up to --val-tokens tokens. One text file without a separator
is one document, split as qkv always has: its first 90 % of characters train, the rest validates.
With a BPE tokenizer the end-of-text token follows each document (the char tokenizer has none).

Crash safety: shards are written to hidden files and renamed when whole; every time a training shard
is full, both open shards are closed together and progress.json records the place in the input after
them. A killed run, started again with the same command, deletes whatever came after that record and
goes on from it. The shards are byte for byte those of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qkv.data import sources
from qkv.data.options import PrepareOptions, TokenizerRecipe, train_characters
from qkv.data.prepare_state import (
    META_FILE,
    PROGRESS_FILE,
    PrepareState,
    finished_meta,
    open_output,
    write_progress,
)
from qkv.data.shards import ShardWriter, dtype_of, magic_for
from qkv.data.sources import Chunk, Position, expand_inputs, read_chunks, single_document
from qkv.data.workers import count_documents, encode, ignore_interrupts, ordered_map, sample_texts, scan
from qkv.errors import QkvError
from qkv.io.files import file_sha256
from qkv.io.progress import ProgressLine, clock
from qkv.tokenizers import ByteBPETokenizer, CharTokenizer, Tokenizer, load_tokenizer


def check_output(inputs: Sequence[str | Path], out: str | Path) -> None:
    """Refuse an output directory that is one of the inputs, in one line naming --out."""
    out = Path(out)
    if any(Path(i).resolve() == out.resolve() for i in inputs):
        raise QkvError(f"--out {out} is the input directory itself; write the shards to another one, e.g. --out "
                       f"{out.resolve().name}-data")  # fmt: skip


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: Tokenizer | TokenizerRecipe,
    tokenizer_name: str,
    options: PrepareOptions = PrepareOptions(),
    verbose: bool = True,
) -> dict[str, Any]:
    """Tokenize `inputs` into shards in `out` (finishing an interrupted run of the same command); its meta.json.

    tokenizer: a ready one (GPT-2's, a run's, a checkpoint's: `tokenizer_name` says which) or a recipe.
    """
    out = Path(out)
    check_output(inputs, out)
    paths = [p for p in expand_inputs(inputs) if out.resolve() not in p.parents]  # never its own output
    if not any(p.stat().st_size for p in paths):
        what = f"{paths[0]} is empty" if len(paths) == 1 else f"all {len(paths)} inputs are empty"
        raise QkvError(f"{what}; a corpus needs at least some text")
    if not isinstance(tokenizer, TokenizerRecipe) and not tokenizer.cuts_like_gpt2():  # its documents read whole
        options = dataclasses.replace(options, read=dataclasses.replace(options.read, cut_documents=False))
    settings = _settings(paths, tokenizer, tokenizer_name, options)
    state = open_output(out, settings)
    if state.meta is not None:  # prepared already by the same command
        if verbose:
            print(f"{out} is already prepared from these inputs with these settings; nothing to do")
        return state.meta
    progress = ProgressLine(enabled=verbose, log_every_s=10.0)
    began = time.monotonic()
    try:
        with _Workers(options.workers, paths) as workers:
            run = _Run(paths, out, options, state, workers, progress)
            tok = run.tokenizer(tokenizer, tokenizer_name)
            run.encode(tok)
        meta = finished_meta(out, state, tok, tokenizer_name, settings)
    except QkvError:  # the input is at fault: a directory this command made is of no use to anyone
        if state.created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    except OSError as e:  # a full disk, a read error: what is committed stays, progress.json says where
        raise QkvError(f"{out}: {e.strerror or e} while writing shards; fix that and run the same command again "
                       f"to go on from the last finished shard") from None  # fmt: skip
    except KeyboardInterrupt:
        progress.log("stopped; the same command goes on from the last finished shard")
        raise
    finally:
        progress.close()
    if verbose:
        print(_summary(meta, out, time.monotonic() - began))
    return meta


def _settings(paths: list[Path], tokenizer: Tokenizer | TokenizerRecipe, name: str, options: PrepareOptions,
              ) -> dict[str, Any]:  # fmt: skip
    """What decides the output: the inputs as they are on disk, the tokenizer and the options (not the workers)."""
    if isinstance(tokenizer, TokenizerRecipe):
        tok: dict[str, Any] = {"name": name, **dataclasses.asdict(tokenizer)}
        if tokenizer.kind == "char":
            tok = {"name": name, "kind": "char"}
    else:
        tok = {"name": name, "fingerprint": tokenizer.fingerprint()}
    files = []
    for p in paths:
        stat = p.stat()
        files.append({"path": str(p), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    settings = {"inputs": files, "tokenizer": tok, "read": dataclasses.asdict(options.read),
                "split": dataclasses.asdict(options.split), "shard_tokens": options.shard_tokens}  # fmt: skip
    return json.loads(json.dumps(settings))  # as progress.json and meta.json give them back (lists, not tuples)


class _Workers:
    """A pool of spawned worker processes (none for `--workers 0` or an input of a chunk or two)."""

    def __init__(self, workers: int | None, paths: list[Path]) -> None:
        n = (os.cpu_count() or 1) if workers is None else workers
        small = sum(p.stat().st_size for p in paths) <= 2 * sources.BLOCK_BYTES
        self.n = 0 if small else n
        self.pool: Any = None

    def __enter__(self) -> _Workers:
        if self.n > 0:  # spawn: a fresh interpreter per worker, light (no torch) and safe after threads
            self.pool = multiprocessing.get_context("spawn").Pool(self.n, initializer=ignore_interrupts)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


class _Run:
    """One preparation: the passes over the corpus, the open shards and the progress line."""

    def __init__(self, paths: list[Path], out: Path, options: PrepareOptions, state: PrepareState,
                 workers: _Workers, progress: ProgressLine) -> None:  # fmt: skip
        self.paths, self.out, self.options, self.state, self.pool = paths, out, options, state, workers.pool
        self.progress = progress
        self.read = options.read
        self.depth = 2 * max(1, workers.n)  # chunks in flight: each worker has the next one waiting
        self.single = single_document(paths, options.read)
        sizes = [p.stat().st_size for p in paths]
        self.before = [sum(sizes[:i]) for i in range(len(sizes))]  # bytes of the inputs before each
        self.total_bytes = sum(sizes)
        self.started, self.first_done = time.monotonic(), -1  # set when the first chunk is encoded

    def chunks(self, start: Position | None = None) -> Iterator[Chunk]:
        """The corpus from a position (the start by default); a single document's pieces carry their split."""
        chunks = read_chunks(self.paths, self.read, start or Position(), self.state.stats)
        if not self.single:
            return chunks
        return (_split_pieces(c, self.state.boundary) for c in chunks)

    # ---- the tokenizer -------------------------------------------------------------------------------

    def tokenizer(self, given: Tokenizer | TokenizerRecipe, name: str) -> Tokenizer:
        """The run's tokenizer, saved in the output: given, made from the corpus, or (resumed) read back."""
        state = self.state
        recipe = given if isinstance(given, TokenizerRecipe) else None
        alphabet: set[str] = set()
        char_recipe = recipe is not None and recipe.kind == "char" and not state.tokenizer_ready
        if (self.single and state.boundary is None) or char_recipe:
            alphabet, characters = self._scan()
            state.boundary = train_characters(characters) if self.single else None
        if state.tokenizer_ready:
            return load_tokenizer(self.out)
        if recipe is not None:
            self.progress.log(f"qkv prepare: learning a {name} vocabulary from the corpus …")
            if recipe.kind == "bpe":
                given = ByteBPETokenizer.train(self._sample(recipe.sample_bytes), recipe.vocab_size,
                                               recipe.special_tokens)  # fmt: skip
            elif alphabet:
                given = CharTokenizer(sorted(alphabet))
            else:
                raise QkvError("the inputs hold no text: every document is empty")
        assert not isinstance(given, TokenizerRecipe)
        given.save(self.out)
        state.tokenizer_ready = True
        write_progress(self.out, state)
        return given

    def _scan(self) -> tuple[set[str], int]:
        """Every character of the corpus, and how many there are (one pass, by the workers)."""
        alphabet, characters = set(), 0
        chunks = read_chunks(self.paths, self.read, Position())
        for _, (chars, count) in ordered_map(partial(scan, options=self.read), chunks, self.pool, self.depth):
            alphabet |= chars
            characters += count
        return alphabet, characters

    def _sample(self, budget: int) -> list[str]:
        """About `budget` bytes of training text: the start of a single text's training part, or chunks taken as the
        reading goes so that the sample keeps up with budget × (bytes read / all bytes): spread over the corpus,
        compressed files and Parquet included."""
        texts: list[str] = []
        size = doc = 0
        for chunk in self.chunks():
            done = self.before[chunk.at.input] + chunk.consumed
            if self.single or size < budget * done / self.total_bytes:
                for text in sample_texts(chunk, self.read, self._train_mask(chunk, doc)):
                    if size < budget:
                        texts.append(text[: budget - size])
                        size += len(texts[-1].encode("utf-8", "surrogatepass"))
            if size >= budget:
                break
            doc += count_documents(chunk)
        if not size:
            raise QkvError("the inputs hold no training text to learn a vocabulary from")
        return texts

    def _train_mask(self, chunk: Chunk, first_doc: int) -> list[bool] | None:
        """Which of a chunk's pieces are training text (None: all; with --val-tokens only the tokenizer could tell)."""
        if chunk.splits is not None:
            return [s == "train" for s in chunk.splits]
        if self.options.split.val_tokens is not None:
            return None
        ends = chunk.ends if chunk.kind == "text" else [True] * count_documents(chunk)
        mask, doc = [], first_doc
        for end in ends:
            mask.append(not self.options.split.is_val(doc, 0))
            doc += end
        return mask

    # ---- encoding --------------------------------------------------------------------------------------

    def encode(self, tok: Tokenizer) -> None:
        """Every chunk from the recorded position on, encoded by the workers and written in order."""
        state, magic = self.state, magic_for(tok.vocab_size)
        if state.files:
            at = state.position
            self.progress.log(f"qkv prepare: going on after the {len(state.files)} shards already written (input "
                              f"{at.input + 1} of {len(self.paths)}, {self.paths[at.input].name}, chunk {at.chunk})")
        state.magic, dtype = magic, dtype_of(magic)
        eot = np.array([tok.eos_id], dtype=dtype) if tok.eos_id is not None and tok.kind != "char" else None
        job = partial(encode, options=self.read, directory=str(self.out), dtype=dtype.str)
        writers: dict[str, ShardWriter | None] = {"train": None, "val": None}
        if state.counts is None:
            state.counts = np.zeros(tok.vocab_size, dtype=np.int64)
        try:
            for chunk, encoded in ordered_map(job, self.chunks(state.position), self.pool, self.depth):
                self._write(chunk, encoded, writers, eot)
                state.position = dataclasses.replace(chunk.at, chunk=chunk.at.chunk + 1)
                self._show(chunk)
                train = writers["train"]
                if train is not None and train.count >= self.options.shard_tokens:
                    self._commit(writers)
            self._commit(writers)
        except BaseException:
            for writer in writers.values():
                if writer is not None:
                    writer.discard()
            raise

    def _write(self, chunk: Chunk, encoded: Any, writers: dict[str, ShardWriter | None], eot: np.ndarray | None,
               ) -> None:  # fmt: skip
        """Route each piece to its split, closing documents with the end-of-text token; one write per split."""
        state, c = self.state, self.state.c
        parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
        start = 0
        for i, length in enumerate(encoded.lengths.tolist()):
            if not c.in_document:  # a document begins: which split is it in?
                c.in_document, c.document_tokens = True, 0
                if chunk.splits is None:
                    c.split = "val" if self.options.split.is_val(c.documents, c.tokens["val"]) else "train"
            if chunk.splits is not None:
                c.split = chunk.splits[i]
            parts[c.split].append(encoded.tokens[start : start + length])
            start += length
            c.document_tokens += length
            c.tokens[c.split] += length
            c.text_bytes[c.split] += int(encoded.text_bytes[i])
            if encoded.ends[i]:
                c.in_document = False
                c.documents += 1
                if c.document_tokens == 0:
                    c.empty += 1
                    continue
                c.docs[c.split] += 1
                if eot is not None:
                    parts[c.split].append(eot)
                    c.tokens[c.split] += 1
        for split, arrays in parts.items():
            if arrays:
                tokens = np.concatenate(arrays)
                if len(tokens):
                    (writers[split] or self._new_writer(split, writers)).write(tokens)
                    if split == "train" and state.counts is not None:
                        state.counts += np.bincount(tokens, minlength=len(state.counts))

    def _new_writer(self, split: str, writers: dict[str, ShardWriter | None]) -> ShardWriter:
        """The next shard of a split, opened."""
        number = sum(f["split"] == split for f in self.state.files)
        writer = writers[split] = ShardWriter(self.out / f"{split}_{number:06d}.bin", self.state.magic)
        return writer

    def _commit(self, writers: dict[str, ShardWriter | None]) -> None:
        """Close both open shards, then record them (and where the input goes on) in progress.json."""
        state, c = self.state, self.state.c
        for split, writer in writers.items():
            if writer is None:
                continue
            path = writer.commit()
            before = sum(f["text_bytes"] for f in state.files if f["split"] == split)
            state.files.append({"file": path.name, "split": split, "tokens": writer.count,
                                "text_bytes": c.text_bytes[split] - before, "sha256": file_sha256(path)})  # fmt: skip
            writers[split] = None
        write_progress(self.out, state)

    def _show(self, chunk: Chunk) -> None:
        """Redraw the progress line: MB read, MB/s, tokens written, time left."""
        done = self.before[chunk.at.input] + chunk.consumed
        if self.first_done < 0:  # the rate counts what this process encodes, not what it learnt or skipped before
            self.started, self.first_done = time.monotonic(), done
        rate = (done - self.first_done) / max(time.monotonic() - self.started, 1e-9)
        eta = (self.total_bytes - done) / rate if rate > 0 else 0.0
        tokens = self.state.c.tokens["train"] + self.state.c.tokens["val"]
        self.progress.update(done / max(1, self.total_bytes), f"{done / 1e6:,.0f}/{self.total_bytes / 1e6:,.0f} MB  "
                             f"{rate / 1e6:,.1f} MB/s  {tokens:,} tokens  ETA {clock(eta)}")  # fmt: skip


def _split_pieces(chunk: Chunk, boundary: int | None) -> Chunk:
    """A single document's chunk with each piece labelled train or val, cut in two at the 90 % character."""
    assert boundary is not None
    pieces, ends, splits = [], [], []
    at = chunk.chars
    for piece, end in zip(chunk.payload, chunk.ends, strict=True):
        if at < boundary < at + len(piece):  # the train split ends here: no end-of-text, a new piece begins
            pieces += [piece[: boundary - at], piece[boundary - at :]]
            ends += [False, end]
            splits += ["train", "val"]
        else:
            pieces.append(piece)
            ends.append(end)
            splits.append("train" if at + len(piece) <= boundary else "val")
        at += len(piece)
    return dataclasses.replace(chunk, payload=pieces, ends=ends, splits=splits)


def _summary(meta: dict[str, Any], out: Path, seconds: float) -> str:
    """The closing lines: the time taken, the split's rule, then documents, tokens and shards per split."""
    size = sum(i["bytes"] for i in meta["inputs"])
    tok = meta["tokenizer"]
    took = f"{seconds:.1f} s" if seconds < 60 else clock(seconds)
    lines = [f"prepared {out} in {took} ({size / 1e6:,.1f} MB of input, {size / 1e6 / seconds:,.1f} MB/s): "
             f"tokenizer {tok['name']} ({tok['vocab_size']:,} tokens); validation: {meta['split_rule']}"]  # fmt: skip
    for split in ("train", "val"):
        s = meta["splits"][split]
        shards = sum(f["split"] == split for f in meta["files"])
        docs = f"{s['documents']:,} document{'s' if s['documents'] != 1 else ''}"
        if meta["split_by"] == "characters":
            docs = f"{'the first 90 %' if split == 'train' else 'the last 10 %'} of the text"
        lines.append(f"{split:>5}: {docs}, {s['tokens']:,} tokens, {s['text_bytes'] / 1e6:,.2f} MB of text, {shards} "
                     f"shard{'s' if shards != 1 else ''}")  # fmt: skip
    return "\n".join([*lines, f"train on it: qkv train --data {out}"])


__all__ = ["META_FILE", "PROGRESS_FILE", "prepare"]
