"""The package's layering: dependencies point down, the core stays free of features, starting `qkv` stays light,
optional packages stay optional, and there is one training loop.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import qkv

SRC = Path(qkv.__file__).resolve().parent
ROOT = SRC.parents[1]
BLOCKED = (
    "sacrebleu",
    "sentencepiece",
    "transformers",
    "gguf",
    "selenium",
    "starlette",
    "uvicorn",
    "hypothesis",
    "pytest",
    "mkdocs",
    "nbmake",
    "tiktoken",
    "pyarrow",
    "peft",
    "llama_cpp",
    "lm_eval",
    "datasets",
)


def _python(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter (so that only its own imports are loaded)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_import_contracts_hold() -> None:
    """pyproject.toml's import-linter contracts: layers, a core without features, interop over core and I/O only."""
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout


def test_import_qkv_attention_loads_no_feature_room() -> None:
    code = "import sys, qkv.attention; print(sorted(m for m in sys.modules if m.startswith('qkv.')))"
    done = _python(code)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout)
    rooms = ("qkv.training", "qkv.interop", "qkv.translation", "qkv.lab", "qkv.tasks", "qkv.cli", "qkv.data")
    assert not [m for m in loaded if m.startswith(rooms)], loaded
    assert "qkv.attention.sdpa" in loaded


def test_starting_the_command_imports_no_torch() -> None:
    """`qkv --help` builds its parser without torch, numpy or Hugging Face's tokenizers: it answers at once."""
    code = ("import sys; from qkv.cli import build_parser; build_parser(); "
            "print([m for m in ('torch', 'numpy', 'tokenizers') if m in sys.modules])")  # fmt: skip
    done = _python(code)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_the_command_needs_no_optional_package(tmp_path: Path) -> None:
    """With sacrebleu, sentencepiece, transformers, gguf, selenium and the dev tools unimportable: `qkv --help` and
    `qkv train` work, and a feature that needs an extra says which, in one line."""
    text = tmp_path / "text.txt"
    text.write_text(_excerpt(), encoding="utf-8")
    code = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # importing it raises ImportError
from qkv.cli import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
assert main(["train", "--data", sys.argv[1], "--max-steps", "2", "--eval-interval", "2", "--block-size", "16",
             "--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--sample-tokens", "20",
             "--out-dir", sys.argv[2]]) == 0
assert main(["generate", sys.argv[2], "--max-new-tokens", "5"]) == 0
assert main(["explore", sys.argv[2], "--no-browser"]) == 2
assert main(["prepare", sys.argv[1], "--tokenizer", "char", "--out", sys.argv[4]]) == 0
assert main(["prepare", sys.argv[1], "--out", sys.argv[4] + "-gpt2"]) == 0  # GPT-2 without tiktoken: HF's engine
open(sys.argv[4] + ".parquet", "wb").write(b"PAR1")
assert main(["prepare", sys.argv[4] + ".parquet", "--out", sys.argv[4] + "-pq"]) == 2
sys.exit(main(["train", "translate", "--max-steps", "1", "--out-dir", sys.argv[3]]))
"""
    done = _python(code, str(text), str(tmp_path / "lm"), str(tmp_path / "tr"), str(tmp_path / "data"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "qkv train: error: validation BLEU needs the sacrebleu package: pip install 'qkv[translate]'"
    )
    assert "Traceback" not in done.stderr
    assert "qkv explore: error: the interactive page needs the starlette package: pip install 'qkv[explore]'" in (
        done.stderr.splitlines()
    )
    assert not (tmp_path / "tr").exists()  # refused before anything was written
    assert "qkv prepare: error: reading Parquet files needs the pyarrow package: pip install 'qkv[data]'" in (
        done.stderr.splitlines()
    )


def _excerpt() -> str:
    from qkv.data import load_shakespeare

    return load_shakespeare()[:5000]


def _calls(path: Path) -> list[str]:
    """The `.backward()` and optimiser/scaler `.step()` calls in a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = ast.unparse(node.func.value)
            if node.func.attr == "backward" or (
                node.func.attr == "step" and any(w in receiver.lower() for w in ("optim", "scaler", "opt"))
            ):
                found.append(node.func.attr)
    return found


def test_there_is_one_training_loop() -> None:
    """Only qkv/training/loop.py calls .backward() or steps an optimiser: every task trains through it."""
    callers = {str(p.relative_to(SRC)): _calls(p) for p in sorted(SRC.rglob("*.py")) if _calls(p)}
    assert list(callers) == ["training/loop.py"], callers
    assert sorted(callers["training/loop.py"]) == ["backward", "step"]  # once each: one loop


def _module_imports() -> dict[str, set[str]]:
    """Each qkv module → the qkv modules it imports anywhere (top level, in functions, under TYPE_CHECKING), less a
    package's imports of its own modules and a module's of its package (re-exports, not design)."""
    modules = {".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in SRC.rglob("*.py")}  # fmt: skip

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):  # qkv imports absolutely (relative ones would be ruff's TID252)
                assert node.level == 0 and node.module, f"{path}:{node.lineno}: a relative import"
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        found = {t for t in map(resolve, targets) if t and t != name}
        graph[name] = {t for t in found if not (is_package and t.startswith(name + "."))
                       and not (modules[t].name == "__init__.py" and name.startswith(t + "."))}  # fmt: skip
    return graph


def test_no_module_imports_itself_through_others() -> None:
    """No import circles between qkv's modules, counting imports inside functions: dependencies point down."""
    graph = _module_imports()
    assert "qkv.models" in graph["qkv.training.task"] and "qkv.errors" in graph["qkv.config"]
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        raise AssertionError(f"import circle: {' → '.join(e.args[1])}") from None


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_files_and_functions_stay_short() -> None:
    """Every module under 400 lines and every function under 60 (decorators and docstring included): each one
    can be read in one sitting."""
    long_files, long_functions = [], []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(SRC)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {length} lines")
    assert not long_files and not long_functions, long_files + long_functions
