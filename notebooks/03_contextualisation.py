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
# # 3. Attention as contextualisation: "bank"
#
# Attention gives each word a new vector that mixes in the words around it. The recipe, for one query
# word: take its dot product with every word, exponentiate, normalise so the weights sum to 1, and add
# up the word vectors with those weights.
#
# With hand-made embeddings whose four dimensions mean [finance, nature, people, action], the ambiguous
# "bank" = [1, 1, 0, 0] is exactly halfway. Next to "river" it leans towards nature; next to "money",
# towards finance. `qkv.lab.walkthrough` computes every stage, like a spreadsheet.

# %%
# %matplotlib inline
from qkv.lab import walkthrough
from qkv.lab.walkthrough import DIMS, builtin_example, plot

river = walkthrough(*builtin_example("river"), query="bank", dims=DIMS)
money = walkthrough(*builtin_example("money"), query="bank", dims=DIMS)
print(river.table())

# %%
print(money.table())

# %%
plot([river, money], None)

# %% [markdown]
# ## The classic spreadsheet
# "A man has kept money in the bank", each word a 3-number embedding (one column per word in the
# spreadsheet, one row per word here). The stages are the same: scores, exponentials, weights, the
# weighted vectors and their sum.

# %%
classic = walkthrough(*builtin_example("classic"), query="bank")
print(classic.table())

# %% [markdown]
# ## The claim, checked
# The weights sum to 1; "bank" by the river ends up with more nature than finance, "bank" after
# "money" with more finance than nature.

# %%
finance, nature = DIMS.index("finance"), DIMS.index("nature")
for w in (river, money, classic):
    assert abs(w.weights.sum() - 1) < 1e-12
assert river.context[nature] > river.context[finance]
assert money.context[finance] > money.context[nature]
print("river bank:", river.context.round(3), " money bank:", money.context.round(3))

# %% [markdown]
# ## Try this
# Call `walkthrough(*builtin_example("river"), query="bank", dims=DIMS, scale=False)`: without the
# 1/√d scale the weights get sharper and "bank" leans further towards "river".
