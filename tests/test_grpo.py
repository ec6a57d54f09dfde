"""`qkv train grpo` through the command: sampling with the policy, rewards from a user's file, what each step logs,
exact resume, eval and chat of the run, and bad input (G < 2, a failing reward, a prompt too long) in one line.
The base is a tiny BPE language model; the built-in verifiers are checked on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import config, run_main, tiny_data, tiny_settings
from safetensors.torch import load_file

from qkv.errors import QkvError
from qkv.posttrain.rewards import format_reward, last_number, load_reward, numeric, score
from qkv.tasks import load

REWARD = '''
CALLS = [0]

def vowels(reply, prompt, answer):
    """The share of the reply's letters that are vowels: varied across samples, so groups differ."""
    letters = [c for c in reply.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(len(letters), 1)

def late_failure(reply, prompt, answer):
    CALLS[0] += 1
    if CALLS[0] > 40:
        raise ValueError("the grader broke")
    return 0.5

def words(reply, prompt, answer):
    return "many"

def slow(reply, prompt, answer):
    import time
    time.sleep(5)
    return 1.0
'''
FAST = ["--batch-size", "2", "--group", "4", "--max-completion-tokens", "6", "--device", "cpu"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BPE language model (no chat template: prompts are read as written), prompts, and reward functions."""
    from qkv.tasks import train

    root = tmp_path_factory.mktemp("grpo")
    lm = {**tiny_settings("lm", tiny_data(root / "data")), "block_size": 64}
    train(config("lm", **lm, tokenizer="bpe", vocab_size=300, out_dir=str(root / "base")), verbose=False)
    words = ("good", "night", "sweet", "prince", "rest", "flights", "angels", "sing", "thee", "to", "my", "lord")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"ROMEO: {w}", "answer": "1"}) + "\n"
                                                for w in words), encoding="utf-8")  # fmt: skip
    (root / "reward.py").write_text(REWARD, encoding="utf-8")
    return {"root": root, "base": root / "base", "prompts": root / "prompts.jsonl", "reward": root / "reward.py"}


def _grpo(capsys: pytest.CaptureFixture[str], s: dict[str, Path], out: Path, reward: str,
          *extra: str) -> tuple[int, str, str]:  # fmt: skip
    return run_main(capsys, "train", "grpo", "--init-from", str(s["base"]), "--data", str(s["prompts"]),
                    "--reward", f"{s['reward']}:{reward}", *FAST, "--out-dir", str(out), *extra)  # fmt: skip


def test_a_grpo_run_samples_scores_and_logs_each_step(capsys: pytest.CaptureFixture[str], setup: dict[str, Path],
                                                      tmp_path: Path) -> None:  # fmt: skip
    code, out, err = _grpo(capsys, setup, tmp_path / "run", "vowels", "--max-steps", "3", "--eval-interval", "3",
                           "--lr", "1e-3", "--beta", "0.1")  # fmt: skip
    assert code == 0, err
    assert "11 train / 1 val prompts" in err and "4 replies each of up to 6 tokens, β 0.1" in err
    assert "validation reward" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["reward_mean"] <= 1 and 0 <= r["equal_groups"] <= 1 and 1 <= r["reply_tokens"] <= 7
               and "kl" in r for r in rows)  # fmt: skip
    assert rows[0]["kl"] == 0.0 and rows[-1]["reward_std"] > 0  # the first step samples from the reference itself
    training = json.loads((tmp_path / "run" / "config.json").read_text())["training"]
    assert (training["group"], training["beta"], training["max_completion_tokens"]) == (4, 0.1, 6)
    code, out, err = run_main(capsys, "eval", str(tmp_path / "run"))
    assert code == 0 and "val reward" in out, err
    assert load(tmp_path / "run", expect="lm").model is not None  # a language model: chat, serve and eval read it


def test_a_grpo_run_resumes_exactly(capsys: pytest.CaptureFixture[str], setup: dict[str, Path],
                                    tmp_path: Path) -> None:  # fmt: skip
    common = ["--max-steps", "3", "--eval-interval", "1", "--lr", "1e-3", "--lora-rank", "2"]
    assert _grpo(capsys, setup, tmp_path / "straight", "vowels", *common)[0] == 0
    assert _grpo(capsys, setup, tmp_path / "split", "vowels", *common, "--max-time", "1e-9")[0] == 0
    code, _, err = run_main(capsys, "train", "--resume", "--out-dir", str(tmp_path / "split"), "--max-time", "none")
    assert code == 0, err
    straight = load_file(tmp_path / "straight" / "last.safetensors")
    resumed = load_file(tmp_path / "split" / "last.safetensors")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert (tmp_path / "straight" / "rollouts.jsonl").read_text() == (tmp_path / "split" / "rollouts.jsonl").read_text()


@pytest.mark.parametrize(("reward", "extra", "message"), [
    ("late_failure", [], "the reward raised ValueError: the grader broke on the prompt on"),
    ("words", [], "the reward returned 'many' on the prompt on"),
    ("slow", ["--reward-timeout", "0.2"], "the reward took over 0.2 s on the prompt on")])  # fmt: skip
def test_a_failing_reward_stops_in_one_line_and_keeps_the_checkpoint(capsys: pytest.CaptureFixture[str],
                                                                     setup: dict[str, Path], tmp_path: Path,
                                                                     reward: str, extra: list[str],
                                                                     message: str) -> None:  # fmt: skip
    code, _, err = _grpo(capsys, setup, tmp_path / "run", reward, "--max-steps", "6", "--eval-interval", "1", *extra)
    assert code == 2 and len(err.strip().splitlines()[-1:]) == 1 and message in err, err
    assert f"the run's last checkpoint is kept in {tmp_path / 'run'}" in err and "line " in err
    if reward == "late_failure":  # 40 replies scored before it broke: the first steps were saved
        assert (tmp_path / "run" / "last.safetensors").is_file()


def test_bad_settings_and_prompts_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], setup: dict[str, Path],
                                                          tmp_path: Path) -> None:  # fmt: skip
    code, _, err = _grpo(capsys, setup, tmp_path / "never", "vowels", "--group", "1")
    assert code == 2 and "--group must be at least 2, got 1" in err
    code, _, err = _grpo(capsys, setup, tmp_path / "never", "nothing")
    assert code == 2 and "has no function nothing" in err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "ROMEO: " * 80}) + "\n")
    code, _, err = run_main(capsys, "train", "grpo", "--init-from", str(setup["base"]), "--data", str(long),
                            "--reward", "format", "--max-completion-tokens", "6",
                            "--out-dir", str(tmp_path / "never"))  # fmt: skip
    assert code == 2 and f"{long} line 2: the prompt's" in err and "exceed the model's context of 64" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    code, _, err = run_main(capsys, "train", "grpo", "--init-from", str(setup["base"]), "--data", str(bad))
    assert code == 2 and f'{bad} line 2 has no "prompt"' in err
    assert not (tmp_path / "never").exists()


def test_the_built_in_verifiers() -> None:
    assert last_number("so 1,234.5 apples, then 7") == 7.0 and last_number("none") is None
    assert numeric("The answer is 42.", "", "#### 42") == 1.0 and numeric("41", "", "42") == 0.0
    assert format_reward("3 + 4 = 7. The answer is 7.", "", None) == 1.0 and format_reward("7", "", None) == 0.0
    assert load_reward("numeric") is numeric
    with pytest.raises(QkvError, match=r"neither numeric nor format nor FILE\.py:FUNCTION"):
        load_reward("exact")
    with pytest.raises(QkvError, match="needs each prompt's \"answer\" holding a number"):
        score(numeric, "5", "p", None, 1.0, "line 3")


def test_two_processes_sample_and_train_as_one(setup: dict[str, Path], tmp_path: Path) -> None:
    """2 gloo processes of 2 prompts each equal 1 process of 4: each reply is seeded by its prompt's draw, so the split
    changes no reply, and the loss is the mean over all reply tokens either way."""
    from launching import one_and_two, weights_diff

    common = ["grpo", "--init-from", str(setup["base"]), "--data", str(setup["prompts"]), "--reward",
              f"{setup['reward']}:vowels", "--group", "4", "--max-completion-tokens", "6", "--max-steps", "2",
              "--eval-interval", "2", "--lr", "1e-3", "--device", "cpu"]  # fmt: skip
    one, two = one_and_two(common, tmp_path)
    assert weights_diff(one, two) < 1e-5
    metrics = [json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]) for run in (one, two)]
    assert metrics[0]["val_reward"] == metrics[1]["val_reward"]
    assert abs(metrics[0]["train_loss"] - metrics[1]["train_loss"]) < 1e-6
