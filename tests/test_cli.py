"""Tests for the `qkv` command: one-line errors with exit code 2, pickle refusal, generate and eval.

Most cases call qkv.cli.main in-process (cheap); a few run `python -m qkv` as a real process to prove
that the user sees one line on stderr and no traceback. Every model is tiny (1 layer, d_model 32).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import config, run_main
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
import qkv.engine
import qkv.generation
from qkv.cli import main
from qkv.data import load_shakespeare
from qkv.data.cache import open_text
from qkv.errors import QkvError
from qkv.models import DecoderLM
from qkv.tasks import load, train
from qkv.tokenizers.stream import TextStream
from qkv.training import evaluate_loss
from qkv.training.checkpoint import save_checkpoint
from qkv.training.distributed import DistContext

TINY = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 2}, "block_size": 32, "batch_size": 4,
        "eval_interval": 5, "eval_tokens": 2000, "sample_tokens": 0, "device": "cpu"}  # fmt: skip
TINY_ARGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--block-size", "32", "--batch-size", "4",
             "--eval-interval", "5", "--eval-tokens", "2000", "--sample-tokens", "0", "--device", "cpu"]  # fmt: skip


def _run_process(*argv: str, cwd: Path) -> tuple[int, str, str]:
    """`python -m qkv ARGV` in a real process → (exit code, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def _assert_error(result: tuple[int, str, str], command: str, message: str | re.Pattern[str]) -> None:
    """Exit code 2, nothing on stdout, exactly one stderr line `qkv COMMAND: error: MESSAGE`, no traceback."""
    code, out, err = result
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert err.endswith("\n")
    prefix = f"qkv {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    text = lines[0][len(prefix) :]
    if isinstance(message, re.Pattern):
        assert message.fullmatch(text), text
    else:
        assert text == message


# --- fixtures: tiny runs trained once for the whole file -------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Text files good and bad, a plain file, an empty directory, a directory of other files and a missing path."""
    root = tmp_path_factory.mktemp("files")
    paths = {name: root / f"{name}.txt" for name in ("excerpt", "empty", "latin1", "short", "plain")}
    paths["excerpt"].write_text(load_shakespeare()[:20_000], encoding="utf-8")
    paths["empty"].write_bytes(b"")
    paths["latin1"].write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 20)
    paths["short"].write_text("To be, or not to be: that is the question.\n" * 2)  # 86 chars: 77 train
    paths["plain"].write_text("not a run\n")
    paths["emptydir"] = root / "emptydir"
    paths["emptydir"].mkdir()
    paths["missing"] = root / "missing"
    paths["notes"] = root / "notes"  # a directory of the user's that is not a run
    paths["notes"].mkdir()
    (paths["notes"] / "config.txt").write_text("mine\n")
    return {k: Path(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def char_run(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Path:
    """A finished 10-step char run on the 20,000-character excerpt (val split: 2,000 tokens)."""
    out = tmp_path_factory.mktemp("runs") / "char"
    train(config("lm", data=str(files["excerpt"]), max_steps=10, out_dir=str(out), **TINY), verbose=False)
    return out


@pytest.fixture(scope="module")
def shakespeare_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step char run on the full embedded Shakespeare corpus (batch 64 keeps its full-val eval short)."""
    out = tmp_path_factory.mktemp("runs") / "shakespeare"
    settings = {**TINY, "batch_size": 64, "eval_interval": 2}
    train(config("lm", max_steps=2, out_dir=str(out), **settings), verbose=False)
    return out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Path:
    """A 5-step byte-level BPE run (vocab 300), trained through the CLI."""
    out = tmp_path_factory.mktemp("runs") / "bpe"
    code = main(["train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(files["excerpt"]),
                 *TINY_ARGS, "--max-steps", "5", "--out-dir", str(out)])  # fmt: skip
    assert code == 0
    return out


def _copy(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(run, target)
    return target


# --- 5. bad input: one line on stderr, exit code 2 -------------------------------------------------------

TRAIN_ERRORS: list[tuple[str, list[str], str]] = [
    ("empty file", ["--data", "{empty}"], "{empty} is empty; a corpus needs at least some text"),
    ("non-UTF-8 file", ["--data", "{latin1}"],
     "{latin1} is not valid UTF-8: byte 0xe9 at byte offset 3; re-save it as UTF-8, or prepare it with "
     "`qkv prepare --errors replace` (bad bytes become U+FFFD)"),
    ("block size > data", ["--data", "{short}", "--block-size", "100"],
     "block size 100 is larger than the training data (77 tokens); use a smaller --block-size or more text"),
    ("unknown tokenizer", ["--tokenizer", "wordpiece"],
     "argument --tokenizer: invalid choice: 'wordpiece' (choose from 'char', 'bpe', 'gpt2', None) (see qkv train "
     "--help)"),
    ("negative steps", ["--max-steps", "-5"], "max-steps must be a positive integer, got -5"),
    ("zero batch size", ["--batch-size", "0"], "batch-size must be a positive integer, got 0"),
    ("zero eval interval", ["--eval-interval", "0"], "eval-interval must be a positive integer, got 0"),
    ("missing data file", ["--data", "{missing}"], "text file not found: {missing}"),
    ("unknown --model field", ["--model", "foo=1"],
     "--model foo=1: unknown model setting 'foo'; give a path such as decoder.block.attention.n_heads, or a field of "
     "the model (d_model, decoder, embedding, max_positions, tie_embeddings, vocab_size), of a stack (n_layers, "
     "block, layers, final_norm) or of a block (attention, ffn, norm, norm_placement, dropout)"),
    ("--model vocab_size", ["--model", "vocab_size=10"],
     "--model vocab_size=10 differs from the tokenizer's 78: the vocabulary comes from the tokenizer (--vocab-size "
     "sets a new BPE's); drop it"),
    ("bad --model syntax", ["--model", "d_model"],
     "argument --model: expected KEY=VALUE, got 'd_model' (see qkv train --help)"),
    ("non-integer steps", ["--max-steps", "ten"],
     "argument --max-steps: invalid int value: 'ten' (see qkv train --help)"),
    ("unknown device", ["--device", "tpu"], "unknown device 'tpu'; use auto, cpu, cuda or cuda:N"),
    ("unsupported device", ["--device", "meta"], "unsupported device 'meta'; use auto, cpu, cuda, cuda:N or mps"),
    ("min-lr > lr", ["--lr", "0.01", "--min-lr", "0.1"], "min-lr must be in [0, lr=0.01], got 0.1"),
    ("unknown schedule", ["--schedule", "step"],
     "argument --schedule: invalid choice: 'step' (choose from 'cosine', 'linear', 'constant', 'inverse_sqrt') (see "
     "qkv train --help)"),
    ("--resume, no run", ["--resume", "--out-dir", "{emptydir}"],
     "{emptydir} is not a qkv run directory (config.json missing)"),
    ("--resume, no directory", ["--resume", "--out-dir", "{missing}"], "run directory {missing} does not exist"),
    ("--resume, no --out-dir", ["--resume"], "--resume needs --out-dir: the run directory to continue"),
    ("run already there", ["--data", "{excerpt}", "--out-dir", "{char_run}"],
     "{char_run} already holds a run; pass --resume to continue it or choose another --out-dir"),
    ("--out-dir is a file", ["--data", "{excerpt}", "--out-dir", "{plain}"],
     "--out-dir {plain} is a file; give a directory (a new one, or a run to --resume)"),
    ("--out-dir holds other files", ["--data", "{excerpt}", "--out-dir", "{notes}"],
     "--out-dir {notes} already holds other files; give a new or empty directory for the run"),
]  # fmt: skip


def _fill(template: str, paths: dict[str, Path]) -> str:
    return template.format(**{k: str(v) for k, v in paths.items()})


def test_version_names_qkv_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    """`qkv --version` prints qkv's and torch's versions and exits 0."""
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"qkv {qkv.__version__} (torch {torch.__version__})"


@pytest.mark.parametrize(("case", "argv", "message"), TRAIN_ERRORS, ids=[c[0] for c in TRAIN_ERRORS])
def test_train_rejects_bad_input_in_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    files: dict[str, Path],
    char_run: Path,
    case: str,
    argv: list[str],
    message: str,
) -> None:
    """Each mistake: exit 2, one stderr line naming it, and no run directory is made or touched."""
    monkeypatch.chdir(tmp_path)  # where a default runs/<name> directory would appear
    paths = {**files, "char_run": char_run}
    before = sorted(p.name for p in char_run.iterdir())
    result = run_main(capsys, "train", *TINY_ARGS, "--max-steps", "3", *[_fill(a, paths) for a in argv])
    _assert_error(result, "train", _fill(message, paths))
    assert sorted(p.name for p in char_run.iterdir()) == before
    assert os.listdir(files["emptydir"]) == []
    assert os.listdir(files["notes"]) == ["config.txt"]
    assert os.listdir(tmp_path) == []


def test_train_out_of_memory_is_one_line_that_says_what_to_lower(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    """A micro-batch no machine can allocate (10¹² windows): after the run's header, exit 2 and one error line
    giving the size asked for and what to lower, not an allocator's traceback; the corrected command may then
    start again in the same directory."""
    code, _, err = run_main(capsys, "train", "--data", str(files["excerpt"]), *TINY_ARGS, "--max-steps", "1",
                            "--batch-size", str(10**12), "--out-dir", str(tmp_path / "run"))  # fmt: skip
    assert code == 2, err
    assert "Traceback" not in err, err
    header, *notes, error = err.splitlines(True)
    assert header.startswith("qkv train lm: 0.01 M parameters") and all(n.startswith("note: ") for n in notes)
    assert re.fullmatch(r"qkv train: error: out of memory on cpu \([\d,.]+ [KMGT]?i?B asked for\): lower --batch-size "
                        r"\(raising --grad-accum keeps the examples per step\) or the sequence length, or add "
                        r"--activation-checkpointing \(a checkpoint the run saved is kept\)\n", error)  # fmt: skip
    # The run saved nothing, so the same command with a smaller batch may start again in its directory.
    assert sorted(os.listdir(tmp_path / "run")) == ["config.json", "tokenizer.json"]
    code, _, err = run_main(capsys, "train", "--data", str(files["excerpt"]), *TINY_ARGS, "--max-steps", "1",
                            "--out-dir", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["training"]["data"]["batch_size"] == 4


def test_train_rejects_a_model_value_of_the_wrong_type(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    """--model dropout=abc is a one-line error naming the setting, not a TypeError traceback."""
    result = run_main(capsys, "train", "--data", str(files["excerpt"]), *TINY_ARGS, "--model", "dropout=abc",
                       "--out-dir", str(tmp_path / "r"))  # fmt: skip
    _assert_error(result, "train", "--model dropout=abc: embedding.dropout must be a number, got 'abc'")


GENERATE_ERRORS: list[tuple[str, list[str], str]] = [
    ("zero samples", ["--num-samples", "0"], "--num-samples must be ≥ 1, got 0"),
    ("top-p above 1", ["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    ("top-k zero", ["--top-k", "0"], "top_k must be ≥ 1, got 0"),
    ("negative temperature", ["--temperature", "-1"], "temperature must be ≥ 0 (0 = greedy), got -1.0"),
    ("negative length", ["--max-new-tokens", "-1"], "--max-new-tokens must be ≥ 0, got -1"),
    ("empty prompt", ["--prompt", ""], "--prompt is empty; give at least one character to continue"),
    ("unknown checkpoint", ["--checkpoint", "middle"],
     "argument --checkpoint: invalid choice: 'middle' (choose from 'best', 'last') (see qkv generate --help)"),
    ("unknown device", ["--device", "tpu"], "unknown device 'tpu'; use auto, cpu, cuda or cuda:N"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "argv", "message"), GENERATE_ERRORS, ids=[c[0] for c in GENERATE_ERRORS])
def test_generate_rejects_bad_options_in_one_line(
    capsys: pytest.CaptureFixture[str], char_run: Path, case: str, argv: list[str], message: str
) -> None:
    """Bad sampling options fail before anything (not even the prompt) reaches stdout."""
    _assert_error(run_main(capsys, "generate", str(char_run), "--max-new-tokens", "5", *argv), "generate", message)


@pytest.mark.parametrize("prompt", ["€", "\u4e2d", "ROMEO: 5 €"])
def test_prompt_outside_the_char_vocabulary(
    capsys: pytest.CaptureFixture[str], shakespeare_run: Path, prompt: str
) -> None:
    """The Shakespeare char vocabulary has neither '€' nor '中': the error names the character."""
    bad = "€" if "€" in prompt else prompt
    _assert_error(run_main(capsys, "generate", str(shakespeare_run), "--prompt", prompt), "generate",
                  f"1 character(s) not in the vocabulary: {bad!r}; the char vocabulary comes from the training "
                  "text, so remove them or retrain on text that contains them")  # fmt: skip


def test_eval_rejects_bad_input_in_one_line(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], char_run: Path
) -> None:
    """eval: a file instead of a run, and a zero batch size."""
    plain = files["plain"]
    _assert_error(run_main(capsys, "eval", str(plain)), "eval",
                  f"MODEL {plain} is not a checkpoint: give a .gguf file, a Hugging Face directory (config.json + "
                  "safetensors), a `qkv convert` directory or a qkv run")  # fmt: skip
    _assert_error(run_main(capsys, "eval", str(char_run), "--batch-size", "0"), "eval",
                  "batch size must be at least 1, got 0")  # fmt: skip


def test_real_processes_print_one_line_and_no_traceback(
    tmp_path: Path, files: dict[str, Path], shakespeare_run: Path
) -> None:
    """The same errors from `python -m qkv` itself: exit 2, one stderr line, no traceback."""
    cases = [
        (["train", "--tokenizer", "wordpiece"], "train",
         "argument --tokenizer: invalid choice: 'wordpiece' (choose from 'char', 'bpe', 'gpt2', None) (see qkv "
         "train --help)"),
        (["train", "--data", str(files["latin1"]), "--max-steps", "-5"], "train",
         "max-steps must be a positive integer, got -5"),
        (["train", "--data", str(files["latin1"]), "--model", "n_layers"], "train",
         "argument --model: expected KEY=VALUE, got 'n_layers' (see qkv train --help)"),
        (["train", "--data", str(files["latin1"])], "train",
         f"{files['latin1']} is not valid UTF-8: byte 0xe9 at byte offset 3; re-save it as UTF-8, or prepare it with "
         "`qkv prepare --errors replace` (bad bytes become U+FFFD)"),
        (["generate", str(shakespeare_run), "--prompt", "\u4e2d"], "generate",
         "1 character(s) not in the vocabulary: '\u4e2d'; the char vocabulary comes from the training text, so "
         "remove them or retrain on text that contains them"),
    ]  # fmt: skip
    for argv, command, message in cases:
        _assert_error(_run_process(*argv, cwd=tmp_path), command, message)
    assert not (tmp_path / "runs").exists()  # no half-made run directory was left behind


# --- 3. loading refuses pickle and malformed files ---------------------------------------------------------


def _broken_runs(char_run: Path, root: Path) -> list[tuple[str, Path, str | re.Pattern[str]]]:
    """(name, directory, expected error) for every way a run directory can be unloadable."""
    cases: list[tuple[str, Path, str | re.Pattern[str]]] = []
    only_pickle = root / "hf-pickle"
    only_pickle.mkdir()
    torch.save({"w": torch.ones(2)}, only_pickle / "pytorch_model.bin")
    message = f"refusing to load pickle file(s) pytorch_model.bin in {only_pickle}: qkv only reads safetensors"
    cases.append(("only pytorch_model.bin", only_pickle, message))

    disguised = _copy(char_run, root, "disguised")
    torch.save(load(char_run).model.state_dict(), disguised / "model.safetensors")
    message = f"refusing to load pickle file {disguised / 'model.safetensors'}: qkv only reads safetensors and JSON"
    cases.append(("torch.save as model.safetensors", disguised, message))

    truncated = _copy(char_run, root, "truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    pattern = re.escape(f"{truncated / 'model.safetensors'} is damaged or incomplete (") + r".+\); copy or write it " \
        "again"
    cases.append(("truncated model.safetensors", truncated, re.compile(pattern)))

    malformed = _copy(char_run, root, "malformed")
    (malformed / "config.json").write_text('{"format": "qkv-run/1", "model": {')
    pattern = re.escape(f"{malformed / 'config.json'} is not valid JSON (line 1: ") + r".+\)"
    cases.append(("malformed config.json", malformed, re.compile(pattern)))

    unknown = _copy(char_run, root, "unknown-field")
    config = json.loads((unknown / "config.json").read_text())
    config["model"]["flash"] = True
    (unknown / "config.json").write_text(json.dumps(config))
    cases.append(("unknown model field", unknown, "model has no field(s) flash; its fields: d_model, max_positions, "
                  "vocab_size, embedding, decoder, tie_embeddings"))

    cases.append(("missing directory", root / "nowhere", f"MODEL {root / 'nowhere'}: no such file or directory"))
    a_file = root / "model.safetensors"
    shutil.copy(char_run / "model.safetensors", a_file)
    cases.append(("a file, not a directory", a_file,
                  f"MODEL {a_file} is not a checkpoint: give a .gguf file, a Hugging Face directory (config.json + "
                  "safetensors), a `qkv convert` directory or a qkv run"))  # fmt: skip
    return cases


def test_load_and_generate_refuse_pickle_and_malformed_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, char_run: Path
) -> None:
    """qkv.training.load raises QkvError, and `qkv generate` exits 2 with the same one-line message."""
    cases = _broken_runs(char_run, tmp_path)
    assert len(cases) == 7
    for name, directory, message in cases:
        with pytest.raises(QkvError) as info:
            load(directory)
        if isinstance(message, re.Pattern):
            assert message.fullmatch(str(info.value)), (name, str(info.value))
        else:
            assert str(info.value) == message, name
        _assert_error(run_main(capsys, "generate", str(directory), "--max-new-tokens", "3"), "generate", message)
        _assert_error(run_main(capsys, "eval", str(directory)), "eval", message)
    # One of them from a real process: the pickle is refused before anything could unpickle it.
    name, directory, message = cases[1]
    _assert_error(_run_process("generate", str(directory), cwd=tmp_path), "generate", message)


def test_resume_refuses_a_corrupted_or_mismatched_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, char_run: Path
) -> None:
    """Flipped bytes in a shard of the checkpoint, or a checkpoint of another model shape, stop --resume with a
    clear message."""
    corrupted = _copy(char_run, tmp_path, "corrupted")
    shard = corrupted / "checkpoint" / "step-00000010" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1000] ^= 0xFF  # inside a tensor's bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    _assert_error(run_main(capsys, "train", "--resume", "--out-dir", str(corrupted), "--max-steps", "12"), "train",
                  f"checkpoint {shard.parent} is damaged: a shard file does not match checksums.json (__0_0.distcp); "
                  "resume from a copy of the run or start a new one")  # fmt: skip

    mismatched = _copy(char_run, tmp_path, "mismatched")
    config = load(char_run).model.cfg
    other = DecoderLM(config.override({"d_model": 16}))
    one = DistContext(0, 1, "ddp", torch.device("cpu"))
    optimizer = torch.optim.AdamW(other.parameters())
    save_checkpoint(mismatched, other, optimizer, {"step": 10}, {"data": torch.Generator()}, one, frozen=False).wait()
    where = mismatched / "checkpoint" / "step-00000010"
    _assert_error(run_main(capsys, "train", "--resume", "--out-dir", str(mismatched), "--max-steps", "12"), "train",
                  re.compile(re.escape(f"checkpoint {where} is damaged or does not fit this run's model or optimizer "
                                       "(ValueError: Size mismatch between saved ") + r".*"))  # fmt: skip
    metrics = [json.loads(line)["step"] for line in (mismatched / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [5, 10]  # nothing was trained or logged


# --- 4. generate: cache or not, batched samples with eos ---------------------------------------------------


@pytest.mark.parametrize("sampling", [["--seed", "3"], ["--temperature", "0"], ["--seed", "3", "--top-p", "0.9"]])
def test_generate_output_is_identical_without_the_cache(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, char_run: Path, sampling: list[str]
) -> None:
    """`qkv generate` and `qkv generate --no-cache` print the same text (40 tokens: past the 32-token context)."""
    used: list[str] = []
    real_stream, real_step = qkv.generation.stream, qkv.engine.Engine.step

    def spy_stream(*args: Any, **kwargs: Any) -> Any:
        used.append("stream, cached" if args[5] else "stream")  # use_cache, passed positionally by the CLI
        return real_stream(*args, **kwargs)

    def spy_step(engine: qkv.engine.Engine) -> None:
        if used[-1:] != ["engine"]:
            used.append("engine")
        real_step(engine)

    monkeypatch.setattr(qkv.generation, "stream", spy_stream)
    monkeypatch.setattr(qkv.engine.Engine, "step", spy_step)
    argv = ["generate", str(char_run), "--prompt", "ROMEO:", "--max-new-tokens", "40", *sampling]
    code, cached, err = run_main(capsys, *argv)
    assert (code, err) == (0, "")
    assert run_main(capsys, *argv, "--no-cache") == (0, cached, "")
    assert used == ["engine", "stream"]  # the two runs took the two paths: the engine, the reference loop uncached
    assert cached.startswith("ROMEO:") and cached.endswith("\n")
    assert len(cached) == len("ROMEO:") + 40 + 1  # char tokenizer: one character per token
    assert run_main(capsys, *argv) == (0, cached, "")  # and the seed makes it repeatable


@pytest.mark.parametrize(("option", "value", "seen"), [("--dtype", "bfloat16", {"bfloat16"}),
                                                     ("--quantize", "int8", {"Int8Linear"}),
                                                     ("--quantize", "int4", {"GroupLinear", "Linear"}),
                                                     ("--dtype", "float32", {"InputMajorLinear"})])  # fmt: skip
def test_generate_decodes_a_bfloat16_or_int8_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, char_run: Path, option: str, value: str,
    seen: set[str],
) -> None:  # fmt: skip
    """`qkv generate --dtype bfloat16` hands generation a bfloat16 model, `--quantize int8` one whose Linears are all
    int8, `--quantize int4` one whose Linears are 4-bit where the kernel takes their shape (the 78-row head is no
    multiple of 16), and float32 one with input-major matrices; each prints a full sample; an unknown choice is one
    line."""
    from qkv.quantization import GroupLinear, InputMajorLinear, Int8Linear

    models: list[torch.nn.Module] = []
    real_init = qkv.engine.Engine.__init__

    def spy(engine: qkv.engine.Engine, model: Any, *args: Any, **kwargs: Any) -> None:
        models.append(model)
        real_init(engine, model, *args, **kwargs)

    monkeypatch.setattr(qkv.engine.Engine, "__init__", spy)
    code, out, err = run_main(capsys, "generate", str(char_run), "--prompt", "ROMEO:", "--max-new-tokens", "20",
                              "--temperature", "0", option, value)  # fmt: skip
    assert (code, err) == (0, "")
    assert out.startswith("ROMEO:") and len(out) == len("ROMEO:") + 20 + 1
    (model,) = models
    if value == "bfloat16":
        assert {str(p.dtype).removeprefix("torch.") for p in model.parameters()} == seen
    else:  # int8, or one float32 sequence on the CPU: input-major matrices
        kinds = (torch.nn.Linear, Int8Linear, InputMajorLinear, GroupLinear)
        assert {type(m).__name__ for m in model.modules() if isinstance(m, kinds)} == seen
    code, _, err = run_main(capsys, "generate", str(char_run), option, "int3")
    assert code == 2 and "invalid choice: 'int3'" in err and "Traceback" not in err


_WORDS = ["▁the", "▁king", "s", "▁é", "!", "\n"]  # a SentencePiece-like vocabulary: "▁" is a leading space


def _byte_decode(ids: list[int]) -> str:
    """Byte-level BPE: each id is one byte; a cut-off UTF-8 character decodes to U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def _metaspace_decode(ids: list[int]) -> str:
    """SentencePiece's decoder drops the space of the first token, so a lone token prints no space."""
    return "".join(_WORDS[i] for i in ids).replace("▁", " ").removeprefix(" ")


@settings(max_examples=200, deadline=None)
@given(
    st.text(
        st.characters(codec="utf-8", exclude_characters="\ufffd"), min_size=1, max_size=8
    ),  # U+FFFD would be a false alarm
    st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=30),
    st.lists(st.integers(0, 5), min_size=1, max_size=30),
)
def test_streamed_text_equals_the_decoded_whole(prompt: str, text: str, words: list[int]) -> None:
    """Pieces printed token by token add up to the whole decoded continuation, for both kinds of decoder."""
    for decode, context, tokens in [
        (_byte_decode, list(prompt.encode()), list(text.encode())),  # multi-byte characters split over tokens
        (_metaspace_decode, words[:1], words[1:]),
    ]:
        streamed = TextStream(decode, context)
        pieces = [streamed.push(t) for t in tokens]
        assert all("\ufffd" not in p for p in pieces)  # never half a character on the screen
        expected = decode(context + tokens)[len(decode(context)) :]
        assert "".join(pieces) + streamed.end() == expected


def test_streaming_goes_on_after_a_decoder_rewrites_printed_text() -> None:
    """A decoder that cleans up spaces (" '" → "'") rewrites text already on screen: the stream keeps printing."""
    pieces_of = ["it", " ", "'", "s", " king", "!"]

    def decode(ids: list[int]) -> str:
        return "".join(pieces_of[i] for i in ids).replace(" '", "'")

    streamed = TextStream(decode, [0])
    pieces = [streamed.push(t) for t in (1, 2, 3, 4, 5)]
    assert pieces == [" ", "'", "s", " king", "!"]  # the rewrite cannot take back the space; nothing stalls
    assert streamed.end() == ""


def test_generate_zero_new_tokens_still_echoes_the_prompt(capsys: pytest.CaptureFixture[str], char_run: Path) -> None:
    assert run_main(capsys, "generate", str(char_run), "--prompt", "ROMEO:", "--max-new-tokens", "0") == (
        0, "ROMEO:\n", "")  # fmt: skip


def test_bpe_run_generates_several_samples(capsys: pytest.CaptureFixture[str], bpe_run: Path) -> None:
    """A BPE run (with an <|endoftext|> eos token) prints --num-samples 3 samples, identically without cache."""
    run = load(bpe_run)
    assert run.tokenizer.kind == "bpe" and run.tokenizer.vocab_size <= 300
    assert run.tokenizer.eos_id is not None
    stored = json.loads((bpe_run / "config.json").read_text())["tokenizer"]
    assert stored == {"kind": "bpe", "vocab_size": run.tokenizer.vocab_size}
    argv = ["generate", str(bpe_run), "--prompt", "KING", "--num-samples", "3", "--max-new-tokens", "30", "--seed", "1"]
    code, out, err = run_main(capsys, *argv)
    assert (code, err) == (0, "")
    headers = re.findall(r"^--- sample (\d) ---$", out, flags=re.M)
    assert headers == ["1", "2", "3"]
    samples = re.split(r"^--- sample \d ---\n", out, flags=re.M)[1:]
    assert all(s.startswith("KING") for s in samples)
    assert len(set(samples)) == 3  # three different random continuations
    assert run_main(capsys, *argv, "--no-cache") == (0, out, "")


# --- 6. qkv eval = evaluate_loss over the whole validation split -------------------------------------------


def test_eval_prints_the_full_validation_loss(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], char_run: Path
) -> None:
    """The printed loss equals evaluate_loss over every val position, for best and last weights."""
    val = open_text(str(files["excerpt"])).split("val")
    assert len(val) == 2000
    last_row: dict[str, Any] = json.loads((char_run / "metrics.jsonl").read_text().splitlines()[-1])
    for which in ("best", "last"):
        code, out, err = run_main(capsys, "eval", str(char_run), "--checkpoint", which, "--batch-size", "7")
        assert (code, err) == (0, "")
        match = re.fullmatch(r"val loss (\d+\.\d{4})  perplexity (\d+\.\d{3})  bits per byte (\d\.\d{3})  \(1,999 "
                             rf"positions, block size 32, {which} weights\)\n", out)  # fmt: skip
        assert match, out
        printed = float(match.group(1))
        run = load(char_run, which)
        expected = evaluate_loss(run.model, val, 32, batch_size=32)
        assert abs(printed - expected) < 1e-4
        assert abs(float(match.group(2)) - torch.tensor(expected).exp().item()) < 1e-2
        assert abs(float(match.group(3)) - expected / math.log(2)) < 1e-3  # ASCII text: a byte per character
    # eval_tokens (2000) covered the whole val split, so the last logged val loss is that same number.
    assert abs(printed - last_row["val_loss"]) < 1e-4
    assert last_row["step"] == 10


def test_generate_into_a_closed_pipe_stops_quietly(shakespeare_run: Path) -> None:
    """`qkv generate RUN | head -1`: the reader goes away, qkv stops with exit 0 and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "generate", str(shakespeare_run), "--max-new-tokens", "3000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()  # the echoed prompt, a newline
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err
