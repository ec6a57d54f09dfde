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
# # 6. Sinusoidal positional encoding
#
# Attention is blind to order: permute the words and every output permutes with them. The paper adds
# to each token's embedding a vector PE(p) that depends on its position p:
#
#     PE(p, 2i)   = sin(p · ωᵢ)
#     PE(p, 2i+1) = cos(p · ωᵢ),   ωᵢ = 10000^(−2i/d_model)
#
# The early dimensions turn fast, the late ones slowly, like the hands of a clock. And for every offset
# k there is one fixed matrix M_k, a rotation of each (sin, cos) pair by the angle k·ωᵢ, with
# PE(p + k) = M_k · PE(p) for every p: a relative position is a rotation, which a layer can learn.

# %%
# %matplotlib inline
import numpy as np

from qkv.lab import positional
from qkv.lab.positional import plot, rotation
from qkv.positional import sinusoidal_table

result = positional(max_len=100, d_model=64, offsets=(1, 5, 25))
print(result.table())

# %%
plot(result, None)

# %% [markdown]
# ## Why sine and cosine, and not tangent?
# sin and cos stay within [−1, 1] for every position, so PE never swamps the embedding, and a (sin, cos)
# pair shifted by k is a rotation of the pair. tan(p·ω) has no such bound: it jumps to ±∞ wherever p·ω
# nears π/2, and a shift of tan is not a linear map of the old value.

# %%
p = np.arange(100)
tangent = np.tan(p * 1.0)  # the fastest dimension, ω₀ = 1
print(
    "sin range:",
    np.sin(p).min().round(3),
    np.sin(p).max().round(3),
    "  tan range:",
    tangent.min().round(1),
    tangent.max().round(1),
)

# %% [markdown]
# ## The claims, checked
# PE(p + k) = M_k PE(p) holds for every p and the offsets tried, to float32 precision; every entry of
# the table lies in [−1, 1]; tan does not stay bounded.

# %%
pe = sinusoidal_table(100, 64).double().numpy()
assert np.all(result.rotation_error < 1e-5)
np.testing.assert_allclose(pe[:95] @ rotation(5, 64).T, pe[5:], atol=1e-5)
assert np.abs(pe).max() <= 1.0
assert np.abs(tangent).max() > 10
print("max |M_k·PE(p) − PE(p+k)|:", result.rotation_error)

# %% [markdown]
# ## Try this
# Change `d_model=64` to `d_model=16` in `positional(...)`: fewer dimensions, whose frequencies fall off
# faster from one pair to the next, and the rotation still holds.
