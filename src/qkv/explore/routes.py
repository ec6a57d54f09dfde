"""The explorer's JSON API: one function per POST route, reading its request body and calling the panels.

    POST /api/spreadsheet  {words, embeddings (one vector per word), query, sqrt_scale, factor}
    POST /api/trainable    {seed, causal, sentence}
    POST /api/multihead    {n_heads, seed}
    POST /api/positions    {d_model, position, offset, max_len}
    POST /api/norms        {batch (tokens × features)}
    POST /api/model        {run}: its task, layers, heads and context length
    POST /api/attention    {run, text, layer?, head?}: weights and pre-softmax scores, every layer and head
    POST /api/next         {run, text | ids, temperature, top_k, top_p}: the next-token distribution
    POST /api/step         {run, text | ids, temperature, top_k, top_p, seed}: one generated token
    POST /api/lens         {run, text, k?}: the logit lens, top-k tokens per stream and position (inside.py)
    POST /api/heads        {run, seed?, length?, batch?}: every head's induction and previous-token scores
    POST /api/patching     {run, clean, corrupted, answer?, wrong?, heads?}: starts a patching map (patch_jobs.py)
    POST /api/patching_status {job}: its rows so far;  POST /api/patching_cancel {job}: stop it
    POST /api/sae          {run}: an SAE run's model, hook and size (features.py)
    POST /api/features     {run, text, top?, hook?}: each token's most active latents
    POST /api/feature      {run, latent, top?, windows?, hook?}: its promoted tokens; starts its dashboard's search
    POST /api/feature_status {job}: its top contexts so far;  POST /api/feature_cancel {job}: stop it
    POST /api/steer        {run, latent, alpha, prompt, max_new_tokens?, hook?}: greedy text without and with it
GET /api/runs lists the runs the page may open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qkv.errors import QkvError
from qkv.explore import features, inside, model_panel, panels, patch_jobs
from qkv.explore.body import Body
from qkv.explore.library import SAE_TASK, TASKS, RunLibrary
from qkv.generation import Sampling
from qkv.lab.walkthrough import TRAINABLE_SENTENCE
from qkv.sae.features import MAX_ALPHA

SEED_LIMIT = 2**31 - 1


def runs(library: RunLibrary) -> dict[str, Any]:
    """The runs the page may open, the one given on the command line first, and the classic table."""
    found = [{"name": r.name, "task": r.task} for r in library.available()]
    default = library.default.name if library.default is not None else None
    return {"runs": found, "default": default, "classic": panels.classic_table()}


def spreadsheet(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/spreadsheet."""
    words = body.strings("words", panels.MAX_WORDS)
    embeddings = body.matrix("embeddings", panels.MAX_WORDS)
    query = body.integer("query", 0, max(len(words) - 1, 0))
    return panels.spreadsheet(words, embeddings, query, body.boolean("sqrt_scale", True),
                              body.number("factor", -1e6, 1e6, 1.0))  # fmt: skip


def trainable(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/trainable."""
    return panels.trainable(body.integer("seed", 0, SEED_LIMIT, 123), body.boolean("causal", False),
                            body.text("sentence", TRAINABLE_SENTENCE, limit=400))  # fmt: skip


def multihead(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/multihead."""
    return panels.multi_head(body.integer("n_heads", 1, 16, 8), body.integer("seed", 0, SEED_LIMIT, 0))


def positions(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/positions."""
    limit = panels.MAX_PE_LENGTH
    return panels.positions(body.integer("d_model", 2, 512, 64), body.integer("position", 0, limit, 10),
                            body.integer("offset", 0, limit, 5), body.integer("max_len", 2, limit, 100))  # fmt: skip


def norms(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/norms."""
    return panels.norms(body.matrix("batch", panels.NORM_LIMIT))


def _run(library: RunLibrary, body: Body) -> Any:
    """The loaded run the request names: one whose model reads text."""
    return library.load(body.text("run", limit=4096), TASKS)


def _sae(library: RunLibrary, body: Body) -> Any:
    """The loaded SAE run the request names."""
    return library.load(body.text("run", limit=4096), (SAE_TASK,))


def model(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/model."""
    return model_panel.describe(_run(library, body))


def attention(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/attention."""
    run = _run(library, body)
    cfg = run.model.cfg  # the ranges the model has, for the message a value outside them gets
    layer = body.optional_integer("layer", 0, max(cfg.depths()) - 1)
    head = body.optional_integer("head", 0, cfg.max_heads() - 1)
    return model_panel.attention(run, body.text("text"), layer, head)


def _sampling(body: Body) -> Sampling:
    """Temperature (0 = greedy), top-k (null: off), top-p (1: off) and a seed; Sampling checks their ranges."""
    temperature, top_p = body.number("temperature", 0.0, 100.0, 1.0), body.number("top_p", 1e-6, 1.0, 1.0)
    return Sampling(temperature, body.optional_integer("top_k", 1, 10**9), top_p,
                    body.optional_integer("seed", 0, SEED_LIMIT))  # fmt: skip


def next_token(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/next."""
    return model_panel.next_token(_run(library, body), body.text("text", ""), body.ids("ids"), _sampling(body))


def step(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/step."""
    return model_panel.step(_run(library, body), body.text("text", ""), body.ids("ids"), _sampling(body))


def lens(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/lens."""
    return inside.lens(_run(library, body), body.text("text"), body.integer("k", 1, inside.MAX_TOP, inside.LENS_TOP))


def heads(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/heads."""
    return inside.heads(_run(library, body), body.integer("seed", 0, SEED_LIMIT, 0),
                        body.optional_integer("length", 2, inside.MAX_REPEAT),
                        body.integer("batch", 1, inside.MAX_REPEAT_BATCH, 4))  # fmt: skip


def patching(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/patching."""
    return patch_jobs.start(_run(library, body), body.text("clean"), body.text("corrupted"),
                            body.optional_text("answer", limit=200), body.optional_text("wrong", limit=200),
                            body.boolean("heads", True))  # fmt: skip


def patching_status(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/patching_status."""
    return patch_jobs.JOBS.get(body.text("job", limit=64)).snapshot()


def patching_cancel(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/patching_cancel."""
    return patch_jobs.JOBS.cancel(body.text("job", limit=64)).snapshot()


def sae(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/sae."""
    return features.describe(_sae(library, body))


def _hook(body: Body) -> str | None:
    return body.optional_text("hook", limit=400)


def feature_tokens(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/features."""
    return features.token_view(_sae(library, body), body.text("text"),
                               body.integer("top", 1, features.MAX_TOP, features.TOKEN_TOP), _hook(body))  # fmt: skip


def _latent(run: Any, body: Body) -> int:
    return body.integer("latent", 0, run.model.cfg.latents - 1)


def feature(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/feature."""
    run = _sae(library, body)
    return features.dashboard(run, _latent(run, body),
                              body.integer("top", 1, features.MAX_TOP, features.DASHBOARD_TOP),
                              body.integer("windows", 1, features.MAX_WINDOWS, features.DASHBOARD_WINDOWS),
                              _hook(body))  # fmt: skip


def feature_status(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/feature_status."""
    return features.JOBS.get(body.text("job", limit=64)).snapshot()


def feature_cancel(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/feature_cancel."""
    return features.JOBS.cancel(body.text("job", limit=64)).snapshot()


def steer(library: RunLibrary, body: Body) -> dict[str, Any]:
    """POST /api/steer."""
    run = _sae(library, body)
    return features.steer(run, _latent(run, body), body.number("alpha", -MAX_ALPHA, MAX_ALPHA),
                          body.text("prompt", limit=4000),
                          body.integer("max_new_tokens", 1, features.MAX_STEER_TOKENS, features.STEER_TOKENS),
                          _hook(body))  # fmt: skip


POSTS: dict[str, Callable[[RunLibrary, Body], dict[str, Any]]] = {
    "spreadsheet": spreadsheet, "trainable": trainable, "multihead": multihead, "positions": positions,
    "norms": norms, "model": model, "attention": attention, "next": next_token, "step": step,
    "lens": lens, "heads": heads, "patching": patching, "patching_status": patching_status,
    "patching_cancel": patching_cancel, "sae": sae, "features": feature_tokens, "feature": feature,
    "feature_status": feature_status, "feature_cancel": feature_cancel, "steer": steer,
}  # fmt: skip


def warm_up(library: RunLibrary) -> None:
    """Compute one spreadsheet and read the first run, so that the page's first requests wait for nothing."""
    table = panels.classic_table()
    panels.spreadsheet(table["words"], table["embeddings"], table["query"])
    if library.run_dir is not None and library.default is None:
        raise QkvError(f"{library.run_dir} is not a run the page can open (a run of "
                       f"{', '.join((*TASKS, SAE_TASK))}); the page offers the runs it finds instead")  # fmt: skip
    if library.default is not None:
        run = library.load(library.default.name)
        if library.default.task == SAE_TASK:  # and the model it reads
            features.view(run)
