"""qkv's own CPU kernels (csrc/ggml_dot.cpp), built on first use with the C++ compiler that `--compile` also needs.

The library is built for this machine's CPU (-march=native) and kept in a cache keyed by its source, the command
line, the compiler's version, torch's version and the CPU's features, so a second process loads it in
milliseconds. Building takes a few seconds, once, and says so. Without a compiler, or on a CPU without AVX2, FMA and
F16C (the source stops the build there), `available()` is False and callers use PyTorch's own kernels.
-ffp-contract=off keeps every float operation as written: a row's sums must not change with the code around them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "ggml_dot.cpp"


def cache_dir() -> Path:
    """Where built kernels are kept: $QKV_KERNELS, else ~/.cache/qkv/kernels."""
    return Path(os.environ.get("QKV_KERNELS") or Path.home() / ".cache" / "qkv" / "kernels")


def _cpu_features() -> str:
    """The CPU's flags: a library built with -march=native is only for CPUs that have them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return sysconfig.get_platform()


def _command(out: Path) -> list[str]:
    """The compiler's command line: one shared library against torch's headers and libraries. With g++, -fopenmp
    links libgomp.so.1, the soname of torch's own copy, so the loaded one is shared and torch.set_num_threads holds."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or "c++"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [compiler, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCE), *libs, "-lc10", "-ltorch_cpu", "-o",
            str(out)]  # fmt: skip


def _compiler_version(compiler: str) -> str:
    """The compiler's own first line of --version ('' when it has none): part of what the library is built with."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace", timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout.splitlines() or [""])[0]


def library() -> Path:
    """The built library's path (building it when the cache has none); raises OSError when it cannot be built."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise OSError(f"no C++ compiler ({compiler}) on PATH")
    made_with = [*_command(Path("out")), _compiler_version(compiler), torch.__version__, _cpu_features()]
    key = hashlib.sha256(SOURCE.read_bytes() + "\n".join(made_with).encode()).hexdigest()
    path = cache_dir() / f"qkv_ggml_{key[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print("qkv: building its GGUF kernels for this CPU (once, a few seconds)…", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: never half a library
        built = Path(tmp) / path.name
        done = subprocess.run(_command(built), capture_output=True, text=True, errors="replace")
        if done.returncode:
            log = path.with_suffix(".log")
            log.write_text(done.stderr)
            raise OSError(f"building {SOURCE.name} failed (the compiler's messages: {log})")
        os.replace(built, path)
    return path


_LOADED: list[Path] = []  # the library this process loaded: a second one would register the qkv ops again, an abort


@functools.cache
def available() -> bool:
    """Whether torch.ops.qkv.ggml_mm and ggml_rows are loaded (built now if need be); False when they cannot be."""
    if os.environ.get("QKV_NO_KERNELS"):
        return False
    if _LOADED:
        return True
    try:
        path = library()
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:  # no compiler, a failed build, a library the loader refuses
        print(f"qkv: no GGUF kernels ({error}); using PyTorch's int4 kernel instead", file=sys.stderr)
        return False
    _LOADED.append(path)
    _register_fakes()
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing: the ops' outputs without running them."""

    @torch.library.register_fake("qkv::ggml_mm")
    def _mm(x: torch.Tensor, blocks: torch.Tensor, type: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("qkv::ggml_rows")
    def _rows(blocks: torch.Tensor, index: torch.Tensor, type: int, k: int) -> torch.Tensor:
        return blocks.new_empty(index.shape[0], k, dtype=torch.float32)
