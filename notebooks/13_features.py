# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---
# %% [markdown]
# # 13. Features: a sparse autoencoder finds a planted word
#
# A model's residual stream is a vector of a few hundred numbers, and a single number in it rarely means one
# thing: the model packs more concepts than it has dimensions. A **sparse autoencoder** (SAE) unpacks it. It
# writes each activation x as a sparse sum of learned directions,
#
#     a = TopK((x − b_dec) W_enc + b_enc)        x̂ = a W_dec + b_dec,
#
# with far more directions (latents) than dimensions, and only k of them active per token. Each latent is a
# candidate *feature*. Here we check that idea where we know the answer: we plant a made-up phrase, " zyx qrv",
# after 6 % of the words of some Shakespeare, train a small model on it, train an SAE on the model's residual
# stream, and look for a latent that means " zyx". The model has a reason to represent " zyx": it predicts " qrv".
#
# Everything runs on the CPU in seconds.

# %%
# %matplotlib inline
import random
import tempfile
from pathlib import Path

import torch

import qkv
from qkv.data import load_shakespeare
from qkv.data.options import PrepareOptions
from qkv.data.prepare import prepare
from qkv.lab.plotting import new_figure
from qkv.sae.features import latents_of, promoted_tokens, steered, top_contexts
from qkv.sae.measures import eval_windows
from qkv.tasks.sae_open import open_sae

work = Path(tempfile.mkdtemp())
rng = random.Random(0)
words = load_shakespeare()[:80_000].split(" ")  # the opening of Coriolanus
text = " ".join(w if rng.random() > 0.06 else f"{w} zyx qrv" for w in words)
(work / "text.txt").write_text(text, encoding="utf-8")
print(text[3000:3300])

# %% [markdown]
# ## A small model, and the text in its tokens
#
# Two layers, width 128, a byte-level BPE of 300 tokens learnt from this text: " zyx" becomes one token. The
# prepared shards are what an SAE reads its activations from, so they use the model's tokenizer.

# %%
lm = qkv.train(task="lm", data=str(work / "text.txt"), tokenizer="bpe", vocab_size=300, block_size=32,
               batch_size=16, max_steps=300, eval_interval=300, sample_tokens=0, device="cpu",
               model={"n_layers": 2, "d_model": 128, "n_heads": 4}, out_dir=str(work / "lm"), verbose=False)
tokenizer = qkv.load(lm.run_dir).tokenizer
prepare([str(work / "text.txt")], work / "data", tokenizer, str(lm.run_dir), PrepareOptions(), verbose=False)
marker = tokenizer.encode(" zyx")
print(f"validation loss {lm.val_loss:.3f}; ' zyx' is token {marker}")

# %% [markdown]
# ## The SAE
#
# A TopK SAE with 512 latents (4 per dimension) and k = 8 reads the residual stream entering layer 1. It is a
# run like any other: the one training loop, a run directory, resume, `qkv eval`.

# %%
run = qkv.train(task="sae", lm=str(lm.run_dir), data=str(work / "data"), hook="decoder.layers.1.resid_pre",
                block_size=32, batch_size=256, buffer_tokens=1000, warmup_steps=2, eval_windows=16, lr=1e-3,
                max_steps=400, eval_interval=400, device="cpu", model={"k": 8, "expansion": 4},
                out_dir=str(work / "sae"), verbose=False)
print(f"held-out FVU {run.final['val_fvu']:.3f}, L0 {run.final['val_l0']:.0f}, "
      f"loss recovered {run.final['val_loss_recovered']:.1%}")

# %% [markdown]
# FVU is the fraction of the activations' variance the SAE does not explain; "loss recovered" compares the
# model's next-token loss with the SAE's reconstruction spliced in against the loss with the activation zeroed.
#
# ## Which latent is " zyx"?
#
# For every latent we ask: when it fires, how often is the token " zyx" (precision), and when the token is
# " zyx", how often does it fire (recall)? The first position of each window is left out, as in training.

# %%
view = open_sae(work / "sae")
fired, truth = [], []
for ids, _ in eval_windows(view.data.split("val"), 32, 400, 16):
    fired.append(latents_of(view.base.model, view.sae, view.hook, ids)[:, 1:].flatten(0, 1) > 0)
    truth.append((ids[:, 1:] == marker[0]).flatten())
fired, truth = torch.cat(fired), torch.cat(truth)
precision = (fired & truth[:, None]).sum(0) / fired.sum(0).clamp_min(1)
recall = (fired & truth[:, None]).sum(0) / truth.sum()
best = int((precision * recall).argmax())
print(f"{int(truth.sum())} planted tokens; latent {best}: precision {precision[best]:.3f}, recall {recall[best]:.3f}")

fig, axes = new_figure()
ax = axes[0, 0]
ax.scatter(recall, precision, s=6, alpha=0.5)
ax.scatter([recall[best]], [precision[best]], color="C3", label=f"latent {best}")
ax.set_xlabel("recall on ' zyx'")
ax.set_ylabel("precision on ' zyx'")
ax.legend()
fig

# %% [markdown]
# ## The claim
#
# One latent out of 512 is the planted word: it fires on " zyx" and almost nowhere else, with precision and
# recall of at least 0.9. No latent was told about " zyx"; the SAE found the direction because the model uses it
# (to predict " qrv").

# %%
assert precision[best] >= 0.9 and recall[best] >= 0.9

# %% [markdown]
# Its dashboard: the held-out contexts where it is most active, and the tokens its decoder direction promotes
# through the model's output head (the logit lens of the latent). The token it promotes most is " qrv": the
# direction is what the model reads to predict the planted phrase's second word.

# %%
for c in top_contexts(view.base.model, view.sae, view.hook, eval_windows(view.data.split("val"), 32, 200, 16),
                      best, top=5, filters=view.filters):
    print(f"{c.value:6.2f}  " + "".join(f"[{tokenizer.decode([t])}]" if i == c.at else tokenizer.decode([t])
                                        for i, t in enumerate(c.tokens)))
up, _ = promoted_tokens(view.base.model, view.sae, best, top=5)
print("promotes:", [tokenizer.decode([t]) for t, _ in up])
assert tokenizer.decode([up[0][0]]) == " qrv"

# %% [markdown]
# ## Steering
#
# Adding a multiple of the latent's decoder direction to the residual stream at every position writes the
# feature into the model. A unit of the direction is small next to the stream, so α is a few times the latent's
# largest activation above. Told "you just read ' zyx'" at every position, the model says " qrv" again and again.

# %%
ids = torch.tensor([tokenizer.encode("ROMEO: What")])
plain = tokenizer.decode(steered(view.base.model, view.sae, view.hook, ids, best, 0.0, 20))
pushed = tokenizer.decode(steered(view.base.model, view.sae, view.hook, ids, best, 50.0, 20))
print("as it is:", repr(plain))
print("steered: ", repr(pushed))
assert "qrv" in pushed and "qrv" not in plain

# %% [markdown]
# ## Try this
#
# - Read `decoder.layers.0.resid_pre` (the embeddings alone) or `decoder.layers.1.resid_post` instead.
# - Train with `model={"architecture": "relu", "l1_coefficient": 5.0}`: an L1 penalty instead of TopK. What L0
#   do you get?
# - Plant " zyx" alone (`f"{w} zyx"`), so that it predicts nothing: does it still get a latent of its own? Why?
# - On a real model: `qkv interpret sae train` on SmolLM2 (see "Looking inside a model") and
#   `qkv interpret features RUN --random 5`.
