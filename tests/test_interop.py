"""Hugging Face interop: qkv models loaded from HF checkpoints compute what transformers computes.

Every model here is a tiny random one built by transformers from a config and written with
save_pretrained into a temporary directory: nothing is downloaded. qkv reads it with its own code
(no transformers import in src/) and must give the same logits (fp32, ≤ 1e-4) and the same greedy
tokens; qkv models exported with save_hf must load in transformers with the same logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import model_cfg
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import qkv
from qkv import DecoderLM, DecoderLMConfig, EncoderModel, QkvError, Transformer, TransformerConfig
from qkv.cli import main as cli_main
from qkv.generation import Sampling, generate
from qkv.interop import FAMILIES, family_of, from_hf, read_checkpoint, save_hf, tokenizer_from_hf
from qkv.interop.qkv_dir import load_qkv
from qkv.tasks import load as load_run
from qkv.tokenizers.gpt2 import gpt2_tokenizer

TOL = 1e-4
VOCAB = 97


def _save(model: torch.nn.Module, directory: Path, **kwargs: object) -> Path:
    """save_pretrained into `directory` (safetensors, as transformers writes by default)."""
    model.save_pretrained(directory, **kwargs)  # type: ignore[operator]
    return directory


def _gpt2(**overrides: Any) -> Any:
    cfg: dict[str, Any] = dict(
        vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=64, bos_token_id=None, eos_token_id=None
    )
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides})).eval()


def _llama(**overrides: Any) -> Any:
    cfg: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        rope_theta=500.0,  # not the default, so a wrong base shows
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # the norms start at 1: perturb them so a mis-mapped norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _left_padded(lengths: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, T) and a mask that is False on each row's left padding."""
    ids = torch.randint(0, VOCAB, (len(lengths), t))
    mask = torch.arange(t)[None, :] >= (t - torch.tensor(lengths))[:, None]
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Decoder-only: GPT-2 and Llama
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoder_logits_match_transformers(family: str, tmp_path: Path) -> None:
    hf = _gpt2() if family == "gpt2" else _llama()
    model = from_hf(_save(hf, tmp_path))
    assert isinstance(model, DecoderLM) and not model.training
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoder_left_padded_batch_matches_transformers(family: str, tmp_path: Path) -> None:
    hf = _gpt2() if family == "gpt2" else _llama()
    model = from_hf(_save(hf, tmp_path))
    ids, mask = _left_padded([12, 7, 3], 12)
    with torch.no_grad():
        ours = model(ids, padding_mask=mask)
        theirs = hf(ids, attention_mask=mask.long()).logits
    assert (ours - theirs)[mask].abs().max().item() <= TOL  # padding positions are nobody's business
    if family == "llama":  # rotary attention sees only offsets: left padding must change nothing
        with torch.no_grad():
            alone = hf(ids[1:2, 5:]).logits[0]
        assert (ours[1, 5:] - alone).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoder_greedy_generation_matches_transformers(family: str, tmp_path: Path) -> None:
    hf = _gpt2() if family == "gpt2" else _llama()
    model = from_hf(_save(hf, tmp_path))
    assert isinstance(model, DecoderLM)
    prompt = torch.randint(0, VOCAB, (2, 5))
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    ours = generate(model, prompt, 20, Sampling(temperature=0.0))
    assert ours.shape == (2, 25)
    assert torch.equal(ours, theirs)


def test_gpt2_variants_sharded_untied_and_bare(tmp_path: Path) -> None:
    """Sharded safetensors, an untied head, relu, and a bare GPT2Model-style checkpoint all load."""
    hf = _gpt2(activation_function="relu", n_inner=40, tie_word_embeddings=False, layer_norm_epsilon=1e-3)
    directory = _save(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    model = from_hf(directory)
    assert isinstance(model, DecoderLM)
    block = model.cfg.decoder.block
    assert block.ffn.activation == "relu" and not model.cfg.tie_embeddings and block.norm.eps == 1e-3
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL
    # The original gpt2 upload has no "transformer." prefix and keeps the causal-mask buffers.
    hf = _gpt2()
    bare = tmp_path / "bare"
    bare.mkdir()
    state = hf.state_dict()
    tensors = {k.removeprefix("transformer."): v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(tensors, bare / "model.safetensors", metadata={"format": "pt"})
    (bare / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with torch.no_grad():
        assert (from_hf(bare)(ids) - hf(ids).logits).abs().max().item() <= TOL


def test_llama_untied_with_biases(tmp_path: Path) -> None:
    hf = _llama(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, num_key_value_heads=1)
    model = from_hf(_save(hf, tmp_path))
    assert isinstance(model, DecoderLM)
    attention = model.cfg.decoder.block.attention
    assert attention.bias and model.cfg.decoder.block.ffn.bias and getattr(attention, "n_kv_heads", None) == 1
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------
# Encoder-only (BERT) and encoder–decoder (BART)
# ---------------------------------------------------------------------------------------------


def test_bert_matches_transformers_with_padding_and_token_types(tmp_path: Path) -> None:
    hf_cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    hf = BertModel(hf_cfg).eval()
    model = from_hf(_save(hf, tmp_path))
    assert isinstance(model, EncoderModel)
    block = model.cfg.encoder.block
    assert block.norm.eps == 1e-12 and block.norm_placement == "post" and model.pooler is not None
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.arange(11)[None, :] < torch.tensor([11, 6, 2])[:, None]  # right padding
    types = (torch.arange(11)[None, :] >= 4).long().expand(3, -1)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, token_type_ids=types)
        theirs = hf(ids, attention_mask=mask.long(), token_type_ids=types)
    assert (ours.hidden - theirs.last_hidden_state)[mask].abs().max().item() <= TOL
    assert ours.pooled is not None
    assert (ours.pooled - theirs.pooler_output).abs().max().item() <= TOL


@pytest.mark.parametrize("scale_embedding", [False, True])
def test_bart_matches_transformers_with_padding(scale_embedding: bool, tmp_path: Path) -> None:
    hf_cfg = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        scale_embedding=scale_embedding,
    )
    hf = BartForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # give the zero-initialised output bias and the norms something to show
        hf.final_logits_bias.normal_()
        for name, p in hf.named_parameters():
            if "layer_norm" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if "embed_positions" in name:  # std 1, not 0.02: an off-by-2 position would dominate the logits
                p.normal_()
    model = from_hf(_save(hf, tmp_path))
    assert isinstance(model, Transformer)
    src = torch.randint(3, VOCAB, (2, 9))
    tgt = torch.randint(3, VOCAB, (2, 7))
    src_keep = torch.arange(9)[None, :] < torch.tensor([9, 5])[:, None]
    tgt_keep = torch.arange(7)[None, :] < torch.tensor([7, 4])[:, None]
    with torch.no_grad():
        ours = model(src, tgt, src_keep[:, None, None, :], tgt_keep[:, None, None, :])
        theirs = hf(
            input_ids=src,
            attention_mask=src_keep.long(),
            decoder_input_ids=tgt,
            decoder_attention_mask=tgt_keep.long(),
        ).logits
    assert (ours - theirs)[tgt_keep].abs().max().item() <= TOL


def test_bart_with_a_shape_per_side_loads_fine_tunes_and_exports(tmp_path: Path) -> None:
    """Encoder 3 layers × 4 heads, FFN 48; decoder 1 layer × 2 heads, FFN 80: logits within 1e-4 of
    transformers'; after a few training steps in qkv, save_hf writes what BartForConditionalGeneration loads with
    qkv's logits, and from_hf reads it back as the same config."""
    torch.manual_seed(0)
    hf = BartForConditionalGeneration(BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=3, decoder_layers=1,
                                                 encoder_attention_heads=4, decoder_attention_heads=2,
                                                 encoder_ffn_dim=48, decoder_ffn_dim=80, max_position_embeddings=64,
                                                 dropout=0.0, attention_dropout=0.0)).eval()  # fmt: skip
    model = from_hf(_save(hf, tmp_path / "bart"))
    assert isinstance(model, Transformer)
    enc, dec = model.cfg.encoder, model.cfg.decoder
    assert (enc.n_layers, enc.block.attention.n_heads, enc.block.ffn.d_ff) == (3, 4, 48)
    assert (dec.n_layers, dec.block.attention.n_heads, dec.block.ffn.d_ff) == (1, 2, 80)
    src, tgt = torch.randint(3, VOCAB, (4, 9)), torch.randint(3, VOCAB, (4, 7))
    with torch.no_grad():
        before = model(src, tgt)
        assert (before - hf(input_ids=src, decoder_input_ids=tgt).logits).abs().max().item() <= TOL
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(3):  # fine-tune: teacher-forced next-token loss on the batch
        loss = torch.nn.functional.cross_entropy(model(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    save_hf(model, tmp_path / "tuned")
    exported = BartForConditionalGeneration.from_pretrained(tmp_path / "tuned").eval()
    again = from_hf(tmp_path / "tuned")
    with torch.no_grad():
        ours = model(src, tgt)
        assert (ours - before).abs().max().item() > 1e-2  # the weights moved
        assert (exported(input_ids=src, decoder_input_ids=tgt).logits - ours).abs().max().item() <= TOL
        assert isinstance(again, Transformer) and again.cfg == model.cfg and torch.equal(again(src, tgt), ours)


# ---------------------------------------------------------------------------------------------
# Export: qkv → transformers
# ---------------------------------------------------------------------------------------------

# final_norm given, as both families' configs say it: the config read back from the export is then the same one.
_GPT2_SHAPED: dict[str, Any] = dict(positions="learned", norm="layer", activation="gelu_tanh", bias=True,
                                    final_norm=True)  # fmt: skip
_LLAMA_SHAPED: dict[str, Any] = dict(
    positions="rotary", norm="rms", activation="swiglu", bias=False, n_kv_heads=2, rope_base=300.0, final_norm=True
)


@pytest.mark.parametrize("shape", [_GPT2_SHAPED, _LLAMA_SHAPED], ids=["gpt2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_save_hf_round_trip(shape: dict[str, Any], tied: bool, tmp_path: Path) -> None:
    cfg = model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_positions=64,
                    tie_embeddings=tied, **shape)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # GPT-2's init zeroes biases and sets norms to 1: make every tensor count
            p.add_(0.05 * torch.randn_like(p))
    save_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if shape is _GPT2_SHAPED else "LlamaForCausalLM")
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL
        back = from_hf(tmp_path)  # and qkv reads its own export back, tensor for tensor
    assert back.cfg == model.cfg
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_save_hf_refuses_models_without_an_hf_family(tmp_path: Path) -> None:
    cfg = model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1, positions="sinusoidal")
    with pytest.raises(QkvError, match=r"not GPT-2: embedding.positions=SinusoidalPositionsConfig.*not Llama"):
        save_hf(DecoderLM(cfg), tmp_path)
    llama_like = {k: v for k, v in _LLAMA_SHAPED.items() if k != "n_kv_heads"}  # MLA has no K/V head count
    latent = model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1, attention="mla",
                       **llama_like)  # fmt: skip
    with pytest.raises(QkvError, match=r"not Llama: decoder.block.attention.kind='mla'"):  # rotary, RMS, SwiGLU
        save_hf(DecoderLM(latent), tmp_path)
    assert not any(tmp_path.iterdir())  # refused before writing anything


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    directory = _save(_gpt2(), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(QkvError, match=r"unsupported model_type 'mamba'.*gpt2"):
        from_hf(directory)
    assert {"gpt2", "llama", "bert", "bart"} <= set(FAMILIES)  # the registry, keyed by model_type
    assert family_of({"model_type": "llama"}).name == "Llama"


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    directory = _save(_llama(), tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QkvError, match=r"Llama checkpoint .* lacks tensor model\.layers\.1\.mlp\.gate_proj\.weight"):
        from_hf(directory)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    directory = _save(_gpt2(), tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["transformer.h.0.attn.c_attn.weight"] = torch.zeros(32, 64)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QkvError, match=r"GPT-2 .*tensor transformer\.h\.0\.attn\.c_attn\.weight has shape \(32, 64\)"):
        from_hf(directory)


def test_unsupported_options_are_named(tmp_path: Path) -> None:
    directory = _save(_llama(), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(QkvError, match="Llama checkpoints with rope_type='yarn'"):
        from_hf(directory)


def test_pickle_checkpoints_are_refused(tmp_path: Path) -> None:
    torch.save({"wte.weight": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(QkvError, match=r"refusing to load pickle file.*pytorch_model\.bin"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(QkvError, match="pickle"):
        from_hf(tmp_path)
    with pytest.raises(QkvError, match="pickle"):
        from_hf(tmp_path / "pytorch_model.bin")


def test_custom_code_is_refused(tmp_path: Path) -> None:
    directory = _save(_gpt2(), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Evil"}}))
    with pytest.raises(QkvError, match="custom model code"):
        from_hf(directory)


def test_new_core_options_default_to_old_behaviour() -> None:
    """An embedding norm, a position offset and an output bias change nothing unless asked for."""
    lm = DecoderLM(model_cfg(DecoderLMConfig, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1))
    assert lm.embed.norm is None and lm.embed.positions is not None
    assert lm.embed.positions.weight.shape == (1024, 32)
    tr = Transformer(model_cfg(TransformerConfig, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=32, n_heads=4))
    assert tr.generator.bias is None and tr.src_embed.norm is None
    with pytest.raises(QkvError, match=r"embedding.positions has no field 'offset'"):  # learned positions' alone
        model_cfg(DecoderLMConfig, vocab_size=VOCAB, positions="rotary", position_offset=2)


# ---------------------------------------------------------------------------------------------
# qkv convert
# ---------------------------------------------------------------------------------------------


def test_convert_to_qkv_run_directory_and_back_to_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = _llama()
    src = _save(hf, tmp_path / "hf")
    gpt2_tokenizer().hf_tokenizer.save(str(src / "tokenizer.json"))  # any byte-level BPE will do
    assert cli_main(["convert", str(src), str(tmp_path / "run")]) == 0
    assert "Llama" in capsys.readouterr().out
    run = load_run(tmp_path / "run")  # what `qkv generate` and `qkv eval` use
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        assert (run.model(ids) - hf(ids).logits).abs().max().item() <= TOL
        assert (load_qkv(tmp_path / "run")(ids) - hf(ids).logits).abs().max().item() <= TOL
    assert run.tokenizer.encode("Hello world") == [15496, 995]
    assert cli_main(["convert", str(src), str(tmp_path / "hf2"), "--to", "hf"]) == 0
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= TOL
    tok = tokenizer_from_hf(tmp_path / "hf2")
    assert tok is not None and tok.encode("Hello world") == [15496, 995]


def test_convert_encoder_decoder_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = BartForConditionalGeneration(
        BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32)
    ).eval()  # fmt: skip
    src = _save(hf, tmp_path / "bart")
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 0
    model = load_qkv(tmp_path / "out")
    assert isinstance(model, Transformer)
    s, t = torch.randint(3, VOCAB, (1, 5)), torch.randint(3, VOCAB, (1, 4))
    with torch.no_grad():
        assert (model(s, t) - hf(input_ids=s, decoder_input_ids=t).logits).abs().max().item() <= TOL
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 2  # not empty
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out3")]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "model not found" in err
    assert len(err.strip().splitlines()) == 2  # one line per failure, no traceback
    assert cli_main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf"]) == 0  # BART exports back, as BART
    again = BartForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (again(input_ids=s, decoder_input_ids=t).logits - hf(input_ids=s, decoder_input_ids=t).logits
                ).abs().max().item() <= TOL  # fmt: skip


def test_from_hf_is_exported_and_needs_no_transformers(tmp_path: Path) -> None:
    hf = _gpt2()
    ckpt = read_checkpoint(_save(hf, tmp_path))
    assert qkv.from_hf is from_hf
    code = f"import sys, qkv; qkv.from_hf({str(tmp_path)!r}); assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():
        assert (from_hf(ckpt)(ids) - hf(ids).logits).abs().max().item() <= TOL
