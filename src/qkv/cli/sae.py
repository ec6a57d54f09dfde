"""`qkv interpret sae` and `qkv interpret features`: train, export and read sparse autoencoders (qkv.sae).

    qkv interpret sae train MODEL --hook decoder.layers.15.resid_pre --data DIR   # every `qkv train sae` option
    qkv interpret sae export RUN OUT                      # SAELens's format: cfg.json + sae_weights.safetensors
    qkv interpret features SAE --text "The cat sat"       # each token's most active latents
    qkv interpret features SAE --latent 42                # its top contexts and the tokens it promotes
    qkv interpret features SAE --latent 42 --steer 8 --prompt "Once upon a time"
    qkv interpret features SAE --random 5                 # five latents drawn at random, each as --latent shows it
"""

from __future__ import annotations

import argparse
from typing import Any

from qkv.cli.common import CHECKPOINTS
from qkv.errors import QkvError

SAE_HELP = "an SAE run of `qkv interpret sae train`, or a SAELens directory (cfg.json; give --lm)"


def train_argv(argv: list[str]) -> list[str]:
    """`interpret sae train [MODEL] …` as `train sae [--lm MODEL] …` (what main() hands to `qkv train`)."""
    rest = argv[3:]
    if rest and not rest[0].startswith("-"):
        rest = ["--lm", rest[0], *rest[1:]]
    return ["sae", *rest]


def register(views: Any) -> None:
    """Add `sae` and `features` to `qkv interpret`'s views."""
    p = views.add_parser("sae", help="train a sparse autoencoder on a model's activations, or export one",
                         description="qkv interpret sae train MODEL --hook NAME --data DIR [every option of `qkv "
                                     "train sae --help`]; qkv interpret sae export RUN OUT")  # fmt: skip
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(handler=lambda args: p.print_help() or 0)
    actions.add_parser("train", help="train one (the options are `qkv train sae --help`'s)")
    cache = actions.add_parser("cache", help="compute a model's activations once and write them to disk (train on "
                                             "them with --activations DIR)")  # fmt: skip
    cache.add_argument("lm", metavar="MODEL")
    cache.add_argument("--data", required=True, help="a data directory prepared with the model's tokenizer")
    cache.add_argument("--tokens", type=int, required=True, help="activations to write (rounded up to whole buffers)")
    cache.add_argument("--out", required=True, help="the cache's directory (a partial one is completed)")
    cache.add_argument("--hook", help="the activation (default: the residual stream entering the middle layer)")
    for flag, kind in (("--block-size", int), ("--buffer-tokens", int), ("--seed", int), ("--device", str)):
        cache.add_argument(flag, type=kind, help=f"as `qkv train sae {flag}`")
    cache.add_argument("--max-norm-ratio", type=_float_or_none, default=argparse.SUPPRESS,
                       help="as `qkv train sae --max-norm-ratio` (a number, or none)")
    cache.add_argument("--no-drop-first", dest="drop_first", action="store_false", default=None,
                       help="keep each window's first position (as `qkv train sae --no-drop-first`)")
    cache.set_defaults(handler=cmd_cache)
    export = actions.add_parser("export", help="write an SAE run in SAELens's format (cfg.json + weights)")
    export.add_argument("run_dir", metavar="RUN")
    export.add_argument("out", metavar="OUT", help="a new directory")
    export.add_argument("--checkpoint", default="best", choices=CHECKPOINTS)
    export.set_defaults(handler=cmd_export)

    f = views.add_parser("features", help="an SAE's features: a text's latents, a latent's top contexts and "
                                          "promoted tokens, steering")  # fmt: skip
    f.add_argument("sae", metavar="SAE", help=SAE_HELP)
    f.add_argument("--lm", help="the model a SAELens directory reads")
    f.add_argument("--data", help="a data directory whose validation split gives a SAELens SAE's contexts")
    f.add_argument("--checkpoint", default="best", choices=CHECKPOINTS, help="an SAE run's weights (default best)")
    f.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N or mps (default cpu)")
    f.add_argument("--text", help="show each token's most active latents")
    f.add_argument("--latent", type=int, help="show one latent: top contexts and the tokens it promotes")
    f.add_argument("--random", type=int, metavar="N", help="show N latents drawn at random from those that fire")
    f.add_argument("--steer", type=float, metavar="ALPHA", help="with --latent and --prompt: generate with α × the "
                                                                "latent's direction added, beside the text without")
    f.add_argument("--prompt", help="the prompt --steer continues")
    f.add_argument("--max-new-tokens", type=int, default=30, help="tokens --steer generates (default 30)")
    f.add_argument("--windows", type=int, default=256, help="held-out windows searched for top contexts (default 256)")
    f.add_argument("--top", type=int, default=8, help="contexts, latents or tokens shown (default 8)")
    f.add_argument("--seed", type=int, default=0, help="--random's draw")
    f.set_defaults(handler=cmd_features)


def _float_or_none(text: str) -> float | None:
    """A number, or the word none."""
    return None if text.lower() == "none" else float(text)


_float_or_none.__name__ = "number or none"  # argparse names the type in its errors


def cmd_cache(args: argparse.Namespace) -> int:
    """Write the activation cache a run with --activations reads."""
    from qkv.tasks import recipe
    from qkv.tasks.sae import SAETrainConfig
    from qkv.tasks.sae_open import cache_activations

    if args.tokens < 1:
        raise QkvError(f"--tokens must be ≥ 1, got {args.tokens}")
    names = ("hook", "block_size", "buffer_tokens", "seed", "device", "drop_first")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if hasattr(args, "max_norm_ratio"):  # given, even as none
        given["max_norm_ratio"] = args.max_norm_ratio
    cfg = recipe("sae", {"lm": args.lm, "data": args.data, **given})
    assert isinstance(cfg, SAETrainConfig)
    where = cache_activations(cfg, args.tokens, args.out)
    same = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items() if k not in ("device", "drop_first"))
    same += " --no-drop-first" if given.get("drop_first") is False else ""
    print(f"wrote {where}: train on it with `qkv interpret sae train {args.lm} --data {args.data} {same} "
          f"--activations {where}`".replace("  ", " "))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write the run's SAE in SAELens's format, with where it belongs in its metadata."""
    from pathlib import Path

    from qkv.io.run_dir import read_run_config
    from qkv.sae import save_saelens
    from qkv.tasks import load

    out = Path(args.out)
    if out.exists():
        raise QkvError(f"{out} already exists; give a new directory")
    run = load(args.run_dir, args.checkpoint, "cpu", expect="sae")
    stored = read_run_config(Path(args.run_dir))  # where the SAE belongs, as recorded: the model is not loaded
    base, hook = stored["base"], stored["data"]["hook"]
    where = {"model": base, "filters": run.config.filters, "run": str(Path(args.run_dir).resolve())}
    save_saelens(run.model, out, {"model_name": Path(base["path"]).name, "hook_name": hook, "qkv": where})
    print(f"wrote {out} (SAELens: SAE.load_from_disk({str(out)!r}); qkv: qkv.sae.load_saelens)")
    return 0


def cmd_features(args: argparse.Namespace) -> int:
    """One of the views, by the options given."""
    from qkv.io.devices import resolve_device
    from qkv.sae.features import check_alpha
    from qkv.tasks.sae_open import open_sae

    chosen = [name for name in ("text", "latent", "random") if getattr(args, name) is not None]
    if len(chosen) != 1:
        raise QkvError("give one of --text, --latent or --random")
    if (args.steer is not None) != (args.prompt is not None) or (args.steer is not None and args.latent is None):
        raise QkvError("--steer ALPHA and --prompt go together, with --latent")
    if min(args.top, args.windows, args.max_new_tokens, 1 if args.random is None else args.random) < 1:
        raise QkvError("--top, --windows, --max-new-tokens and --random must be ≥ 1")
    if args.steer is not None:
        check_alpha(args.steer)
    if args.prompt == "" or args.text == "":
        raise QkvError(f"--{'prompt' if args.prompt == '' else 'text'} is empty; give some text")
    view = open_sae(args.sae, args.lm, args.data, args.checkpoint, resolve_device(args.device))
    if args.text is not None:
        return _text(view, args)
    if args.random is not None:
        return _random(view, args)
    _latent(view, args, args.latent)
    if args.steer is not None:
        _steer(view, args)
    return 0


def _piece(view: Any, token: int) -> str:
    """A token as readable text."""
    return view.base.tokenizer.decode([token]).replace("\n", "⏎")


def _text(view: Any, args: argparse.Namespace) -> int:
    """Each token of --text with its most active latents."""
    from qkv.sae.features import token_latents

    ids = view.base.tokenizer.encode_tensor(args.text)[None, :].to(next(view.base.model.parameters()).device)
    rows = token_latents(view.base.model, view.sae, view.hook, ids, args.top)
    width = max(len(repr(_piece(view, int(t)))) for t in ids[0])
    for token, latents in zip(ids[0].tolist(), rows, strict=True):
        shown = "  ".join(f"{latent}:{value:.3g}" for latent, value in latents) or "(none active)"
        print(f"{_piece(view, token)!r:<{width}}  {shown}")
    return 0


def _contexts(view: Any, args: argparse.Namespace, latent: int) -> list[Any]:
    """The latent's top contexts in the validation split."""
    from qkv.sae.features import top_contexts
    from qkv.sae.measures import eval_windows

    if view.data is None:
        raise QkvError("top contexts come from a data directory: give --data DIR (prepared with the model's tokenizer)")
    windows = eval_windows(view.data.split("val"), view.block_size, args.windows, 16)
    return top_contexts(view.base.model, view.sae, view.hook, windows, latent, args.top, filters=view.filters)


def _latent(view: Any, args: argparse.Namespace, latent: int) -> None:
    """A latent's dashboard as text: its top contexts, the activating token in ⟦ ⟧, and the tokens it promotes."""
    from qkv.sae.features import check_latent, promoted_tokens

    check_latent(view.sae, latent)
    contexts = _contexts(view, args, latent)
    print(f"latent {latent} of {view.hook}: top {len(contexts)} activations in {args.windows} held-out windows")
    for c in contexts:
        text = "".join(f"⟦{_piece(view, t)}⟧" if i == c.at else _piece(view, t) for i, t in enumerate(c.tokens))
        print(f"  {c.value:9.3g}  {text}")
    if not contexts:
        print("  (it never fired there)")
    up, down = promoted_tokens(view.base.model, view.sae, latent, args.top)
    print("  promotes: " + "  ".join(f"{_piece(view, t)!r} {v:+.3g}" for t, v in up))
    print("  demotes:  " + "  ".join(f"{_piece(view, t)!r} {v:+.3g}" for t, v in down))


def _random(view: Any, args: argparse.Namespace) -> int:
    """N latents drawn at random (seeded) among those that fired on the held-out windows, each as --latent."""
    import torch

    from qkv.sae.features import kept_latents
    from qkv.sae.measures import eval_windows

    if view.data is None:
        raise QkvError("--random draws among latents that fire on held-out text: give --data DIR")
    fired = torch.zeros(view.sae.cfg.latents, dtype=torch.bool)
    for ids, _ in eval_windows(view.data.split("val"), view.block_size, args.windows, 16):
        latents, kept = kept_latents(view.base.model, view.sae, view.hook, ids, view.filters)
        fired |= (latents[kept] > 0).any(0).cpu()  # where the dashboards search: a latent drawn has contexts to show
    alive = fired.nonzero().flatten()
    chosen = alive[torch.randperm(len(alive), generator=torch.Generator().manual_seed(args.seed))[: args.random]]
    print(f"{len(chosen)} of the {len(alive)} latents that fired, drawn with seed {args.seed}: {chosen.tolist()}\n")
    for latent in chosen.tolist():
        _latent(view, args, latent)
        print()
    return 0


def _steer(view: Any, args: argparse.Namespace) -> None:
    """The prompt's greedy continuation without and with the latent's direction added."""
    from qkv.sae.features import steered

    tokenizer = view.base.tokenizer
    ids = tokenizer.encode_tensor(args.prompt)[None, :].to(next(view.base.model.parameters()).device)
    if view.norm is not None:
        print(f"(the activations at {view.hook} have a mean norm of {view.norm:.3g}: α is in those units)")
    for alpha, label in ((0.0, "as it is"), (args.steer, f"steered, α = {args.steer:g}")):
        tokens = steered(view.base.model, view.sae, view.hook, ids, args.latent, alpha, args.max_new_tokens,
                         tokenizer.eos_id)  # fmt: skip
        print(f"{label}: {args.prompt}{tokenizer.decode(tokens)}")
