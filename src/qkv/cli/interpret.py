"""`qkv interpret`: look inside a run or converted checkpoint (qkv.interpret) from the command line.

    qkv interpret lens RUN --prompt "The capital of France is"
    qkv interpret patch RUN --clean "The capital of France is" --corrupted "The capital of Italy is"
    qkv interpret heads RUN                      # induction and previous-token scores of every head
    qkv interpret attribution RUN --prompt … --answer " Paris" --wrong " Rome"
    qkv interpret hooks RUN [--prompt … --hook NAME [--head H]]
    qkv interpret sae train RUN --hook NAME --data DIR   # a sparse autoencoder (qkv.cli.sae: also features)
"""

from __future__ import annotations

import argparse
from typing import Any

from qkv.cli import sae
from qkv.cli.common import CHECKPOINTS, MODEL_HELP
from qkv.errors import QkvError


def register(sub: Any) -> None:
    """Add interpret and its views to the `qkv` sub-parsers."""
    parser = sub.add_parser("interpret", help="look inside a model: logit lens, activation patching, induction "
                                              "heads, logit attribution, named activations, sparse "
                                              "autoencoders")  # fmt: skip
    parser.set_defaults(handler=lambda args: parser.print_help() or 0)
    views = parser.add_subparsers(dest="view", metavar="VIEW")

    def view(name: str, help_text: str, handler: Any) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = views.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        p.add_argument("run_dir", metavar="MODEL", help=MODEL_HELP)
        p.add_argument("--checkpoint", default="best", choices=CHECKPOINTS, help="a run's weights (default best)")
        p.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps (default cpu)")
        return p

    p = view("lens", "the logit lens: each layer's top next token at each position", cmd_lens)
    p.add_argument("--prompt", required=True)
    p.add_argument("--top", type=int, default=1, help="tokens per cell (default 1)")
    p = view("patch", "activation patching between a clean and a corrupted prompt of the same length", cmd_patch)
    p.add_argument("--clean", required=True)
    p.add_argument("--corrupted", required=True)
    p.add_argument("--answer", help="the clean answer, one token (default: the clean prompt's top next token)")
    p.add_argument("--wrong", help="the corrupted answer, one token (default: the corrupted prompt's top token)")
    p.add_argument("--no-heads", action="store_true", help="patch the residual stream only")
    p = view("heads", "induction and previous-token scores of every head, on repeated random tokens", cmd_heads)
    p.add_argument("--length", type=int, default=25, help="random tokens, then the same again (default 25)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p = view("attribution", "each layer's and head's direct contribution to a logit (difference)", cmd_attribution)
    p.add_argument("--prompt", required=True)
    p.add_argument("--answer", required=True, help="the token whose logit is explained (one token)")
    p.add_argument("--wrong", help="a token to compare with: explain logit[answer] − logit[wrong]")
    p.add_argument("--layer", type=int, help="show every head of this layer (default: the top heads overall)")
    p = view("hooks", "the model's named activations, or one of them on a prompt", cmd_hooks)
    p.add_argument("--prompt", help="run the model on this text and show --hook's values")
    p.add_argument("--hook", help="an activation's name (see the list without --prompt)")
    p.add_argument("--head", type=int, help="for an attention pattern: the head to print")
    sae.register(views)


def _run(args: argparse.Namespace) -> Any:
    """The run on the command line, as a language model with a tokenizer."""
    from qkv.io.devices import resolve_device
    from qkv.tasks import load

    run = load(args.run_dir, args.checkpoint, resolve_device(args.device), "lm", role="MODEL")
    run.require_tokenizer()
    return run


def _ids(run: Any, text: str, what: str) -> Any:
    """(1, T) ids of a prompt, refused when empty."""
    if not text:
        raise QkvError(f"{what} is empty; give some text")
    return run.require_tokenizer().encode_tensor(text)[None, :].to(run.device)


def _token(run: Any, text: str, what: str) -> int:
    """The single token a text is, or a one-line error naming the pieces it splits into."""
    tokenizer = run.require_tokenizer()
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        pieces = ", ".join(repr(tokenizer.decode([i])) for i in ids) or "nothing"
        raise QkvError(f"{what} {text!r} is {len(ids)} tokens ({pieces}); give exactly one token")
    return int(ids[0])


def _piece(run: Any, token: int, width: int = 10) -> str:
    """A token as printable text, cut to width."""
    text = repr(run.require_tokenizer().decode([token]))[1:-1]
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])


def cmd_lens(args: argparse.Namespace) -> int:
    """Print the lens grid: a row per stream, a column per position."""
    from qkv.interpret import logit_lens

    if args.top < 1:
        raise QkvError(f"--top must be ≥ 1, got {args.top}")
    run = _run(args)
    ids = _ids(run, args.prompt, "--prompt")
    lens = logit_lens(run.model, ids)
    probs, top = lens.top(args.top)
    header = ["stream", *(_piece(run, int(t)) for t in ids[0])]
    rows = [[label, *(" ".join(f"{_piece(run, int(top[r, 0, c, k]))} {float(probs[r, 0, c, k]):.2f}"
                                for k in range(args.top)) for c in range(ids.shape[1]))]
            for r, label in enumerate(lens.labels)]  # fmt: skip
    print(_table(header, rows))
    print(f"lens: {lens.note}")
    return 0


def cmd_patch(args: argparse.Namespace) -> int:
    """Print the residual-stream map and the heads with the largest effects."""
    import torch

    from qkv.interpret import activation_patching

    run = _run(args)
    clean, corrupted = _ids(run, args.clean, "--clean"), _ids(run, args.corrupted, "--corrupted")
    if clean.shape != corrupted.shape:  # before the default tokens, whose forward passes would be wasted
        raise QkvError(f"the clean and corrupted prompts must have the same token length, got "
                       f"{clean.shape[-1]} and {corrupted.shape[-1]} tokens")  # fmt: skip
    with torch.no_grad():
        answer = _token(run, args.answer, "--answer") if args.answer else int(run.model(clean)[0, -1].argmax())
        wrong = _token(run, args.wrong, "--wrong") if args.wrong else int(run.model(corrupted)[0, -1].argmax())
    if answer == wrong:
        raise QkvError(f"the answer and the wrong token are both {_piece(run, answer)!r}; pick two tokens "
                       "(--answer, --wrong)")  # fmt: skip
    result = activation_patching(run.model, clean, corrupted, answer, wrong, heads=not args.no_heads)
    print(f"metric: logit[{_piece(run, answer)!r}] − logit[{_piece(run, wrong)!r}] = {result.clean:.3f} clean, "
          f"{result.corrupted:.3f} corrupted; effect 1 = patching restores the clean answer, 0 = no change")
    header = ["layer", *(f"{_piece(run, int(a))}/{_piece(run, int(b))}" if a != b else _piece(run, int(a))
                         for a, b in zip(clean[0], corrupted[0], strict=True))]  # fmt: skip
    print(_table(header, [[str(i), *(f"{float(v):+.2f}" for v in row)] for i, row in enumerate(result.resid)]))
    if result.heads is not None:
        n_heads = result.heads.shape[1]
        order = result.heads.flatten().abs().topk(min(10, result.heads.numel())).indices
        print("heads with the largest effects: " + ", ".join(
            f"L{int(k) // n_heads}.H{int(k) % n_heads} {float(result.heads.flatten()[k]):+.2f}" for k in order))
    return 0


def cmd_heads(args: argparse.Namespace) -> int:
    """Print every head's induction and previous-token scores, and name the induction heads."""
    import torch

    from qkv.interpret import head_scores, repeated_tokens

    if args.length < 2 or args.batch < 1:
        raise QkvError(f"--length must be ≥ 2 and --batch ≥ 1, got {args.length} and {args.batch}")
    run = _run(args)
    vocab = run.require_tokenizer().vocab_size
    low = min(vocab // 10, 1000)  # past the special and byte tokens most vocabularies start with
    ids = repeated_tokens(args.batch, args.length, vocab, torch.Generator().manual_seed(args.seed), low).to(run.device)
    induction, previous = head_scores(run.model, ids)
    header = ["layer", *(f"H{h}" for h in range(induction.shape[1]))]
    print("induction scores (attention to the token after the previous occurrence):")
    print(_table(header, [[str(i), *(f"{float(v):.2f}" for v in row)] for i, row in enumerate(induction)]))
    print("previous-token scores:")
    print(_table(header, [[str(i), *(f"{float(v):.2f}" for v in row)] for i, row in enumerate(previous)]))
    n_heads = induction.shape[1]
    values, order = induction.flatten().topk(min(5, induction.numel()))
    print("top induction heads: " + ", ".join(f"L{int(k) // n_heads}.H{int(k) % n_heads} {float(v):.2f}"
                                              for v, k in zip(values, order, strict=True)))  # fmt: skip
    return 0


def cmd_attribution(args: argparse.Namespace) -> int:
    """Print the direct contribution of each layer's attention and feed-forward, and of the heads."""
    from qkv.interpret import logit_attribution

    run = _run(args)
    ids = _ids(run, args.prompt, "--prompt")
    answer = _token(run, args.answer, "--answer")
    wrong = _token(run, args.wrong, "--wrong") if args.wrong else None
    result = logit_attribution(run.model, ids, answer, wrong)
    n_layers, n_heads = result.heads.shape
    if args.layer is not None and not 0 <= args.layer < n_layers:
        raise QkvError(f"--layer {args.layer} is out of range: the model has {n_layers} layers (0–{n_layers - 1})")
    print(_table(["layer", "attention", "feed-forward"],
                 [[str(i), f"{float(a):+.3f}", f"{float(f):+.3f}"] for i, (a, f) in enumerate(result.layers)]))
    print(f"embeddings {result.embeddings:+.3f}, norm shift and bias {result.constant:+.3f}; "
          f"sum {result.parts_sum():+.3f} = the logit{' difference' if wrong is not None else ''} {result.total:+.3f}")
    if args.layer is not None:
        heads = [(args.layer, h) for h in range(n_heads)]
    else:
        order = result.heads.flatten().abs().topk(min(10, result.heads.numel())).indices
        heads = [(int(k) // n_heads, int(k) % n_heads) for k in order]
    print("heads: " + ", ".join(f"L{i}.H{h} {float(result.heads[i, h]):+.3f}" for i, h in heads))
    return 0


def cmd_hooks(args: argparse.Namespace) -> int:
    """List the activation names, or print one activation's shape and values on a prompt."""
    from qkv.interpret import hook_names, run_with_cache
    from qkv.interpret.hooks import check_name, hook_sites

    run = _run(args)
    if args.prompt is None or args.hook is None:
        if args.prompt is not None or args.hook is not None:
            raise QkvError("give both --prompt and --hook, or neither (to list the names)")
        print("\n".join(hook_names(run.model)))
        return 0
    if any(c in args.hook for c in "*?["):
        raise QkvError(f"--hook takes one name, not a pattern: {args.hook!r}")
    name = check_name(hook_sites(run.model), args.hook)[0]
    _, acts = run_with_cache(run.model, _ids(run, args.prompt, "--prompt"), names=name)
    value = acts[name][0]
    if name.endswith(".pattern"):  # checked before anything is printed: a mistake prints its error alone
        if args.head is None or not 0 <= args.head < value.shape[0]:
            raise QkvError(f"--head must be in 0–{value.shape[0] - 1} for {name}, got {args.head}")
    elif args.head is not None:
        raise QkvError(f"--head applies to attention patterns, not {name}")
    print(f"{name}: shape {tuple(acts[name].shape)}")
    value = value[args.head] if name.endswith(".pattern") else value
    if value.dim() == 2 and value.shape[-1] <= 32:  # a pattern (T, T) of a short prompt: the whole matrix
        print("\n".join(" ".join(f"{float(v):.3f}" for v in row) for row in value))
    else:
        print("norm per position: " + " ".join(f"{float(v):.3f}" for v in value.flatten(1).norm(dim=-1)))
    return 0
