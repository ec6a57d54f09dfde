"""qkv.interpret: named activations and their identities, the logit lens, attribution, patching, induction."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import model_cfg

from qkv.errors import QkvError
from qkv.interpret import (
    activation_patching,
    head_scores,
    hook_names,
    hooked,
    induction_scores,
    logit_attribution,
    logit_lens,
    previous_token_scores,
    repeated_tokens,
    run_with_cache,
)
from qkv.interpret.induction import induction_targets
from qkv.lora import LoRAConfig, add_lora
from qkv.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig, build_model

D = {"vocab_size": 40, "d_model": 32, "n_heads": 4, "n_layers": 3, "d_ff": 64, "max_positions": 32, "dropout": 0.0}


def _model(**over: object) -> DecoderLM:
    torch.manual_seed(0)
    model = build_model(model_cfg(DecoderLMConfig, **{**D, **over}))  # type: ignore[arg-type]
    assert isinstance(model, DecoderLM)
    return model.eval()


def _ids(t: int = 9, b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, D["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


def test_every_layer_has_the_same_names_with_and_without_lora_and_attention_only_layers_lack_ffn_out() -> None:
    model = _model()
    names = hook_names(model, "decoder.layers.0.*")
    assert names == [f"decoder.layers.0.{a}" for a in ("resid_pre", "attn.z", "attn.result", "attn.pattern",
                                                       "attn_out", "resid_mid", "ffn_out", "resid_post")]
    before = hook_names(model)
    add_lora(model, LoRAConfig(rank=2, targets=("q_proj", "v_proj", "out_proj")))
    assert hook_names(model) == before
    assert hook_names(_model(d_ff=0), "*.ffn_out") == []
    torch.manual_seed(0)
    seq2seq = Transformer(model_cfg(TransformerConfig, src_vocab_size=20, tgt_vocab_size=20, d_model=16, n_heads=2,
                                    n_encoder_layers=1, n_decoder_layers=1, d_ff=32))  # fmt: skip
    assert "decoder.layers.0.cross.pattern" in hook_names(seq2seq)
    assert "encoder.layers.0.resid_mid" in hook_names(seq2seq)


@pytest.mark.parametrize("over", [{}, {"positions": "rotary", "norm": "rms", "n_kv_heads": 2, "bias": False}])
def test_streams_and_heads_add_up_exactly(over: dict[str, object]) -> None:
    """resid_post(l) = resid_pre(l + 1), resid_mid = resid_pre + attn_out (pre-norm), Σ_h result_h + b_O = attn_out,
    also through a LoRA adapter on W_O; the last stream through the final norm and head is the model's output."""
    model = _model(**over)
    add_lora(model, LoRAConfig(rank=2, targets=("out_proj",)))
    for module in model.modules():  # non-zero adapters, so that W_O's effective weight differs from the base
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B, std=0.1)
    ids = _ids()
    logits, acts = run_with_cache(model, ids)
    for i in range(3):
        layer = f"decoder.layers.{i}"
        if i < 2:
            assert torch.equal(acts[f"{layer}.resid_post"], acts[f"decoder.layers.{i + 1}.resid_pre"])
        assert torch.equal(acts[f"{layer}.resid_mid"], acts[f"{layer}.resid_pre"] + acts[f"{layer}.attn_out"])
        assert torch.equal(acts[f"{layer}.resid_post"], acts[f"{layer}.resid_mid"] + acts[f"{layer}.ffn_out"])
        bias = model.decoder.layers[i].self_attn.out_proj.bias  # type: ignore[union-attr]
        heads = acts[f"{layer}.attn.result"].sum(-2) + (bias if bias is not None else 0)
        torch.testing.assert_close(heads, acts[f"{layer}.attn_out"], atol=1e-5, rtol=0)
        assert acts[f"{layer}.attn.z"].shape == (2, 9, 4, 8)
        pattern = acts[f"{layer}.attn.pattern"]  # (B, H, T, T): rows sum to 1, nothing above the diagonal
        torch.testing.assert_close(pattern.sum(-1), torch.ones(2, 4, 9))
        assert float(pattern.triu(1).abs().max()) == 0.0
    final = model.lm_head(model.decoder.norm(acts["decoder.layers.2.resid_post"]))  # type: ignore[misc]
    torch.testing.assert_close(final, logits, atol=1e-5, rtol=0)


def test_patching_replaces_one_activation_and_bad_names_fail_in_one_line() -> None:
    model = _model()
    clean, other = _ids(seed=1), _ids(seed=2)
    logits, acts = run_with_cache(model, clean)
    clean_stream = acts["decoder.layers.1.resid_pre"]
    with torch.no_grad(), hooked(model, patch={"decoder.layers.1.resid_pre": lambda x: clean_stream}):
        patched = model(other)
    torch.testing.assert_close(patched, logits, atol=1e-5, rtol=0)  # layer 1 on sees only the clean stream
    with torch.no_grad(), hooked(model, patch={"decoder.layers.0.attn.z": torch.zeros_like}, cache="*.attn_out") as a:
        model(clean)
    assert float(a["decoder.layers.0.attn_out"].sub(model.decoder.layers[0].self_attn.out_proj.bias).abs().max()) == 0
    with pytest.raises(QkvError, match=r"unknown hook name 'decoder.layers.1.resid_pst'; did you mean "
                                       r"decoder.layers.1.resid_post"):
        hooked(model, cache="decoder.layers.1.resid_pst").__enter__()
    def without_head_2(value: torch.Tensor) -> torch.Tensor:  # (B, T, H, ·): head 2 writes nothing
        return torch.cat([value[..., :2, :], torch.zeros_like(value[..., 2:3, :]), value[..., 3:, :]], dim=-2)

    runs = {}
    for name in ("decoder.layers.1.attn.z", "decoder.layers.1.attn.result"):
        with torch.no_grad(), hooked(model, patch={name: without_head_2}):
            runs[name] = model(clean)
    torch.testing.assert_close(runs["decoder.layers.1.attn.z"], runs["decoder.layers.1.attn.result"], atol=1e-5,
                               rtol=0)  # a head's result is z_h · W_O[:, h]ᵀ: zeroing either removes the head
    assert not torch.allclose(runs["decoder.layers.1.attn.z"], logits, atol=1e-3)
    with pytest.raises(QkvError, match=r"decoder.layers.0.attn.pattern cannot be replaced \(attention weights are "
                                       r"read-only\); patch decoder.layers.0.attn.z"):
        hooked(model, patch={"decoder.layers.0.attn.pattern": lambda x: x}).__enter__()
    wrong_shape = hooked(model, patch={"decoder.layers.0.resid_pre": lambda x: torch.zeros(3)})
    with pytest.raises(QkvError, match=r"the patch of decoder.layers.0.resid_pre returned shape \(3,\)"), \
            torch.no_grad(), wrong_shape:
        model(clean)


def test_hooks_act_only_on_forward_passes_inside_their_own_block() -> None:
    """A server thread's hooks neither see nor change another thread's forward pass of the same model."""
    model, ids = _model(), _ids()
    with torch.no_grad():
        reference = model(ids)
    results: dict[str, torch.Tensor] = {}
    barrier = threading.Barrier(2)

    def patching() -> None:
        with torch.no_grad(), hooked(model, patch={"decoder.layers.0.resid_pre": torch.zeros_like}):
            barrier.wait()
            results["patched"] = model(ids)

    def plain() -> None:
        barrier.wait()
        with torch.no_grad():
            results["plain"] = model(ids)

    threads = [threading.Thread(target=f) for f in (patching, plain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(results["plain"], reference) and not torch.allclose(results["patched"], reference)


def test_the_lens_last_row_is_the_models_output_and_each_row_recomputes_the_final_norm() -> None:
    model, ids = _model(), _ids()
    lens = logit_lens(model, ids)
    assert lens.labels == ["embeddings", "after layer 0", "after layer 1", "after layer 2"]
    assert lens.logits.shape == (4, 2, 9, 40)
    with torch.no_grad():
        torch.testing.assert_close(lens.probs[-1], model(ids).softmax(-1), atol=1e-6, rtol=0)
        _, acts = run_with_cache(model, ids, names="decoder.layers.1.resid_pre")
        x = acts["decoder.layers.1.resid_pre"]
        normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        want = (normed * model.decoder.norm.weight + model.decoder.norm.bias) @ model.lm_head.weight.T  # type: ignore[union-attr,operator]
    torch.testing.assert_close(lens.logits[1], want, atol=1e-5, rtol=0)  # row 1: the stream after layer 0
    probs, top = lens.top(5)
    assert probs.shape == top.shape == (4, 2, 9, 5) and bool((probs[..., :-1] >= probs[..., 1:]).all())
    post = _model(norm_placement="post", final_norm=False)
    assert "no final norm" in logit_lens(post, ids).note


@pytest.mark.parametrize("over", [{}, {"norm": "rms", "n_kv_heads": 2, "bias": False}])
def test_direct_logit_attribution_adds_up_to_the_logit_difference(over: dict[str, object]) -> None:
    model, ids = _model(**over), _ids(b=1)
    attribution = logit_attribution(model, ids, target=3, contrast=7)
    assert attribution.layers.shape == (3, 2) and attribution.heads.shape == (3, 4)
    assert abs(attribution.parts_sum() - attribution.total) < 1e-4
    with torch.no_grad():
        assert abs(float(model(ids)[0, -1, 3] - model(ids)[0, -1, 7]) - attribution.total) < 1e-5
    with pytest.raises(QkvError, match="needs a pre-norm decoder"):
        logit_attribution(_model(norm_placement="post"), ids, 3)


def test_patching_finds_the_one_position_that_differs_with_the_documented_sign() -> None:
    """Prompts that differ at position 4 only: in a causal model no stream before it changes (effect 0 at every
    layer), the embedding at 4 restores everything (effect 1) and the other embeddings nothing (effect 0)."""
    model = _model()
    clean = _ids(b=1, seed=3)
    corrupted = clean.clone()
    corrupted[0, 4] = (clean[0, 4] + 1) % 40
    with torch.no_grad():
        last = model(clean)[0, -1]
    answer, wrong = int(last.argmax()), int(last.argmin())
    progress: list[tuple[int, int]] = []
    result = activation_patching(model, clean, corrupted, answer, wrong, progress=lambda d, t: progress.append((d, t)))
    assert result.resid.shape == (3, 9) and result.heads is not None and result.heads.shape == (3, 4)
    assert progress[-1] == (6, 6) and len(progress) == 6
    assert float(result.resid[:, :4].abs().max()) < 1e-5  # the past of the change: nothing to restore
    assert abs(float(result.resid[0, 4]) - 1.0) < 1e-5 and float(result.resid[0, 5:].abs().max()) < 1e-5
    assert result.clean > result.corrupted or result.clean < result.corrupted
    with pytest.raises(QkvError, match="same token length, got 9 and 8 tokens"):
        activation_patching(model, clean, clean[:, :8], answer, wrong)
    with pytest.raises(QkvError, match="give the same logit difference"):
        activation_patching(model, clean, clean, answer, wrong)


@pytest.mark.parametrize("over", [{}, {"positions": "rotary", "n_kv_heads": 2, "norm": "rms"}])
def test_patching_from_the_patched_layer_equals_whole_forward_passes(over: dict[str, object]) -> None:
    """A decoder LM's patched passes start at the patched layer from the corrupted stream; the maps equal those
    of whole passes (the plan without its start streams) to float rounding."""
    from qkv.interpret.patching import plan_patching

    model = _model(**over)
    clean, corrupted = _ids(b=1, seed=3), _ids(b=1, seed=4)
    with torch.no_grad():
        last = model(clean)[0, -1]
    answer, wrong = int(last.argmax()), int(last.argmin())
    fast = plan_patching(model, clean, corrupted, answer, wrong)
    assert len(fast.start) == 3
    whole = plan_patching(model, clean, corrupted, answer, wrong)
    whole.start = {}
    rows = list(zip(fast.rows(), whole.rows(), strict=True))
    assert len(rows) == 6
    for (kind, layer, a), (kind_w, layer_w, b) in rows:
        assert (kind, layer) == (kind_w, layer_w)
        assert float((a - b).abs().max()) < 1e-5, (kind, layer)
    assert max(float(a.abs().max()) for (_, _, a), _ in rows) > 0.05  # the maps are not all zero


def test_induction_scores_of_known_patterns() -> None:
    ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    assert induction_targets(ids).tolist() == [[-1, -1, -1, 1, 2, 3]]  # the token after each previous occurrence
    t = 6
    perfect = torch.zeros(1, 2, t, t)
    perfect[0, 0, 3, 1] = perfect[0, 0, 4, 2] = perfect[0, 0, 5, 3] = 1.0  # head 0: induction
    perfect[0, 1] = torch.diag(torch.ones(t - 1), -1)  # head 1: previous token
    assert induction_scores(perfect, ids).tolist() == [1.0, 0.0]
    torch.testing.assert_close(previous_token_scores(perfect), torch.tensor([0.0, 1.0]))
    rep = repeated_tokens(3, 5, 40, torch.Generator().manual_seed(0))
    assert rep.shape == (3, 10) and torch.equal(rep[:, :5], rep[:, 5:])
    induction, previous = head_scores(_model(), rep)
    assert induction.shape == previous.shape == (3, 4) and float(induction.max()) <= 1.0


def test_attention_breakdown_of_uniform_causal_attention_counts_each_position_once() -> None:
    """ids [7 1 2 3 1 2 3], uniform causal attention: queries 4, 5, 6 see 5, 6, 7 positions, each counted in one
    place (target first, then the previous occurrence, itself, position 0, target − 2/+1/+2, elsewhere)."""
    from qkv.interpret import attention_breakdown

    ids = torch.tensor([[7, 1, 2, 3, 1, 2, 3]])
    pattern = torch.tril(torch.ones(7, 7))
    pattern = (pattern / pattern.sum(-1, keepdim=True)).expand(1, 2, 7, 7)  # (B, H, T, T)
    parts = attention_breakdown(pattern, ids)
    mean = lambda *shares: sum(shares) / 3  # noqa: E731  (queries 4, 5, 6)
    expected = {"target": mean(1 / 5, 1 / 6, 1 / 7), "previous occurrence": mean(1 / 5, 1 / 6, 1 / 7),
                "itself": mean(1 / 5, 1 / 6, 1 / 7), "first position": mean(1 / 5, 1 / 6, 1 / 7),
                "near target": mean(1 / 5, 2 / 6, 2 / 7), "elsewhere": mean(0, 0, 1 / 7),
                "largest elsewhere": mean(0, 0, 1 / 7)}  # fmt: skip
    for name, value in expected.items():
        assert torch.allclose(parts[name], torch.full((2,), value)), name
    total = sum(parts[name] for name in expected if name != "largest elsewhere")
    assert torch.allclose(total, torch.ones(2))
    assert torch.allclose(parts["target"], induction_scores(pattern, ids))


def test_the_lens_reads_encoder_decoders_and_masked_lm_encoders_too() -> None:
    """Its last row is the model's own output: an encoder–decoder's decoder (given the source), and a BERT-style
    encoder through its masked-LM head (post-norm, no final norm: the note says what is used instead)."""
    from qkv.models import EncoderConfig

    torch.manual_seed(0)
    seq2seq = build_model(model_cfg(TransformerConfig, src_vocab_size=20, tgt_vocab_size=20, d_model=16, n_heads=2,
                                    n_encoder_layers=1, n_decoder_layers=2, d_ff=32,
                                    norm_placement="pre")).eval()  # fmt: skip
    src, tgt = torch.randint(0, 20, (1, 6)), torch.randint(0, 20, (1, 5))
    lens = logit_lens(seq2seq, src, tgt)
    with torch.no_grad():
        assert lens.labels == ["embeddings", "after layer 0", "after layer 1"]
        assert torch.equal(lens.logits[-1], seq2seq(src, tgt))
    bert = build_model(model_cfg(EncoderConfig, vocab_size=30, d_model=16, n_heads=2, n_layers=2, d_ff=32,
                                 max_positions=16,
                                 mlm_head=True)).eval()  # fmt: skip
    ids = torch.randint(0, 30, (1, 7))
    lens = logit_lens(bert, ids)
    with torch.no_grad():
        assert torch.equal(lens.logits[-1], bert(ids).logits)
    assert lens.note.startswith("this model has no final norm")
