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
# # 2. Softmax saturation
#
# Take the scores x = [a, a, 2a]. For a = 1 the softmax is soft: [0.2119, 0.2119, 0.5761]. For a = 10
# the last entry already takes 0.9999 of the mass, and for a = 100 the output is one-hot to machine
# precision. Large scores are exactly what unscaled dot products of wide heads produce (notebook 1).
#
# Why it matters for learning: the softmax's Jacobian is ∂y/∂x = diag(y) − y yᵀ. When y is one-hot,
# diag(y) = y yᵀ and the Jacobian is zero: no gradient reaches the scores, so the queries and keys
# stop learning.

# %%
# %matplotlib inline
import numpy as np

from qkv.lab import softmax, softmax_jacobian
from qkv.lab.softmax import plot

result = softmax(base=(1.0, 1.0, 2.0), scales=(1.0, 10.0, 100.0))
print(result.table())

# %%
plot(result, None)

# %% [markdown]
# The Jacobian itself, for each a:

# %%
for a, y in zip(result.scales, result.probs, strict=True):
    print(f"a = {a:g}\n", np.array2string(softmax_jacobian(y), precision=4, suppress_small=True))

# %% [markdown]
# ## The claim, checked
# softmax([a, a, 2a]) puts 0.5761 on the last entry at a = 1 and 0.9999 at a = 10; the Jacobian's norm
# falls towards zero as a grows.

# %%
assert round(float(result.probs[0, 2]), 4) == 0.5761
assert round(float(result.probs[1, 2]), 4) == 0.9999
assert result.jacobian_norm[0] > result.jacobian_norm[1] > result.jacobian_norm[2]
assert result.jacobian_norm[2] < 1e-20
print("largest probability:", result.max_prob.round(4), " ‖J‖_F:", result.jacobian_norm)

# %% [markdown]
# ## Try this
# Add a fourth scale, `scales=(1.0, 10.0, 100.0, 0.1)`: at a = 0.1 the output is nearly uniform, and the
# Jacobian is larger than at any of the other three.
