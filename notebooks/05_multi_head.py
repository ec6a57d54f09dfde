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
# # 5. Multi-head attention, shape by shape
#
# One attention looks at the sentence one way. Multi-head attention runs h of them side by side, each
# in its own d_model/h-dimensional subspace, then concatenates their outputs and mixes them with W_O.
# With the paper's sizes for a 6-token sentence: X is (6, 512); Q, K and V are (6, 512) and split into
# 8 heads of (6, 64); each head attends; the 8 contexts concatenate back to (6, 512); W_O gives (6, 512).
#
# `qkv.lab.heads` walks a real `qkv.MultiHeadAttention` through these steps by hand and checks that the
# result equals calling the module.

# %%
# %matplotlib inline
import torch

from qkv import MultiHeadAttention
from qkv.lab import heads
from qkv.lab.heads import plot

n_heads = 8
result = heads(seq_len=6, d_model=512, n_heads=n_heads)
print(result.table())

# %%
plot(result, None)

# %% [markdown]
# ## Grouped-query and multi-query attention
# Decoding keeps every past token's keys and values in a cache, so their size is what limits long
# contexts and large batches. Grouped-query attention (GQA) lets groups of query heads share one key
# and value head; multi-query attention (MQA) keeps a single one. The queries and W_O do not change.


# %%
def kv_numbers_per_token(module: MultiHeadAttention) -> int:
    """Numbers cached per token: the key and value projections' output widths."""
    return module.k_proj.out_features + module.v_proj.out_features


x = torch.randn(1, 6, 512)
for name, n_kv in (("MHA", 8), ("GQA", 2), ("MQA", 1)):
    module = MultiHeadAttention(512, 8, n_kv_heads=n_kv)
    out = module(x)
    params = sum(p.numel() for p in module.parameters())
    print(
        f"{name}: {n_kv} key/value heads, output {tuple(out.shape)}, {kv_numbers_per_token(module)} cached "
        f"numbers per token, {params:,} parameters"
    )

# %% [markdown]
# ## The claims, checked
# The shapes are (6, 512) → h × (6, 512/h) → (6, 512), here 8 × (6, 64); the step-by-step computation
# equals the module;
# GQA with 2 key/value heads caches a quarter of MHA's numbers, MQA an eighth.

# %%
shapes = {name: shape for name, _, shape in result.steps}
assert shapes["X"] == (6, 512) and shapes["Q per head"] == (n_heads, 6, 512 // n_heads)
assert shapes["concatenated"] == (6, 512) and shapes["output"] == (6, 512)
assert result.max_abs_diff < 1e-5
mha, gqa, mqa = (kv_numbers_per_token(MultiHeadAttention(512, 8, n_kv_heads=n)) for n in (8, 2, 1))
assert (mha, gqa, mqa) == (1024, 256, 128)
print("shapes as in the paper; the hand computation equals the module within", f"{result.max_abs_diff:.1e}")

# %% [markdown]
# ## Try this
# Set `n_heads = 16`: the heads become (6, 32) and the output is still (6, 512).
