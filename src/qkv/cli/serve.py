"""`qkv serve MODEL`: the model behind an OpenAI-compatible API and a chat page, many users at once (qkv.serve)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from qkv.cli.common import MODEL_HELP
from qkv.cli.runs import compile_option, native_gguf, run_options
from qkv.errors import QkvError


def register(sub: Any) -> None:
    """Add serve to the `qkv` sub-parsers."""
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API, with a chat page at /")
    p.set_defaults(handler=cmd_serve)
    p.add_argument("run_dir", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                                                       "only; any other needs --api-key)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: a free one)")
    p.add_argument("--api-key", default=os.environ.get("QKV_API_KEY"),
                   help="the key clients must send as `Authorization: Bearer KEY` (default: $QKV_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences generated at once (default 8)")
    p.add_argument("--kv-cache-tokens", type=int, help="tokens the KV cache holds across all sequences (default: "
                                                       "--max-batch × the model's context)")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before new ones get a 429 "
                                                             "(default 64)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before it is ended "
                                                                "(default 600)")  # fmt: skip
    p.add_argument("--no-prompt-cache", action="store_true",
                   help="read every prompt from its start, even where a slot holds its beginning: slower, and replies "
                        "then equal one-at-a-time generation to the bit")  # fmt: skip
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template, for a model without one")
    compile_option(p)
    run_options(p)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until Ctrl-C."""
    from qkv.extras import require
    from qkv.io.sockets import is_loopback, parse_host

    host = parse_host(args.host)
    if not 0 <= args.port <= 65535:
        raise QkvError(f"--port must be between 0 and 65535, got {args.port}")
    if not is_loopback(host) and not args.api_key:
        raise QkvError(f"--host {host} lets other machines in: give --api-key KEY (or set QKV_API_KEY), or serve "
                       "on 127.0.0.1")  # fmt: skip
    if args.timeout <= 0 or args.max_queue < 0:
        raise QkvError("--timeout must be > 0 and --max-queue ≥ 0")
    for package in ("starlette", "uvicorn"):
        require(package, "serve", "the server")
    from qkv.io.sockets import bind_socket
    from qkv.serve.server import run

    sock = bind_socket(host, args.port)  # a port in use is refused now, not after the model has loaded
    begin = time.perf_counter()
    served = _served(args)
    counts = served.engine.counts()
    print(f"qkv serve: loaded {served.name} in {time.perf_counter() - begin:.1f} s; {counts['slots']} slots of "
          f"{served.engine.kv.capacity} tokens", flush=True)  # fmt: skip
    if args.compile:  # before the first request, which would otherwise wait for it
        print("qkv serve: compiling the decode step (a minute or two the first time; then read from Inductor's "
              "cache)", flush=True)  # fmt: skip
        print(f"qkv serve: compiled in {served.engine.warm_up():.1f} s", flush=True)
    run(served, sock)
    print("qkv serve: stopped")
    return 0


def _served(args: argparse.Namespace) -> Any:
    """The model named on the command line, in an engine, with its tokenizer and chat template."""
    from qkv.chat import ChatTemplate, template_source
    from qkv.chat.session import stop_ids
    from qkv.chat.template import read_template_file
    from qkv.engine import Engine
    from qkv.engine.samples import end_of_text
    from qkv.evals.models import load_eval_model
    from qkv.io.devices import resolve_device
    from qkv.serve.app import Served

    template_text = read_template_file(args.chat_template) if args.chat_template else None
    device = resolve_device(args.device)
    lm = load_eval_model(args.run_dir, args.checkpoint, device, "serve serves", native_gguf(args.run_dir, device))
    engine = Engine(lm.model, lm.tokenizer, args.max_batch, args.kv_cache_tokens, args.max_queue, args.timeout,
                    reuse_prompts=not args.no_prompt_cache, compiled=args.compile)  # fmt: skip
    tokenizer = lm.tokenizer
    source = template_text or template_source(args.run_dir, lm.metadata)
    encode_chat = None
    if source is not None:
        template = ChatTemplate.of(source, tokenizer, args.chat_template or args.run_dir)

        def encode_chat(messages: list[dict[str, str]]) -> list[int]:
            try:
                text = template.render(messages, add_generation_prompt=True)
            except QkvError:
                raise
            except Exception as err:  # the template's own code failed on these messages: the request's problem
                raise QkvError(f"the chat template cannot render these messages: {err}") from None
            return tokenizer.encode(text)

    eos = end_of_text(tokenizer)
    return Served(engine, lm.name, encode_chat, tokenizer.encode, lambda i: tokenizer.decode([i]), tokenizer.piece,
                  frozenset(stop_ids(tokenizer)) if source is not None else eos, eos, args.api_key)  # fmt: skip
