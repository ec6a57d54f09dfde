"""`qkv train --init-from` and LoRA runs through the command: defaults, what is saved, resume, loading, export and
every bad input in one line. The base is a tiny byte-level BPE run (Llama-shaped: the language model's recipe).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_main
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qkv.cli import main
from qkv.data import load_shakespeare
from qkv.io.files import atomic_save_safetensors
from qkv.tasks import load
from qkv.tasks.finetune import LORA_LR, SETTINGS

TINY = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--block-size", "32", "--batch-size", "4",
        "--sample-tokens", "0", "--device", "cpu"]  # fmt: skip
FAST = ["--block-size", "32", "--batch-size", "4", "--eval-tokens", "600", "--sample-tokens", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "excerpt.txt"
    path.write_text(load_shakespeare()[:20_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, text: Path) -> Path:
    """A 6-step BPE run (vocab 300) to fine-tune."""
    out = tmp_path_factory.mktemp("runs") / "base"

    assert main(["train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(text), *TINY, "--max-steps",
                 "6", "--eval-interval", "6", "--out-dir", str(out)]) == 0  # fmt: skip
    return out


def _lora(capsys: pytest.CaptureFixture[str], base: Path, text: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    return run_main(capsys, "train", "--init-from", str(base), "--lora-rank", "4", "--data", str(text), *FAST,
                    "--eval-interval", "2", "--out-dir", str(out), *extra)  # fmt: skip


def test_a_lora_run_trains_only_adapters_and_records_its_base(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    code, _out, err = _lora(capsys, base, text, tmp_path / "lora", "--max-steps", "4")
    assert code == 0, err
    assert re.search(r"qkv train lm: 0\.0\d M parameters \(0\.00 M train\)", err), err
    config = json.loads((tmp_path / "lora" / "config.json").read_text())
    assert config["base"]["path"] == str(base.resolve()) and len(config["base"]["sha256"]) == 64
    training = config["training"]
    optim = training["optim"]  # fine-tuning's recipe, not the speedrun's Muon at 1e-2
    assert (optim["name"], optim["lr"], optim["weight_decay"], optim["beta2"]) == ("adamw", LORA_LR, 0.0, 0.999)
    assert training["schedule"]["warmup_steps"] == SETTINGS["schedule.warmup_steps"]
    assert (training["lora"]["rank"], training["lora"]["alpha"]) == (4, None)  # α: 2 × rank
    assert load(tmp_path / "lora").config.lora.effective_alpha == 8.0
    saved = load_file(tmp_path / "lora" / "model.safetensors")
    assert saved and all(".lora_" in name for name in saved)  # adapters only: the base is referenced, not copied
    assert len(saved) == 2 * 7 * 2
    model = load(tmp_path / "lora").model  # loaded with its base, merged
    assert all(type(m).__name__ != "LoRALinear" for m in model.modules())


def test_a_lora_run_resumes_exactly(capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path) -> None:
    assert _lora(capsys, base, text, tmp_path / "straight", "--max-steps", "4")[0] == 0
    assert _lora(capsys, base, text, tmp_path / "split", "--max-steps", "4", "--max-time", "1e-9")[0] == 0
    code, _, err = run_main(capsys, "train", "--resume", "--out-dir", str(tmp_path / "split"), "--max-time", "none")
    assert code == 0, err
    straight = load_file(tmp_path / "straight" / "last.safetensors")
    resumed = load_file(tmp_path / "split" / "last.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_full_fine_tune_starts_from_the_base_weights(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    code, _, err = run_main(capsys, "train", "--init-from", str(base), "--data", str(text), *FAST, "--max-steps", "2",
                            "--eval-interval", "2", "--out-dir", str(tmp_path / "full"), "--lr", "1e-12")  # fmt: skip
    assert code == 0, err
    tuned, original = load_file(tmp_path / "full" / "model.safetensors"), load_file(base / "model.safetensors")
    assert tuned.keys() == original.keys()
    assert max((tuned[k] - original[k]).abs().max().item() for k in tuned) < 1e-6  # lr ≈ 0: still the base


def test_a_lora_run_exports_merged_to_hugging_face(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    assert _lora(capsys, base, text, tmp_path / "lora", "--max-steps", "2", "--lr", "0.05")[0] == 0
    code, _out, err = run_main(capsys, "convert", str(tmp_path / "lora"), str(tmp_path / "hf"), "--to", "hf")
    assert code == 0, err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    run = load(tmp_path / "lora")
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        assert (run.model(ids) - hf(ids).logits).abs().max() <= 1e-4
        base_logits = load(base).model(ids)
        assert (run.model(ids) - base_logits).abs().max() > 1e-3  # the adapters did change the model
    code, _out, err = run_main(capsys, "convert", str(tmp_path / "lora"), str(tmp_path / "peft"), "--to", "peft")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def _assert_error(result: tuple[int, str, str], message: str) -> None:
    """Exit code 2 and exactly one line on stderr, `qkv …: error: MESSAGE`, no traceback."""
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.split(": error: ", 1)[1].rstrip("\n") == message


def test_bad_fine_tuning_input_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    def train(*argv: str) -> tuple[int, str, str]:
        return run_main(capsys, "train", "--data", str(text), *FAST, "--out-dir", str(tmp_path / "x"), *argv)

    b = str(base.resolve())
    _assert_error(train("--init-from", b, "--lora-rank", "0"), "--lora-rank must be a positive integer, got 0; try 8")
    _assert_error(train("--init-from", b, "--lora-rank", "-2"), "--lora-rank must be a positive integer, got -2; try 8")
    _assert_error(train("--init-from", b, "--lora-rank", "4", "--lora-targets", "c_attn"),
                  "--lora-targets c_attn match(es) no Linear layer of the model; its layers have down, gate, "
                  "k_proj, out_proj, q_proj, up, v_proj (a plain name matches the last part, a regex the whole "
                  "name)")  # fmt: skip
    _assert_error(train("--init-from", str(text)),
                  f"--init-from {text} is not a checkpoint: give a .gguf file, a Hugging Face directory (config.json "
                  "+ safetensors), a `qkv convert` directory or a qkv run")  # fmt: skip
    _assert_error(train("--init-from", b, "--tokenizer", "char"),
                  "--tokenizer contradict(s) --init-from: the tokenizer is the checkpoint's; drop --tokenizer")
    _assert_error(train("--init-from", b, "--n-layers", "5"),
                  "--init-from fixes the model's architecture; drop --n-layers (only the dropouts may change when "
                  "fine-tuning)")  # fmt: skip
    _assert_error(train("--lora-rank", "4"),
                  "--lora-rank and the other LoRA settings adapt a pretrained model; add --init-from CHECKPOINT")


def test_data_prepared_with_another_tokenizer_is_refused(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    assert run_main(capsys, "prepare", str(text), "--out", str(tmp_path / "chars"), "--tokenizer", "char")[0] == 0
    result = run_main(capsys, "train", "--init-from", str(base), "--data", str(tmp_path / "chars"), *FAST,
                      "--out-dir", str(tmp_path / "x"))  # fmt: skip
    _assert_error(result, f"{tmp_path / 'chars'} was prepared with another tokenizer (char) than --init-from's; "
                  f"prepare it with `qkv prepare INPUT --out DIR --tokenizer {base}`, or give a text or JSON Lines "
                  "file to --data")  # fmt: skip


def test_a_lora_run_whose_base_changed_is_refused(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "base"
    shutil.copytree(base, moved)
    assert _lora(capsys, moved, text, tmp_path / "lora", "--max-steps", "2")[0] == 0
    weights = load_file(moved / "model.safetensors")
    weights["embed.tokens.weight"] = weights["embed.tokens.weight"] + 1e-3
    atomic_save_safetensors(moved / "model.safetensors", weights)
    code, _out, err = run_main(capsys, "eval", str(tmp_path / "lora"))
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert re.fullmatch(
        rf"qkv eval: error: {re.escape(str(tmp_path / 'lora'))} is a LoRA run of {re.escape(str(moved))}, whose "
        r"weights have changed since \(sha256 [0-9a-f]{12}…, the run was trained on [0-9a-f]{12}…\); restore that "
        r"model, or train the adapters again on this one\n", err), err  # fmt: skip
    for command in (["generate", str(tmp_path / "lora"), "--max-new-tokens", "2"], ["train", "--resume", "--out-dir",
                    str(tmp_path / "lora"), "--max-steps", "3"]):  # fmt: skip
        code, _, err = run_main(capsys, *command)
        assert code == 2 and "whose weights have changed since" in err


def test_a_lora_run_is_a_base_for_a_full_fine_tune_that_saves_everything(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    assert _lora(capsys, base, text, tmp_path / "lora", "--max-steps", "2", "--lr", "0.05")[0] == 0
    steps = ["--max-steps", "2", "--eval-interval", "2", "--out-dir", str(tmp_path / "full")]
    code, _, err = run_main(capsys, "train", "--init-from", str(tmp_path / "lora"), "--data", str(text), *FAST, *steps)
    assert code == 0, err
    assert " M train)" not in err  # every weight trains, none is frozen
    saved = load_file(tmp_path / "full" / "model.safetensors")
    assert set(saved) == set(load(tmp_path / "lora").model.state_dict())
    code, _, err = run_main(capsys, "train", "--resume", "--out-dir", str(tmp_path / "full"), "--max-steps", "3")
    assert code == 0, err
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["base"]["path"] == str(tmp_path / "lora")  # kept when a resume rewrites config.json
    code, _, err = run_main(capsys, "convert", str(tmp_path / "lora"), str(tmp_path / "merged"))
    assert code == 0, err
    with torch.no_grad():
        ids = torch.randint(0, 300, (1, 16))
        assert torch.equal(load(tmp_path / "merged").model(ids), load(tmp_path / "lora").model(ids))


def test_the_default_targets_fit_a_gpt_block_without_a_gate(
    capsys: pytest.CaptureFixture[str], text: Path, tmp_path: Path
) -> None:
    gelu = ["--model", "activation=gelu", "--max-steps", "2", "--eval-interval", "2", "--out-dir",
            str(tmp_path / "gelu")]
    assert main(["train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(text), *TINY, *gelu]) == 0
    code, _, err = _lora(capsys, tmp_path / "gelu", text, tmp_path / "lora", "--max-steps", "2")
    assert code == 0, err
    adapted = {name.split(".")[-2] for name in load_file(tmp_path / "lora" / "model.safetensors")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "out_proj", "up", "down"}


def test_more_bad_fine_tuning_input_in_one_line(
    capsys: pytest.CaptureFixture[str], base: Path, text: Path, tmp_path: Path
) -> None:
    def train(*argv: str) -> tuple[int, str, str]:
        return run_main(capsys, "train", "--init-from", str(base), "--data", str(text), *FAST, "--out-dir",
                        str(tmp_path / "x"), *argv)  # fmt: skip

    code, _, err = train("--lora-rank", "4", "--lora-targets", "[")
    assert code == 2 and err.startswith("qkv train: error: --lora-targets '[' is not a valid regex (")
    _assert_error(train("--model", "dropout=abc"),
                  "--model dropout=abc: embedding.dropout must be a number, got 'abc'")
    _assert_error(train("--lora-rank", "4", "--strategy", "fsdp"),
                  "LoRA trains on one process or with --strategy ddp (its frozen base is not sharded); drop "
                  "--strategy fsdp")  # fmt: skip
    names = ["self_attn.q_proj"]  # a dotted plain name matches the module path's end
    assert _lora(capsys, base, text, tmp_path / "q", "--max-steps", "1", "--lora-targets", *names)[0] == 0
    assert {n.rsplit(".", 2)[-2] for n in load_file(tmp_path / "q" / "model.safetensors")} == {"q_proj"}
