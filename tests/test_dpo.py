"""`qkv train dpo` through the command: the reference taken once and kept, LoRA and full tuning, exact resume, eval,
chat and export of the run, and bad input refused in one line. The base is a tiny BPE language model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import config, run_main, tiny_data, tiny_settings
from safetensors.torch import load_file

from qkv.chat import ChatTemplate
from qkv.posttrain.preferences import encode_pairs, read_preferences
from qkv.tasks import load
from qkv.tasks.dpo import LORA_LR, REFERENCE_FILE, SETTINGS, reply_logps

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")  # fmt: skip
FAST = ["--batch-size", "2", "--eval-interval", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BPE language model, a chat template for it, and twelve preference pairs."""
    from qkv.tasks import train

    root = tmp_path_factory.mktemp("dpo")
    lm = {**tiny_settings("lm", tiny_data(root / "data")), "block_size": 64}
    train(config("lm", **lm, tokenizer="bpe", vocab_size=300, out_dir=str(root / "base")), verbose=False)
    (root / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    words = ("good", "night", "sweet", "prince", "rest", "flights", "angels", "sing", "thee", "to", "my", "lord")
    rows = [{"prompt": f"Say {w}.", "chosen": f"{w}!", "rejected": f"No, {words[i - 1]}."} for i, w in enumerate(words)]
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"root": root, "base": root / "base", "prefs": root / "prefs.jsonl", "template": root / "template.jinja"}


def _dpo(capsys: pytest.CaptureFixture[str], s: dict[str, Path], out: Path, *extra: str) -> tuple[int, str, str]:
    return run_main(capsys, "train", "dpo", "--init-from", str(s["base"]), "--data", str(s["prefs"]),
                    "--chat-template", str(s["template"]), *FAST, "--out-dir", str(out), *extra)  # fmt: skip


def test_a_lora_dpo_run_keeps_the_base_as_its_reference(capsys: pytest.CaptureFixture[str], setup: dict[str, Path],
                                                        tmp_path: Path) -> None:  # fmt: skip
    code, out, err = _dpo(capsys, setup, tmp_path / "lora", "--lora-rank", "4", "--max-steps", "4", "--lr", "0.02",
                          "--dpo-loss", "ipo", "--beta", "0.5")  # fmt: skip
    assert code == 0, err
    assert "11 train / 1 val preference pairs" in err and "ipo loss, β 0.5" in err
    assert "chosen preferred" in out
    stored = json.loads((tmp_path / "lora" / "config.json").read_text())
    training = stored["training"]
    assert stored["task"] == "dpo" and (training["beta"], training["dpo_loss"]) == (0.5, "ipo")
    assert training["optim"]["lr"] == 0.02 and training["lora"]["rank"] == 4
    saved = load_file(tmp_path / "lora" / "model.safetensors")
    assert saved and all(".lora_" in name for name in saved)  # the adapters alone: the base is the reference
    # the stored reference is the base's own log-probability of each reply
    base = load(setup["base"])
    pairs = encode_pairs(read_preferences(setup["prefs"]), ChatTemplate.of(setup["template"].read_text(),
                         base.tokenizer), base.tokenizer, 64)  # fmt: skip
    reference = load_file(tmp_path / "lora" / REFERENCE_FILE)
    assert torch.allclose(reference["train"], reply_logps(base.model, pairs.train, 3, torch.device("cpu")),
                          atol=1e-5)  # fmt: skip
    assert reference["val"].shape == (2,) and (reference["train"] < 0).all()
    code, out, err = run_main(capsys, "eval", str(tmp_path / "lora"))
    assert code == 0 and "val DPO loss" in out and "chosen preferred" in out, err
    tuned = load(tmp_path / "lora", expect="lm")  # a DPO run is a language model: chat, serve and eval read it
    ids = torch.tensor([base.tokenizer.encode("Say good.")])
    with torch.no_grad():
        assert (tuned.model(ids) - base.model(ids)).abs().max() > 1e-4
    code, _, err = run_main(capsys, "convert", str(tmp_path / "lora"), str(tmp_path / "peft"), "--to", "peft")
    assert code == 0, err


def test_a_full_dpo_run_resumes_exactly_and_uses_dpos_recipe(
    capsys: pytest.CaptureFixture[str], setup: dict[str, Path], tmp_path: Path
) -> None:
    assert _dpo(capsys, setup, tmp_path / "straight", "--max-steps", "4", "--lr", "1e-3")[0] == 0
    training = json.loads((tmp_path / "straight" / "config.json").read_text())["training"]
    assert training["schedule"]["warmup_steps"] == SETTINGS["schedule.warmup_steps"] and training["block_size"] == 64
    assert (training["beta"], training["dpo_loss"], training["optim"]["name"]) == (0.1, "sigmoid", "adamw")
    assert _dpo(capsys, setup, tmp_path / "split", "--max-steps", "4", "--lr", "1e-3", "--max-time", "1e-9")[0] == 0
    code, _, err = run_main(capsys, "train", "--resume", "--out-dir", str(tmp_path / "split"), "--max-time", "none")
    assert code == 0, err
    straight = load_file(tmp_path / "straight" / "last.safetensors")
    resumed = load_file(tmp_path / "split" / "last.safetensors")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "val_accuracy" in m]
    assert evals and all(0 <= m["val_accuracy"] <= 1 for m in evals)


def test_the_lora_rate_is_dpos(setup: dict[str, Path]) -> None:
    from qkv.tasks import recipe

    cfg = recipe("dpo", {"init_from": str(setup["base"]), "lora_rank": 2, "source": str(setup["prefs"])})
    assert cfg.optim.lr == LORA_LR and cfg.task == "dpo" and cfg.block_size is None


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "a", "rejected": "b"}', 'line 2 has no "chosen"'),
    ('{"prompt": "a", "chosen": "b", "rejected": "b"}', 'line 2: "chosen" and "rejected" are the same')])  # fmt: skip
def test_bad_pairs_are_refused_before_anything_is_written(capsys: pytest.CaptureFixture[str], setup: dict[str, Path],
                                                          line: str, message: str) -> None:  # fmt: skip
    bad = setup["root"] / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n", encoding="utf-8")
    code, _, err = run_main(capsys, "train", "dpo", "--init-from", str(setup["base"]), "--data", str(bad),
                            "--out-dir", str(setup["root"] / "never"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{bad} {message}" in err
    assert not (setup["root"] / "never").exists()


def test_dpo_without_a_checkpoint_or_template_says_what_to_give(capsys: pytest.CaptureFixture[str],
                                                                setup: dict[str, Path]) -> None:  # fmt: skip
    for given in (["--data", str(setup["prefs"])], ["--init-from", str(setup["base"])]):
        for out in ([], ["--out-dir", str(setup["root"] / "never")]):
            code, _, err = run_main(capsys, "train", "dpo", *given, *out)
            assert code == 2 and "give --init-from CHECKPOINT and --data prefs.jsonl" in err
    assert not (setup["root"] / "never").exists()
    code, _, err = run_main(capsys, "train", "dpo", "--init-from", str(setup["base"]), "--data", str(setup["prefs"]))
    assert code == 2 and "has no chat template" in err and "--chat-template FILE" in err
    code, _, err = run_main(capsys, "train", "dpo", "--init-from", str(setup["base"]), "--data", str(setup["prefs"]),
                            "--beta", "0")  # fmt: skip
    assert code == 2 and "--beta must be positive" in err


def test_two_processes_train_as_one(setup: dict[str, Path], tmp_path: Path) -> None:
    """2 gloo processes of 2 pairs each equal 1 process of 4 (the reference computed alike on each)."""
    from launching import one_and_two, weights_diff

    common = ["dpo", "--init-from", str(setup["base"]), "--data", str(setup["prefs"]), "--chat-template",
              str(setup["template"]), "--max-steps", "2", "--eval-interval", "2", "--lr", "1e-3",
              "--device", "cpu"]  # fmt: skip
    one, two = one_and_two(common, tmp_path)
    assert weights_diff(one, two) < 1e-5
    assert torch.equal(load_file(one / REFERENCE_FILE)["train"], load_file(two / REFERENCE_FILE)["train"])
