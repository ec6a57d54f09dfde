"""Your own pairs: `--data pairs.tsv` end to end, `--init-from` a run, and one-line errors for bad files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import config

from qkv.cli import main
from qkv.errors import QkvError
from qkv.io.files import load_safetensors
from qkv.tasks import load, train
from qkv.training import Hooks
from qkv.translation.corpus import split_pairs_file

NUMBERS = {"null": "zero", "eins": "one", "zwei": "two", "drei": "three", "vier": "four", "fünf": "five"}
TINY = ["--vocab-size", "300", "--d-model", "32", "--n-heads", "2", "--model", "d_ff=64", "--n-layers", "1",
        "--batch-size", "120", "--eval-interval", "3", "--device", "cpu"]  # fmt: skip


def _pairs_file(path: Path, n: int = 200) -> Path:
    """n pairs of digit words, German TAB English ('eins zwei drei' → 'one two three'), seeded."""
    generator = torch.Generator().manual_seed(0)
    words = list(NUMBERS)
    lines = []
    for _ in range(n):
        ids = torch.randint(len(words), (int(torch.randint(2, 6, (1,), generator=generator)),), generator=generator)
        german = [words[i] for i in ids.tolist()]
        lines.append(" ".join(german) + "\t" + " ".join(NUMBERS[w] for w in german))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """qkv.cli.main → (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_own_pairs_train_evaluate_and_translate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, run = _pairs_file(tmp_path / "numbers.tsv"), tmp_path / "run"
    code, out, err = _cli(capsys, "train", "translate", "--data", str(data), "--src-lang", "de-num", "--tgt-lang",
                          "en-num", "--max-steps", "6", "--out-dir", str(run), *TINY)  # fmt: skip
    assert code == 0, err
    assert "160 train / 20 val pairs (de-num → en-num), vocab 300" in out + err
    stored = json.loads((run / "config.json").read_text())["training"]
    assert stored["source"] == str(data) and stored["src_lang"] == "de-num"
    code, out, err = _cli(capsys, "eval", str(run), "--beam", "2")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["test  greedy", "test  beam 2", "test beam 2 − greedy"]
    assert "(20 sentences" in out  # a tenth of the 200 pairs
    greedy, beam = (float(re.search(r"BLEU +([\d.]+)", line).group(1)) for line in lines[:2])  # type: ignore[union-attr]
    gain = re.fullmatch(r"test beam 2 − greedy: ([+-][\d.]+) BLEU \(95 % interval ([+-][\d.]+) … ([+-][\d.]+), "
                        r"1000 resamples\)", lines[2])  # fmt: skip
    assert gain and float(gain.group(1)) == pytest.approx(beam - greedy, abs=0.011)
    assert float(gain.group(2)) <= float(gain.group(1)) <= float(gain.group(3))
    code, out, err = _cli(capsys, "translate", str(run), "eins zwei drei")
    assert code == 0 and out.strip(), err


def test_init_from_starts_at_the_runs_weights(tmp_path: Path) -> None:
    data = _pairs_file(tmp_path / "numbers.tsv")
    tiny = dict(vocab_size=300, model={"d_model": 32, "n_heads": 2, "d_ff": 64, "n_encoder_layers": 1,
                "n_decoder_layers": 1}, batch_size=120, eval_interval=3, device="cpu", data=str(data))  # fmt: skip
    first = train(config("translate", **tiny, max_steps=6, out_dir=str(tmp_path / "first")), verbose=False)
    started: dict[str, torch.Tensor] = {}
    hooks = Hooks(on_model=lambda model: started.update({k: v.clone() for k, v in model.state_dict().items()}))
    again = config("translate", data=str(data), batch_size=120, eval_interval=3, device="cpu", max_steps=3,
                            init_from=str(first.run_dir), out_dir=str(tmp_path / "again"))  # fmt: skip
    train(again, verbose=False, hooks=hooks)
    best = load_safetensors(first.run_dir / "model.safetensors")
    assert started.keys() == best.keys() and all(torch.equal(started[k], best[k]) for k in best)
    continued, original = load(tmp_path / "again"), load(first.run_dir)
    assert continued.model.cfg == original.model.cfg
    assert continued.tokenizer.encode("eins zwei") == original.tokenizer.encode("eins zwei")
    with pytest.raises(QkvError, match="leave --vocab-size"):
        config("translate", init_from=str(first.run_dir), vocab_size=300)
    with pytest.raises(QkvError, match="not a translation model"):
        lm_run = tmp_path / "lm"
        lm_run.mkdir()
        lm_config = {"format": "qkv-run/1", "task": "lm", "model_type": "decoder_lm", "model": {}, "training": {}}
        (lm_run / "config.json").write_text(json.dumps(lm_config))
        train(config("translate", data=str(data), init_from=str(lm_run), out_dir=str(tmp_path / "x")), verbose=False)


BAD_FILES: list[tuple[str, bytes | None, str]] = [
    ("missing.tsv", None, "not found"),
    ("empty.tsv", b"", "is empty"),
    ("notabs.tsv", b"Hallo Welt\nGuten Tag\n", "line 1: no tab; each line is source<TAB>target"),
    ("lone.tsv", b"Hallo\tHello\nWelt\t\n", "line 2: each line is source<TAB>target, both non-empty, one tab"),
    ("three.tsv", b"a\tb\tc\n", "line 1: each line is source<TAB>target, both non-empty, one tab"),
    ("latin1.tsv", "Grüße\tgreetings\n".encode("latin-1"), "not valid UTF-8: byte 0xfc"),
    ("few.tsv", b"eins\tone\nzwei\ttwo\n", "has 2 pairs; at least 10 are needed"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_pair_files_get_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: bytes | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(QkvError) as caught:
        split_pairs_file(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    code, _, err = _cli(capsys, "train", "translate", "--data", str(path), "--out-dir", str(tmp_path / "run"))
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing is written before the data is read


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="is a directory"):
        split_pairs_file(tmp_path)
