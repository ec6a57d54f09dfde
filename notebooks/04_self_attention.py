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
# # 4. Self-attention with trainable weights
#
# In a real layer the words do not attend with their raw embeddings. Three learned matrices project
# them: Q = X W_q, K = X W_k, V = X W_v. Here "The next day is bright" is 5 words × 8 dimensions, and
# W_q, W_k, W_v are 8 × 4, so each word gets a 4-dimensional query, key and value.
# `qkv.lab.trainable_walkthrough` runs the attention with qkv's own `scaled_dot_product_attention` and
# keeps every intermediate matrix.

# %%
# %matplotlib inline
import numpy as np
import torch

from qkv.lab import trainable_walkthrough
from qkv.lab.walkthrough import plot

full = trainable_walkthrough(seed=123)
print(full.table())

# %%
plot(full, None)

# %% [markdown]
# ## Causal attention
# A decoder must not look at the words after the one it is predicting. The causal mask sets the
# scores above the diagonal to −∞ before the softmax, so their weights are exactly 0.

# %%
causal = trainable_walkthrough(seed=123, causal=True)
print(np.array2string(causal.weights, precision=3))
plot(causal, None)

# %% [markdown]
# ## Dropout on the attention weights
# During training the paper also drops attention weights at random (p = 0.1) and scales the survivors
# by 1/(1 − p), so that each weight keeps its expected value. `scaled_dot_product_attention(...,
# dropout_p=p)` does this (with PyTorch's dropout) to the weights right after the softmax, after
# `record_attention` has seen them. Here is the same operation with qkv's own dropout (`qkv.blocks.dropout`,
# the one its layers use) at p = 0.5, once, and averaged over 20,000 draws.

# %%
from qkv.blocks.dropout import dropout

weights = torch.tensor(full.weights)
torch.manual_seed(0)
dropped = dropout(weights, p=0.5).numpy()
print(np.array2string(dropped, precision=3))
average = torch.stack([dropout(weights, p=0.5) for _ in range(20_000)]).mean(0).numpy()
print("average over 20,000 draws:\n", np.array2string(average, precision=3))

# %% [markdown]
# ## The claims, checked
# Rows of attention weights sum to 1; with the causal mask the upper triangle is exactly 0; dropout
# zeroes some weights, scales the survivors by 1/(1 − p) and keeps the average.

# %%
np.testing.assert_allclose(full.weights.sum(axis=1), 1.0, atol=1e-12)
np.testing.assert_allclose(causal.weights.sum(axis=1), 1.0, atol=1e-12)
assert np.all(causal.weights[np.triu_indices(5, 1)] == 0)
kept = dropped != 0
assert 0 < kept.sum() < kept.size
np.testing.assert_allclose(dropped[kept], 2 * full.weights[kept], rtol=1e-6)
np.testing.assert_allclose(average, full.weights, atol=0.02)
print("rows sum to 1; causal upper triangle is 0; dropout keeps", int(kept.sum()), "of", kept.size)

# %% [markdown]
# ## Try this
# Change `seed=123` to another number: new W_q, W_k, W_v, new weights, and still rows that sum to 1.
