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
# # 1. Why attention divides by √d_k
#
# Attention scores a query q against every key k with the dot product q·k = Σᵢ qᵢkᵢ, a sum of d_k
# products. If the components of q and k are independent with mean 0 and variance 1, each product has
# variance 1, and variances of independent terms add up: **Var(q·k) = d_k**. The typical score then
# grows like √d_k, and a wide head would feed its softmax numbers in the tens.
#
# The dice analogy: one die has a variance of 35/12 ≈ 2.92. The sum of 100 dice does not stay near
# one die's spread: its variance is 100 × 35/12, its standard deviation √100 = 10 times larger. Divide
# the sum by √100 and the spread is back to one die's. That is exactly what the 1/√d_k does.
#
# `qkv.lab.variance` draws q and k and measures both.

# %%
# %matplotlib inline
import numpy as np

from qkv.lab import variance
from qkv.lab.variance import plot

result = variance(d_ks=(5, 100, 512), trials=4000, seed=0)
print(result.table())

# %%
plot(result, None)

# %% [markdown]
# ## The claim, checked
# The measured variance of q·k is within 10 % of d_k, and after dividing by √d_k it is within 10 % of 1,
# whatever d_k is. The sum of d_k dice behaves the same way.

# %%
assert np.all(np.abs(result.var_unscaled / result.d_ks - 1) < 0.10), result.var_unscaled
assert np.all(np.abs(result.var_scaled - 1) < 0.10), result.var_scaled
assert np.all(np.abs(result.dice_var_scaled / (35 / 12) - 1) < 0.10), result.dice_var_scaled
print("Var(q·k) ≈ d_k and Var(q·k/√d_k) ≈ 1 for d_k =", list(result.d_ks))

# %% [markdown]
# ## Try this
# Change `d_ks` to `(1024, 4096)`: the unscaled variance keeps tracking d_k, the scaled one stays at 1.
