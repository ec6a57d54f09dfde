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
# # 10. Train your own GPT in a minute
#
# Everything so far, put together: a decoder-only Transformer (masked self-attention, rotary positions,
# RMSNorm, SwiGLU) trained on eight Shakespeare plays that ship inside qkv, character by character.
# `qkv.train` is the same one training loop that `qkv train` runs; the default recipe reaches a
# validation loss near 1.94 in about 20 s on two CPU cores.

# %%
# %matplotlib inline
import json
import math
import tempfile
from pathlib import Path

import numpy as np

import qkv
from qkv.lab.attention_map import plot as plot_attention
from qkv.lab.attention_map import run_attention_maps
from qkv.lab.plotting import COLORS, label, new_figure

run_dir = Path(tempfile.mkdtemp(prefix="qkv-gpt-")) / "run"
config = qkv.recipe("lm", {"out_dir": str(run_dir), "sample_tokens": 0})  # the default recipe, and where to save
print(config.model.decoder.block)  # each of its layers: attention, feed-forward, norm
result = qkv.train(config, verbose=False)
print(f"{result.step} steps in {result.elapsed_s:.0f} s, validation loss {result.final['val_loss']:.4f}")

# %% [markdown]
# ## The loss curve
# Every evaluation is a line of the run's metrics.jsonl.

# %%
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
fig, axes = new_figure(1, 1, width=7, height=4)
ax = axes[0, 0]
ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], "o--", color=COLORS[0], label="train")
ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], "o-", color=COLORS[1], label="validation")
label(ax, "Cross-entropy while training", "optimiser step", "loss (nats per character)")
ax.legend()
fig

# %% [markdown]
# ## Sampling
# The model's softmax over the next character, sampled with a temperature, fed back, 300 times.

# %%
run = qkv.load(run_dir)
print(run.generate("ROMEO:", max_new_tokens=300, temperature=0.8, seed=1))

# %% [markdown]
# ## What it attends to
# The attention weights of every layer and head on a line of text (`qkv.lab.attention_map` on the run
# loaded above): some heads
# look at the previous character, some further back.

# %%
maps = run_attention_maps(run, "ROMEO: But, soft!")
plot_attention(maps, None, index=len(maps.maps) - 1)

# %% [markdown]
# ## The claims, checked
# The model learned: its validation loss is far below the uniform guess, log(78) ≈ 4.36 nats, and below
# 2.1; every attention row sums to 1 and no character looks ahead.

# %%
assert result.final["val_loss"] < 2.1 < math.log(78)
for m in maps.maps:
    np.testing.assert_allclose(m.weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(m.weights, 1) == 0)
print("validation loss", round(result.final["val_loss"], 4))

# %% [markdown]
# ## Try this
# Train longer and deeper: `qkv.train(max_steps=1500, model={"n_layers": 6})`, and sample again.
