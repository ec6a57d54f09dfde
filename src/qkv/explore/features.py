"""The explorer's Features tab: an SAE run's latents (qkv.sae.features), read on the model and data it records.

    describe(run)                                   what the SAE reads: its model, hook, width and sparsity
    token_view(run, text, top, hook)                each token's most active latents
    dashboard(run, latent, top, windows, hook)      the tokens a latent promotes, and a job that searches the
                                                    validation split for its top contexts, batch by batch
    steer(run, latent, alpha, prompt, n, hook)      greedy text with and without α × its decoder row at the hook

Every number is qkv.sae.features' own, on the SAE as SAELens saves it (folded), so the page, `qkv interpret
features` and the Python API show the same values. A request may name the hook it expects (`hook`): the page
sends the one the SAE it opened reads, so an answer can never come from another place in the model.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.explore.inside import checked_ids, device_of, heavy_slot, pieces
from qkv.explore.jobs import Jobs, Steps
from qkv.explore.library import RequestError
from qkv.sae.features import (
    Context,
    check_latent,
    kept_latents,
    promoted_tokens,
    searched_contexts,
    steered,
    top_latents,
)
from qkv.sae.measures import eval_windows
from qkv.tasks.sae_open import SAEView, view_of

TOKEN_TOP = 5  # latents shown per token
MAX_TOP = 32
DASHBOARD_TOP = 8  # contexts and promoted tokens, as `qkv interpret features`
DASHBOARD_WINDOWS = 256  # held-out windows searched, as `qkv interpret features --windows`
MAX_WINDOWS = 4096
WINDOW_BATCH = 16  # windows per forward pass: one step of the dashboard's job
STEER_TOKENS = 30
MAX_STEER_TOKENS = 128
JOBS = Jobs("feature dashboard")
_views: dict[tuple[Path, str], SAEView] = {}  # by run directory and checkpoint: each run's model is read once
_opening: dict[tuple[Path, str], threading.Lock] = {}  # one lock a run: opening one never waits for another
_views_lock = threading.Lock()


def view(run: Any) -> SAEView:
    """The SAE run's view (its model and data read once), or a one-line 4xx."""
    if run.task != "sae":
        raise QkvError(f"{run.directory.name} is a {run.task} run; the Features tab opens SAE runs "
                       "(`qkv interpret sae train`)")  # fmt: skip
    key = (Path(run.directory).resolve(), run.checkpoint)
    with _views_lock:
        lock = _opening.setdefault(key, threading.Lock())
    with lock:
        if key not in _views:
            try:
                _views[key] = view_of(run)
            except QkvError:
                raise
            except Exception as err:  # damaged model or data files: not the request's fault
                raise RequestError(422, f"cannot read the model or data of the SAE run {run.directory.name}: "
                                        f"{' '.join(str(err).split())[:200]}") from err  # fmt: skip
        return _views[key]


def checked(run: Any, hook: str | None) -> SAEView:
    """The view, refused when the request expects the SAE at another hook than the one it reads."""
    opened = view(run)
    if hook is not None and hook != opened.hook:
        raise QkvError(f"this SAE reads {opened.hook}, not {hook!r}: its latents mean nothing elsewhere; open an SAE "
                       f"trained at {hook}")  # fmt: skip
    return opened


def describe(run: Any) -> dict[str, Any]:
    """What the page shows above the views: the model and hook the SAE reads, its size, and its data."""
    opened, cfg = view(run), run.model.cfg
    val = opened.data.split("val") if opened.data is not None else None
    return {"hook": opened.hook, "model": str(opened.base.reference.get("path", "")), "d_model": cfg.d_model,
            "latents": cfg.latents, "architecture": cfg.architecture, "k": cfg.k, "block_size": opened.block_size,
            "val_windows": val.window_count(opened.block_size) if val is not None else 0,
            "windows": DASHBOARD_WINDOWS, "top": DASHBOARD_TOP, "norm": opened.norm}  # fmt: skip


def _ids(opened: SAEView, text: str, what: str) -> list[int]:
    """A typed text's ids, refused when empty or longer than the SAE's windows."""
    return checked_ids(opened.base.tokenizer, opened.base.model.cfg.context_length, text, what, opened.block_size,
                       f"this SAE (trained on windows of {opened.block_size} tokens)")  # fmt: skip


def token_view(run: Any, text: str, top: int = TOKEN_TOP, hook: str | None = None) -> dict[str, Any]:
    """Each token of `text` and its `top` most active latents, as [latent, activation] pairs, active ones only, and
    whether training would have read its position (`trained`: not the first position, BOS or an outlying norm)."""
    opened = checked(run, hook)
    ids = _ids(opened, text, "text")
    model = opened.base.model
    tensor = torch.tensor([ids], device=device_of(model))
    with heavy_slot():
        latents, kept = kept_latents(model, opened.sae, opened.hook, tensor, opened.filters)  # (1, T, d_sae), (1, T)
        rows = top_latents(latents[0], top)
    tokenizer = opened.base.tokenizer
    return {"hook": opened.hook, "ids": ids, "tokens": [tokenizer.decode([i]) for i in ids],
            "latents": [[[latent, value] for latent, value in row] for row in rows],
            "trained": kept[0].tolist()}  # fmt: skip


def _context(context: Context) -> dict[str, Any]:
    """One top context as the page draws it."""
    return {"ids": context.tokens, "values": context.values, "at": context.at, "value": context.value}


def dashboard(run: Any, latent: int, top: int = DASHBOARD_TOP, windows: int = DASHBOARD_WINDOWS,
              hook: str | None = None, jobs: Jobs = JOBS) -> dict[str, Any]:  # fmt: skip
    """Start a latent's dashboard: the tokens it promotes and demotes now, its top contexts in the job's steps."""
    opened = checked(run, hook)
    check_latent(opened.sae, latent)
    if opened.data is None:
        raise QkvError("this SAE has no data to search for contexts")
    split = opened.data.split("val")
    searched = min(windows, split.window_count(opened.block_size))
    batches = -(-searched // WINDOW_BATCH)
    tokenizer = opened.base.tokenizer

    def steps() -> Steps:
        windows = eval_windows(split, opened.block_size, searched, WINDOW_BATCH)
        for contexts in searched_contexts(opened.base.model, opened.sae, opened.hook, windows, latent, top,
                                          filters=opened.filters):  # fmt: skip
            ids = [i for c in contexts for i in c.tokens]
            yield {"contexts": [_context(c) for c in contexts], "pieces": pieces(tokenizer, ids)}

    up, down = promoted_tokens(opened.base.model, opened.sae, latent, top)
    job = jobs.start(lambda: (batches, steps()), {"contexts": [], "pieces": {}})
    return {"job": job.id, "total": batches, "latent": latent, "windows": searched, "hook": opened.hook,
            "promoted": [[i, v, tokenizer.decode([i])] for i, v in up],
            "demoted": [[i, v, tokenizer.decode([i])] for i, v in down]}  # fmt: skip


def steer(run: Any, latent: int, alpha: float, prompt: str, max_new_tokens: int = STEER_TOKENS,
          hook: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The prompt's greedy continuation as the model is and with α × the latent's decoder row added at the hook."""
    opened = checked(run, hook)
    check_latent(opened.sae, latent)
    ids = torch.tensor([_ids(opened, prompt, "prompt")], device=device_of(opened.base.model))
    tokenizer = opened.base.tokenizer
    if ids.shape[1] + max_new_tokens > opened.base.model.cfg.context_length:
        raise QkvError(f"the prompt and {max_new_tokens} new tokens exceed the model's context of "
                       f"{opened.base.model.cfg.context_length}; shorten the prompt")  # fmt: skip
    with heavy_slot():
        texts = [tokenizer.decode(steered(opened.base.model, opened.sae, opened.hook, ids, latent, a, max_new_tokens,
                                          tokenizer.eos_id)) for a in (0.0, alpha)]  # fmt: skip
    return {"hook": opened.hook, "latent": latent, "alpha": alpha, "prompt": prompt, "plain": texts[0],
            "steered": texts[1]}  # fmt: skip
