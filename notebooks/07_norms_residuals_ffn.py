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
# # 7. Normalisation, residual connections and the feed-forward network
#
# **Norms.** BatchNorm normalises each *feature* over the batch (every position of every sequence in
# it), LayerNorm normalises each *token* over
# its features, and RMSNorm only rescales each token to a root-mean-square of 1. A token's BatchNorm
# output depends on the other sequences in its batch; LayerNorm and RMSNorm give a token the same
# output whatever its batch mates. That is why Transformers use the latter two.
#
# **Residuals.** Each sub-layer adds its output to its input, x + Sublayer(x), so the signal and its
# gradient always have a direct path through the stack.
#
# **Feed-forward.** Every position then goes through the same two-layer network, 512 → 2048 → 512 in
# the paper, with a ReLU in between.

# %%
# %matplotlib inline
import torch

from qkv.blocks.feed_forward import FeedForward
from qkv.lab import norms
from qkv.lab.norms import plot
from qkv.norms import BatchNorm, LayerNorm, RMSNorm

result = norms(batch_sizes=(64, 8, 2, 1), timing_reps=0)
print(result.table())

# %%
plot(result, None)

# %% [markdown]
# ## The three norms on one batch

# %%
torch.manual_seed(0)
x = 3 + 2 * torch.randn(4, 6, 16)  # (batch, tokens, features), mean 3, std 2
with torch.no_grad():
    outputs = {"BatchNorm": BatchNorm(16).train()(x), "LayerNorm": LayerNorm(16)(x), "RMSNorm": RMSNorm(16)(x)}
for name, y in outputs.items():
    print(
        f"{name:9}  per-feature mean {y.mean((0, 1)).abs().max():.1e}  per-token mean {y.mean(-1).abs().max():.3f}  "
        f"per-token RMS {y.pow(2).mean(-1).sqrt().mean():.3f}"
    )

# %% [markdown]
# ## A residual block around the feed-forward network, 512 → 2048 → 512

# %%
ffn = FeedForward(512, 2048, activation="relu")
tokens = torch.randn(6, 512)
hidden = torch.relu(ffn.up(tokens))  # (6, 2048): each token widened four times
out = tokens + ffn(LayerNorm(512)(tokens))  # pre-norm residual: x + FFN(LN(x))
print(
    "hidden",
    tuple(hidden.shape),
    " FFN parameters:",
    sum(p.numel() for p in ffn.parameters()),
    " output",
    tuple(out.shape),
)

# %% [markdown]
# ## The claims, checked
# LayerNorm gives every token mean 0 and std 1; RMSNorm gives every token RMS 1; BatchNorm gives every
# feature mean 0; the feed-forward network keeps the shape and has 512·2048 + 2048 + 2048·512 + 512 weights.

# %%
ln, rms, bn = outputs["LayerNorm"], outputs["RMSNorm"], outputs["BatchNorm"]
assert ln.mean(-1).abs().max() < 1e-5 and (ln.std(-1, unbiased=False) - 1).abs().max() < 1e-3
assert (rms.pow(2).mean(-1).sqrt() - 1).abs().max() < 1e-3
assert bn.mean((0, 1)).abs().max() < 1e-5
assert hidden.shape == (6, 2048) and out.shape == (6, 512)
assert sum(p.numel() for p in ffn.parameters()) == 512 * 2048 + 2048 + 2048 * 512 + 512
print("the norms normalise what they claim to; the FFN maps (6, 512) to (6, 512)")

# %% [markdown]
# ## Try this
# Set `batch_sizes=(64, 2)`: with two sequences per batch BatchNorm's output for the same token moves
# with its batch mate, while LayerNorm's does not move at all.
