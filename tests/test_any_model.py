"""Every command that reads a model takes the four kinds of model qkv reads: a run of `qkv train`, a .gguf file, a
Hugging Face directory and a `qkv convert` directory (qkv.tasks.load reads them all); `qkv translate` refuses a
language model in one line."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import config, explore_server, run_main, tiny_data

from qkv.tasks import load, train

KINDS = ("run", "gguf", "hf", "convert")
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip
# Llama-shaped, so that every format holds it (GGUF files are Llama's); a byte-level BPE, as GGUF's tokenizers are.
LLAMA = {"positions": "rotary", "norm": "rms", "activation": "swiglu", "bias": False, "final_norm": True,
         "n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny language model as a run, then converted: a .gguf file, a Hugging Face directory, a qkv directory."""
    from qkv.cli import main

    root = tmp_path_factory.mktemp("kinds")
    data = tiny_data(root / "data")
    paths = {"run": root / "run", "gguf": root / "model.gguf", "hf": root / "hf", "convert": root / "qkv"}
    train(config("lm", data=str(data["text"]), tokenizer="bpe", vocab_size=300, model=LLAMA, block_size=32,
                 batch_size=4, max_steps=2, eval_interval=2, eval_tokens=600, sample_tokens=0, device="cpu",
                 out_dir=str(paths["run"])), verbose=False)  # fmt: skip
    assert main(["convert", str(paths["run"]), str(paths["gguf"])]) == 0  # a .gguf name: GGUF, without --to
    assert main(["convert", str(paths["run"]), str(paths["hf"]), "--to", "hf"]) == 0
    assert main(["convert", str(paths["hf"]), str(paths["convert"])]) == 0
    (root / "template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return {**paths, "template": root / "template.jinja", "text": data["text"]}


@pytest.mark.parametrize("kind", KINDS)
def test_every_command_reads_every_kind(kind: str, models: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """generate, chat, eval, interpret, convert and the Python API take each kind; translate refuses it clearly."""
    model = str(models[kind])
    loaded = load(model)
    assert loaded.task == "lm" and loaded.model.cfg.decoder.n_layers == 1 and loaded.tokenizer.vocab_size == 300
    code, out, err = run_main(capsys, "generate", model, "--prompt", "ROMEO:", "--max-new-tokens", "5",
                              "--temperature", "0")  # fmt: skip
    assert code == 0 and out.startswith("ROMEO:"), err
    lines = ["Hello"]
    monkeypatch.setattr("builtins.input", lambda prompt="": lines.pop() if lines else _end_of_input())
    code, out, err = run_main(capsys, "chat", model, "--chat-template", str(models["template"]), "--max-new-tokens",
                              "4", "--seed", "0")  # fmt: skip
    assert code == 0 and "model> " in out and "temperature 0.2, top-p 0.9 (qkv's default for chat)" in out, err
    code, out, err = run_main(capsys, "eval", model, "--bpb", str(models["text"]), "--out", str(tmp_path / "b.json"))
    assert code == 0 and "bits per byte" in out, err
    code, out, err = run_main(capsys, "interpret", "hooks", model)
    assert code == 0 and "decoder.layers.0.attn.pattern" in out, err
    code, out, err = run_main(capsys, "convert", model, str(tmp_path / "again"), "--to", "hf")
    assert code == 0 and (tmp_path / "again" / "config.json").is_file(), err
    code, out, err = run_main(capsys, "translate", model, "Hallo")
    assert code == 2 and err.count("\n") == 1 and "holds a language model" in err and "not a translation model" in err


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_explorer_opens_every_kind(kind: str, models: dict[str, Path]) -> None:
    """`qkv explore MODEL` serves each kind: its model panel and its attention."""
    model = str(models[kind])
    with explore_server(models["run"].parent, model) as server:
        status, described = _post(server.url + "api/model", {"run": model})
        assert status == 200 and described["task"] == "lm" and described["n_layers"] == 1, described
        status, answer = _post(server.url + "api/attention", {"run": model, "text": "ROMEO:", "layer": 7})
        assert status == 400 and answer["error"] == "'layer' must be a whole number between 0 and 0, got 7", answer


def test_what_is_no_model_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file that is no checkpoint, a missing path: one line naming the argument, without the program's name twice."""
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    for command in ("generate", "chat", "eval", "interpret hooks"):
        code, _, err = run_main(capsys, *command.split(), str(tmp_path / "notes.txt"))
        assert code == 2 and err.count("\n") == 1 and f"qkv {command.split()[0]}: error: MODEL " in err, err
        assert "is not a checkpoint: give a .gguf file" in err and err.count(f"qkv {command.split()[0]}") == 1
    code, _, err = run_main(capsys, "generate", str(tmp_path / "nowhere"))
    assert err.strip() == f"qkv generate: error: MODEL {tmp_path / 'nowhere'}: no such file or directory"


def _end_of_input() -> str:
    """What input() does at the end of its input (Ctrl-D)."""
    raise EOFError


def _post(url: str, body: Any) -> tuple[int, Any]:
    """(status, JSON answer) of a POST."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
