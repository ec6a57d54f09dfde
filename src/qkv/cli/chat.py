"""`qkv chat RUN|CHECKPOINT`: talk to a chat model in the terminal, with its own chat template.

Each reply streams token by token (the KV cache) and stops at the end-of-turn token. The history is kept;
/reset clears it, /system TEXT sets the system message. Ctrl-C stops a reply (what was said stays in the
history) or clears the line being typed; Ctrl-D leaves. When the history no longer fits the model's context
with room for a reply, the oldest exchanges are dropped and a notice says so (qkv.chat.session).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any

from qkv.cli.common import MODEL_HELP
from qkv.cli.runs import compile_option, native_gguf, run_options, sampling_options
from qkv.errors import QkvError

HELP = "/system TEXT sets the system message, /reset clears the history, Ctrl-C stops a reply, Ctrl-D leaves"


def register(sub: Any) -> None:
    """Add chat to the `qkv` sub-parsers."""
    p = sub.add_parser("chat", help="talk to a chat model (a run, a GGUF file, a Hugging Face or convert directory)")
    p.set_defaults(handler=cmd_chat)
    p.add_argument("run_dir", metavar="MODEL", help=f"{MODEL_HELP} (e.g. a chat fine-tune)")
    p.add_argument("--system", help="the system message (default: the template's own, if it has one)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template, for a model without one")
    sampling_options(p, chat=True)
    compile_option(p)
    run_options(p)


def _session(args: argparse.Namespace) -> Any:
    """The model, its tokenizer and chat template, as a session with the sampling flags."""
    from qkv.chat import ChatSession, ChatTemplate, chat_sampling, template_source
    from qkv.chat.sampling import describe
    from qkv.chat.template import GIVE_TEMPLATE, read_template_file
    from qkv.evals.models import load_eval_model
    from qkv.generation import Sampling
    from qkv.io.devices import resolve_device

    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    Sampling(**{k: v for k, v in given.items() if v is not None})  # bad flags refused before loading
    if args.max_new_tokens < 1:
        raise QkvError(f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}")
    source = read_template_file(args.chat_template) if args.chat_template else None
    origin = f"--chat-template {args.chat_template}" if args.chat_template else args.run_dir
    device = resolve_device(args.device)
    lm = load_eval_model(args.run_dir, args.checkpoint, device, "chat talks with", native_gguf(args.run_dir, device))
    source = source or template_source(args.run_dir, lm.metadata)
    if source is None:
        raise QkvError(f"{args.run_dir} has no chat template; {GIVE_TEMPLATE}")
    if next(lm.model.parameters()).device.type == "cpu":
        from qkv.quantization import input_major

        input_major(lm.model)  # as `qkv generate`: one float32 sequence, the CPU reads Wᵀ (in, out) faster
    tokenizer = lm.tokenizer
    if args.max_new_tokens >= lm.model.cfg.context_length:
        raise QkvError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the conversation in the model's "
                       f"{lm.model.cfg.context_length}-token context; lower it")  # fmt: skip
    template = ChatTemplate.of(source, tokenizer, origin)
    sampling, chosen_by = chat_sampling(given, lm.metadata.get("sampling"))
    session = ChatSession(lm.model, tokenizer, template, sampling, args.max_new_tokens, args.system,
                          compiled=args.compile)  # fmt: skip
    return session, f"{lm.name}, {lm.model.cfg.context_length}-token context, {describe(sampling)} ({chosen_by})"


def _reply(session: Any, text: str) -> None:
    """Stream the reply to `text`; Ctrl-C stops it."""
    tokens, dropped = session.say(text)
    if dropped:
        print(f"(the {dropped} oldest exchange{'s' if dropped > 1 else ''} no longer fit the model's "
              f"{session.model.cfg.context_length}-token context and {'were' if dropped > 1 else 'was'} dropped)")
    from qkv.tokenizers.stream import TextStream

    shown = TextStream(session.tokenizer.decode, [])
    sys.stdout.write("model> ")
    try:
        for token in tokens:
            sys.stdout.write(shown.push(token))
            sys.stdout.flush()
        sys.stdout.write(shown.end() + "\n")
    except KeyboardInterrupt:
        tokens.close()  # the reply so far joins the history
        sys.stdout.write(shown.end() + " [stopped]\n")


def _command(session: Any, line: str) -> bool:
    """Run /reset or /system; False if the line is a message."""
    if line == "/reset":
        session.reset()
        print("(history cleared)")
    elif line == "/system" or line.startswith("/system "):
        text = line[len("/system") :].strip()
        session.system = text or None
        session.reset()
        print(f"(system message set, history cleared: {text})" if text else "(the template's default system message)")
    elif line.startswith("/"):
        print(f"(unknown command {line.split()[0]}; {HELP})")
    else:
        return False
    return True


def cmd_chat(args: argparse.Namespace) -> int:
    """Read messages until Ctrl-D; answer each."""
    # Ctrl-C stops a reply even where the launcher ignored SIGINT (a background job, nohup), as children inherit.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    session, name = _session(args)
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    print(f"qkv chat: {name}. {HELP}.")
    while True:
        try:
            line = input("you> ").strip()
        except KeyboardInterrupt:
            print()
            continue
        except EOFError:
            print()
            return 0
        if not line or _command(session, line):
            continue
        try:
            _reply(session, line)
        except QkvError as e:
            print(f"({e})")
