"""qkv.interpret against TransformerLens 4.3.0 on the same weights: streams, logit lens, patterns, patching.

Two random-init Hugging Face models are built here (GPT-2: LayerNorm, learned positions; Llama: RMSNorm,
rotary positions, 4 query heads sharing 2 K/V heads). Their norms get random scales and shifts and their
biases random values, so that a lens that skipped the norm's affine part, or a patch of the wrong position,
could not pass by accident. qkv reads each model from save_pretrained's files; TransformerLens wraps the
model object itself (TransformerBridge, no weight processing). Nothing is downloaded.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from qkv.interop import from_hf
from qkv.interpret import activation_patching, logit_lens, run_with_cache

VOCAB, T = 100, 8


def _randomise(model: Any, seed: int) -> Any:
    """Norm scales around 1 and shifts, biases around 0, all non-trivial (seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("ln_", "norm")):
                p.copy_((1.0 + 0.5 * torch.randn(p.shape, generator=g)) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))  # fmt: skip
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def _hf(family: str) -> Any:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
        return _randomise(transformers.GPT2LMHeadModel(cfg), 10)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip
    return _randomise(transformers.LlamaForCausalLM(cfg), 11)


def _tokenizer() -> Any:
    """A word-level tokenizer built in memory; add_bos_token and a name keep TransformerLens from fetching one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", unk_token="<unk>", add_bos_token=True,
                                                name_or_path="qkv-test-tokenizer")  # fmt: skip


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(qkv model, TransformerLens bridge) of one HF model."""
    from transformer_lens.model_bridge import TransformerBridge

    hf = _hf(request.param)
    directory: Path = tmp_path_factory.mktemp(request.param)
    copy.deepcopy(hf).save_pretrained(directory)  # the bridge rewraps the object it is given: save a copy first
    qkv_model = from_hf(directory).eval()
    bridge = TransformerBridge.boot_transformers(f"local-{request.param}", hf_model=hf, tokenizer=_tokenizer(),
                                                 device="cpu")  # fmt: skip
    bridge.enable_compatibility_mode(no_processing=True)
    return qkv_model, bridge


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(seed))


def test_every_layers_stream_and_every_heads_pattern_equal_transformer_lens(pair: tuple[Any, Any]) -> None:
    model, bridge = pair
    ids = _ids(1)
    logits, acts = run_with_cache(model, ids)
    with torch.no_grad():
        tl_logits, cache = bridge.run_with_cache(ids)
    torch.testing.assert_close(logits, tl_logits, atol=1e-4, rtol=0)
    for i in range(2):
        for ours, theirs in (("resid_pre", "hook_resid_pre"), ("resid_mid", "hook_resid_mid"),
                             ("resid_post", "hook_resid_post")):  # fmt: skip
            torch.testing.assert_close(acts[f"decoder.layers.{i}.{ours}"], cache[f"blocks.{i}.{theirs}"],
                                       atol=1e-4, rtol=0)  # fmt: skip
        pattern = acts[f"decoder.layers.{i}.attn.pattern"]  # (B, H, T, T), one per query head, as TL's
        assert pattern.shape == (1, 4, T, T)
        torch.testing.assert_close(pattern, cache[f"blocks.{i}.attn.hook_pattern"], atol=1e-5, rtol=0)
        torch.testing.assert_close(acts[f"decoder.layers.{i}.attn.z"], cache[f"blocks.{i}.attn.hook_z"],
                                   atol=1e-5, rtol=0)  # fmt: skip


def test_logit_lens_probabilities_equal_transformer_lens_accumulated_resid(pair: tuple[Any, Any]) -> None:
    model, bridge = pair
    ids = _ids(2)
    lens = logit_lens(model, ids)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
        stack = cache.accumulated_resid(apply_ln=True)  # (L + 1, B, T, d): final norm recomputed per layer
        theirs = bridge.unembed(stack).softmax(-1)
    assert lens.probs.shape == theirs.shape == (3, 1, T, VOCAB)
    torch.testing.assert_close(lens.probs, theirs, atol=1e-4, rtol=0)


def test_a_residual_stream_patch_equals_transformer_lens(pair: tuple[Any, Any]) -> None:
    """Every (layer, position) patch of the stream entering a layer, clean into corrupted: the same normalised
    logit-difference map as TransformerLens's get_act_patch_resid_pre with the same metric."""
    from transformer_lens.patching import get_act_patch_resid_pre

    model, bridge = pair
    clean, corrupted = _ids(3), _ids(3).clone()
    corrupted[0, 5] = (clean[0, 5] + 7) % VOCAB
    with torch.no_grad():
        last = model(clean)[0, -1]
    answer, wrong = int(last.argmax()), int(model(corrupted)[0, -1].argmax())
    if answer == wrong:
        wrong = int(last.argsort()[-2])
    ours = activation_patching(model, clean, corrupted, answer, wrong, heads=False)
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)

        def metric(logits: torch.Tensor) -> torch.Tensor:
            diff = logits[0, -1, answer] - logits[0, -1, wrong]
            return (diff - ours.corrupted) / (ours.clean - ours.corrupted)

        theirs = get_act_patch_resid_pre(bridge, corrupted, clean_cache, metric)  # (L, T)
    assert ours.resid.shape == theirs.shape == (2, T)
    torch.testing.assert_close(ours.resid, theirs.float(), atol=1e-4, rtol=0)
    assert abs(float(ours.resid[0, 5]) - 1.0) < 1e-4 and float(ours.resid[:, :5].abs().max()) < 1e-4
