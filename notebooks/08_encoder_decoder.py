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
# # 8. The encoder, the decoder, and generation until the end symbol
#
# The encoder–decoder Transformer reads a source sequence with its **encoder** (self-attention in both
# directions), and writes the target one token at a time with its **decoder**: masked self-attention
# over what it has written so far, then **cross-attention** from each written position to the
# encoder's output (the "memory"), then a feed-forward network. A **final linear layer and a softmax**
# turn the decoder's last vector into a probability for every token of the vocabulary; the most likely
# one is appended, and the loop goes on **until the end symbol** `</s>` comes out.
#
# To see every part work in under a minute on a CPU, this notebook does not translate: it trains the
# model on a sanity task in the spirit of the Annotated Transformer's copy task, reversing a sequence of
# ten digits (`qkv train reverse`). A German → English model is this same model class and this same
# decoding loop, with a BPE vocabulary, a larger model and a longer training on top (`qkv train
# translate`, about 14 minutes here; `qkv translate RUN "Wie geht es dir?" --attention-maps DIR` then
# draws its cross-attention).

# %%
# %matplotlib inline
import tempfile

import torch

import qkv
from qkv.attention import padding_mask_from_ids
from qkv.lab.plotting import heatmap, new_figure
from qkv.tasks.toy import FIRST_DIGIT, SPECIALS

run_dir = tempfile.mkdtemp(prefix="qkv-reverse-")
config = qkv.recipe("reverse", {"max_steps": 300, "n_test": 200, "out_dir": run_dir})  # the task's recipe, changed
result = qkv.train(config, verbose=False)
run = qkv.load(run_dir)
model = run.model
exact = result.final["val_exact_match"]
print(f"{result.step} steps in {result.elapsed_s:.0f} s; held-out sequences reversed exactly: {exact:.1%}")

# %% [markdown]
# ## The parts of the model
# The run's model config is a tree of component configs: an embedding, then an encoder stack and a decoder
# stack, each `n_layers` layers of one block (its attention, feed-forward and norm). The model is built
# along the same tree.

# %%
print(run.config.model.decoder)
print(model)

# %% [markdown]
# ## Encoding the source, then decoding token by token

# %%
digits = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # ten digits, the length the model was trained on
src = torch.tensor([[FIRST_DIGIT + d for d in digits] + [SPECIALS.eos]])  # (1, S): the digits, then </s>
src_mask = padding_mask_from_ids(src, SPECIALS.pad)
with torch.no_grad():
    memory = model.encode(src, src_mask)  # (1, S, d_model): one vector per source token
    print("memory", tuple(memory.shape))
    tokens = [SPECIALS.bos]
    while tokens[-1] != SPECIALS.eos and len(tokens) < 20:
        logits = model.decode(torch.tensor([tokens]), memory, src_mask)[0, -1]  # the final linear layer
        probs = torch.softmax(logits, dim=-1)  # … and the softmax over the vocabulary
        tokens.append(int(probs.argmax()))
        shown = "</s>" if tokens[-1] == SPECIALS.eos else str(tokens[-1] - FIRST_DIGIT)
        print(f"step {len(tokens) - 1}: next token {shown:>4}  with probability {float(probs.max()):.4f}")
output = [t - FIRST_DIGIT for t in tokens[1:-1]]
print("source", digits, "→ output", output)

# %% [markdown]
# ## What the decoder looked at
# Record every attention weight of one pass over the output (qkv.record_attention): the decoder's
# masked self-attention is lower-triangular, and its cross-attention to reverse a sequence reads the
# source from the end.

# %%
with torch.no_grad(), qkv.record_attention(model) as recorder:
    model.decode(torch.tensor([tokens[:-1]]), memory, src_mask)
self_weights = recorder.weights_of("decoder.layers.*.self_attn")[-1][0]  # (heads, T, T), last layer
cross_weights = recorder.weights_of("decoder.layers.*.cross_attn")[-1][0]  # (heads, T, S)
fig, axes = new_figure(1, 2, width=11, height=4.2)
rows = ["<s>", *map(str, output)]
cols = [*map(str, digits), "</s>"]
heatmap(
    axes[0, 0],
    self_weights.mean(0).numpy(),
    "decoder self-attention (masked), last layer",
    "key",
    "query",
    rows,
    rows,
    cbar_label="weight",
    vmin=0,
    vmax=1,
)
heatmap(
    axes[0, 1],
    cross_weights.mean(0).numpy(),
    "cross-attention to the source, last layer",
    "source token",
    "output position",
    cols,
    rows,
    cbar_label="weight",
    vmin=0,
    vmax=1,
)
fig

# %% [markdown]
# ## The claims, checked
# The output is the source reversed, produced token by token until `</s>`; the decoder's self-attention
# puts no weight on later positions; every softmax row sums to 1.

# %%
assert output == digits[::-1], output
assert tokens[-1] == SPECIALS.eos
assert torch.all(torch.triu(self_weights, diagonal=1) == 0)
torch.testing.assert_close(cross_weights.sum(-1), torch.ones(cross_weights.shape[:-1]))
print("reversed:", output)

# %% [markdown]
# ## Try this
# Replace `digits` by another sequence of ten digits: the output is that sequence reversed, and the
# cross-attention map still reads the source from the end.
