"""What a new user hit, one test each: formats from names, data refused before anything is written, a bounded last
evaluation that shows progress, times that say what they count, and messages that name what was typed."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import config, run_main, tiny_data

from qkv.errors import QkvError
from qkv.io.progress import ProgressLine, batch_progress
from qkv.tasks import train

LLAMA = {"positions": "rotary", "norm": "rms", "activation": "swiglu", "bias": False, "final_norm": True,
         "n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.0, "max_positions": 64}  # fmt: skip
FAST = ["--block-size", "32", "--batch-size", "4", "--eval-interval", "2", "--eval-tokens", "600", "--sample-tokens",
        "0", "--device", "cpu"]  # fmt: skip
CONVERSATION = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BPE language model run (context 64), its Hugging Face export and a prepared char data directory."""
    from qkv.cli import main

    root = tmp_path_factory.mktemp("new-user")
    data = tiny_data(root / "data")
    run = root / "run"
    train(config("lm", data=str(data["text"]), tokenizer="bpe", vocab_size=300, model=LLAMA, block_size=32,
                 batch_size=4, max_steps=2, eval_interval=2, eval_tokens=600, sample_tokens=0, device="cpu",
                 out_dir=str(run)), verbose=False)  # fmt: skip
    assert main(["convert", str(run), str(root / "hf"), "--to", "hf"]) == 0
    assert main(["prepare", str(data["text"]), "--tokenizer", "char", "--out", str(root / "chars")]) == 0
    return {"run": run, "hf": root / "hf", "chars": root / "chars", "text": data["text"], "root": root}


def _error(result: tuple[int, str, str], command: str) -> str:
    """The one-line error of a refused command (exit 2, no traceback), without its `qkv CMD: error: ` prefix."""
    code, _, err = result
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    prefix = f"qkv {command}: error: "
    assert err.startswith(prefix) and prefix not in err[len(prefix) :], err  # the program is named once
    return err[len(prefix) :].strip()


# ---------------------------------------------------------------------------------------------------- convert


def test_convert_takes_the_format_from_a_gguf_name_and_refuses_a_contradiction(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(capsys, "convert", str(made["run"]), str(tmp_path / "out.gguf"))[0] == 0
    assert (tmp_path / "out.gguf").is_file() and (tmp_path / "out.gguf").read_bytes()[:4] == b"GGUF"
    message = _error(run_main(capsys, "convert", str(made["run"]), str(tmp_path / "b.gguf"), "--to", "qkv"), "convert")
    assert message.startswith(f"DST {tmp_path / 'b.gguf'} is named like a GGUF file but --to qkv writes a directory")
    assert not (tmp_path / "b.gguf").exists()
    out = run_main(capsys, "--help")[1]
    assert re.search(r"convert +convert a model between formats: .*\.gguf file.*PEFT adapters", " ".join(out.split()))


def test_a_truncated_gguf_is_called_incomplete(made: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    whole = tmp_path / "whole.gguf"
    assert run_main(capsys, "convert", str(made["run"]), str(whole))[0] == 0
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    message = _error(run_main(capsys, "generate", str(cut)), "generate")
    assert message == (f"{cut} is incomplete or damaged: it ends before the data its header describes "
                       f"({cut.stat().st_size:,} bytes); copy or download it again")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- data


@pytest.mark.parametrize("shape", ["array", "txt"])
def test_conversations_in_another_shape_say_to_write_json_lines(
    shape: str, made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / ("chat.jsonl" if shape == "array" else "chat.txt")
    text = json.dumps([CONVERSATION] * 3) if shape == "array" else "\n".join([json.dumps(CONVERSATION)] * 3)
    path.write_text(text + "\n", encoding="utf-8")
    out = tmp_path / "tuned"
    message = _error(run_main(capsys, "train", "--init-from", str(made["hf"]), "--data", str(path), "--out-dir",
                              str(out), *FAST), "train")  # fmt: skip
    expected = "is a JSON array; write JSON Lines" if shape == "array" else "holds conversations; write them as JSON"
    assert expected in message and '{"messages": [{"role": "user"' in message and not out.exists()


def test_a_prepared_directory_without_meta_json_is_refused(made: dict[str, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    data = tmp_path / "chars"
    shutil.copytree(made["chars"], data)
    (data / "meta.json").unlink()
    out = tmp_path / "run"
    message = _error(run_main(capsys, "train", "--data", str(data), "--max-steps", "2", "--out-dir", str(out), *FAST),
                     "train")  # fmt: skip
    assert message.startswith(f"{data} has shards and tokenizer.json but no meta.json") and not out.exists()


def test_prepare_refuses_its_input_as_its_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 100, encoding="utf-8")
    message = _error(run_main(capsys, "prepare", str(corpus), "--tokenizer", "char", "--out", str(corpus)), "prepare")
    assert message == f"--out {corpus} is the input directory itself; write the shards to another one, e.g. --out " \
                      "corpus-data"  # fmt: skip
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]


def test_a_bad_bpe_vocabulary_is_refused_before_learning_starts(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("some text " * 100, encoding="utf-8")
    code, out, err = run_main(capsys, "prepare", str(tmp_path / "a.txt"), "--tokenizer", "bpe", "--vocab-size", "10",
                              "--out", str(tmp_path / "d"))  # fmt: skip
    assert code == 2 and "learning" not in out + err and not (tmp_path / "d").exists()
    assert err.strip().endswith("BPE vocab size must be between 257 (256 bytes + <|endoftext|>) and 1,000,000, got 10")


@pytest.mark.parametrize("damage", ["missing val shard", "token id past the vocabulary"])
def test_bad_data_is_refused_before_the_run_directory_exists(damage: str, made: dict[str, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    data = tmp_path / "chars"
    shutil.copytree(made["chars"], data)
    if damage == "missing val shard":
        next(data.glob("val_*.bin")).unlink()
        expected = "cannot read the shard"
    else:
        shard = next(data.glob("val_*.bin"))
        raw = bytearray(shard.read_bytes())
        raw[-2:] = (60000).to_bytes(2, "little")  # the last token of the split, where no periodic evaluation looks
        shard.write_bytes(bytes(raw))
        expected = "holds token id 60000, outside the vocabulary"
    out = tmp_path / "run"
    message = _error(run_main(capsys, "train", "--data", str(data), "--max-steps", "2", "--out-dir", str(out), *FAST),
                     "train")  # fmt: skip
    assert expected in message and not out.exists()


# ---------------------------------------------------------------------------------------------------- evaluation


def test_the_last_evaluation_reads_at_most_what_the_run_trained_on() -> None:
    """Unset: the whole split when it is no longer than the tokens trained on, else that many; 0: always all."""
    cfg = config("lm")
    assert cfg.final_eval_tokens is None and cfg.eval_tokens == 8192
    assert cfg.final_budget(358_400) == 358_400 and cfg.final_budget(1000) == 8192 and cfg.final_budget(0) is None
    assert config("lm", eval_tokens=None).final_budget(1000) is None  # periodic evaluations read it all: so does it
    assert config("lm", final_eval_tokens=0).final_budget(10**9) is None
    assert config("lm", final_eval_tokens=5000).final_budget(10**9) == 5000
    with pytest.raises(QkvError, match="final-eval-tokens must be ≥ 2, got 1"):
        config("lm", final_eval_tokens=1)


def test_a_long_evaluation_shows_its_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing for a loop that ends within 5 s; then a line with the count and the time left, every 10 s in a log."""
    import io

    now = [100.0]
    monkeypatch.setattr("qkv.io.progress.time.monotonic", lambda: now[0])
    stream = io.StringIO()
    show = batch_progress(ProgressLine(stream), "last evaluation")
    for done in range(1, 11):  # 1 s a batch: 10 s in all
        now[0] += 1.0
        show(done, 10)
    assert stream.getvalue().splitlines() == ["last evaluation: batch 5/10  ETA 0:05"]
    quick, now[0] = io.StringIO(), 0.0
    show = batch_progress(ProgressLine(quick), "evaluating")
    for done in range(1, 11):  # 0.4 s a batch: 4 s in all
        now[0] += 0.4
        show(done, 10)
    assert quick.getvalue() == ""


def test_a_run_says_what_its_times_count_and_warns_when_every_step_is_warm_up(
    made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(capsys, "train", "--data", str(made["text"]), "--max-steps", "2", "--warmup-steps", "5",
                              "--out-dir", str(tmp_path / "run"), "--n-layers", "1", "--d-model", "16", "--n-heads",
                              "2", *FAST)  # fmt: skip
    assert code == 0, err
    assert "note: every step is warm-up (--warmup-steps 5 ≥ --max-steps 2): the learning rate climbs to --lr" in err
    assert re.search(r"after 2 steps, \d+ s of training and evaluation, \d+ s since the run began — run saved", out)


# ---------------------------------------------------------------------------------------------------- messages


def test_fine_tuning_messages_name_what_was_typed(made: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    base, data = str(made["hf"]), str(made["text"])
    message = _error(run_main(capsys, "train", "--init-from", base, "--data", data, "--n-layers", "2", "--model",
                              "d_model=64", "--model", "dropout=0.1", *FAST), "train")  # fmt: skip
    assert message == ("--init-from fixes the model's architecture; drop --n-layers, --model d_model=64 (only the "
                       "dropouts may change when fine-tuning)")  # fmt: skip
    message = _error(run_main(capsys, "train", "--init-from", base, "--data", data, "--block-size", "100", "--out-dir",
                              str(tmp_path / "x"), *FAST[2:]), "train")  # fmt: skip
    assert message == "--block-size 100 is longer than --init-from's context of 64 tokens; give at most 64"
    long = tmp_path / "long.jsonl"
    turn = {"messages": [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]}
    long.write_text(json.dumps(turn) + "\n" + json.dumps(turn) + "\n", encoding="utf-8")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    message = _error(run_main(capsys, "train", "--init-from", base, "--data", str(long), "--chat-template",
                              str(template), "--out-dir", str(tmp_path / "y"), "--device", "cpu"), "train")  # fmt: skip
    assert message.endswith("the model's context is 64 tokens: give conversations that fit it")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    message = _error(run_main(capsys, "chat", base, "--chat-template", str(broken), "--max-new-tokens", "8"), "chat")
    assert message.startswith(f"--chat-template {broken} is not a valid Jinja template (") and \
        message.endswith("); fix that file")  # fmt: skip


def test_the_explorer_says_a_damaged_run_is_damaged(made: dict[str, Path], tmp_path: Path) -> None:
    from qkv.explore.library import RequestError, RunLibrary

    run = tmp_path / "runs" / "broken"
    shutil.copytree(made["run"], run)
    (run / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:100])
    with pytest.raises((RequestError, QkvError)) as refused:
        RunLibrary(None, tmp_path / "runs").load(str(run))
    assert str(refused.value).startswith(f"{run / 'model.safetensors'} is damaged or incomplete (header claims ")
    assert str(refused.value).endswith("after it); copy or write it again")


def test_help_shows_every_default_and_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    from qkv.chat import CHAT_SAMPLING
    from qkv.cli.runs import CHAT_TEMPERATURE, CHAT_TOP_P

    assert (CHAT_SAMPLING.temperature, CHAT_SAMPLING.top_k, CHAT_SAMPLING.top_p) == (CHAT_TEMPERATURE, None, CHAT_TOP_P)
    for command in ("generate", "chat"):
        text = " ".join(run_main(capsys, command, "--help")[1].split())
        for flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed"):
            assert re.search(rf"{flag} \S+ \S.*?\(default", text), (command, flag)
        assert "--checkpoint {best,last}" in text
    chat = " ".join(run_main(capsys, "chat", "--help")[1].split())
    assert "(default: the checkpoint's recommendation, else 0.2)" in chat
    assert "auto, cpu, cuda, cuda:N or mps" in " ".join(run_main(capsys, "interpret", "hooks", "--help")[1].split())
    message = _error(run_main(capsys, "generate", "x", "--checkpoint", "bets"), "generate")
    assert message.startswith("argument --checkpoint: invalid choice: 'bets' (choose from best, last)") or \
        message.startswith("argument --checkpoint: invalid choice: 'bets' (choose from 'best', 'last')")  # fmt: skip


def test_chat_takes_the_checkpoints_recommended_sampling(made: dict[str, Path], tmp_path: Path) -> None:
    """generation_config.json's sampling (when it samples) beats qkv's default; flags beat both."""
    from qkv.chat import CHAT_SAMPLING, chat_sampling
    from qkv.tasks import load

    hf = tmp_path / "hf"
    shutil.copytree(made["hf"], hf)
    assert load(hf).metadata.get("sampling") is None  # this one recommends nothing
    (hf / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95}))
    recommended: Any = load(hf).metadata["sampling"]
    assert recommended == {"temperature": 0.6, "top_k": 50, "top_p": 0.95}  # transformers' top_k when unset
    none: dict[str, Any] = {"temperature": None, "top_k": None, "top_p": None, "seed": None}
    assert chat_sampling(none, None) == (CHAT_SAMPLING, "qkv's default for chat")
    sampling, origin = chat_sampling(none, recommended)
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.6, 50, 0.95)
    assert origin == "the checkpoint's recommendation"
    sampling, origin = chat_sampling({**none, "temperature": 0.0, "seed": 3}, recommended)
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.0, 0.95, 3)
    assert origin == "as given, the rest the checkpoint's recommendation"


def test_the_commands_a_run_suggests_name_qkv_as_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`more: …` hints say `qkv` only when that is on PATH; else the venv's script or `python -m qkv`, as typed."""
    from qkv.io.invocation import program

    script = tmp_path / ".venv" / "bin" / "qkv"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [str(script), "train"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert program() == ".venv/bin/qkv"
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    assert program() == "qkv"
    monkeypatch.setattr("sys.argv", ["/somewhere/qkv/__main__.py", "train"])
    monkeypatch.setattr("sys.executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert program() == ".venv/bin/python -m qkv"
