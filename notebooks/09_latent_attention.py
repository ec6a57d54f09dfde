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
# # 9. Multi-head latent attention (MLA)
#
# Generating text reads every layer's key/value cache once per new token, so the cache's size bounds
# both the batch that fits in memory and the speed. Multi-head attention caches 2 · H · d_h numbers per
# token and layer. GQA and MQA share key/value heads (notebook 5). DeepSeek's MLA instead compresses each
# token into **one latent** c_KV of d_c numbers shared by all heads, plus one small rotary key of d_r
# numbers, and caches only those: d_c + d_r per token and layer.
#
# The heads' keys and values are recovered from the latent with up-projections W_UK and W_UV. **Weight
# absorption**: since q · (W_UK c) = (W_UKᵀ q) · c, W_UK can be folded into the query and the scores
# taken against the cached latents directly, never decompressing the keys; W_UV folds into the output
# the same way. Both paths give the same numbers.

# %%
# %matplotlib inline
import torch

from qkv import DecoderLM, DecoderLMConfig
from qkv.lab.plotting import COLORS, label, new_figure

torch.manual_seed(0)
d_c, d_r = 64, 16  # MLA's latent and its rotary key: the numbers it caches per token and layer
# One small model, then three that differ only in their blocks' attention: `override` changes a part of the
# config tree by its path (attention.n_kv_heads stands for decoder.block.attention.n_kv_heads), and setting
# "attention" to "mla" switches its kind, keeping the settings both kinds share (n_heads, bias, dropout).
base = DecoderLMConfig.of(vocab_size=100, d_model=256, n_heads=8, n_layers=2, max_positions=256, positions="rotary")
variants = {
    "MHA": base,
    "GQA (2 kv heads)": base.override({"attention.n_kv_heads": 2}),
    "MQA (1 kv head)": base.override({"attention.n_kv_heads": 1}),
    "MLA": base.override({"attention": "mla", "attention.kv_lora_rank": d_c, "attention.qk_rope_head_dim": d_r}),
}
print(variants["MLA"].decoder.block.attention)
ids = torch.randint(0, 100, (1, 100))
bytes_per_token = {}
for name, cfg in variants.items():
    model = DecoderLM(cfg).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)  # fills the cache with 100 tokens
    bytes_per_token[name] = sum(layer.self_attn.nbytes() for layer in cache) / ids.shape[1]
    print(f"{name:22} {bytes_per_token[name]:7.0f} bytes per token ({cfg.decoder.n_layers} layers, float32)")

# %%
fig, axes = new_figure(1, 1, width=7, height=3.6)
ax = axes[0, 0]
ax.bar(list(bytes_per_token), list(bytes_per_token.values()), color=COLORS[: len(bytes_per_token)])
label(ax, "KV cache per generated token", "attention", "bytes per token (2 layers, float32)")
fig

# %% [markdown]
# ## Weight absorption gives the same numbers
# The same weights, decoded token by token with a cache: once decompressing K and V for every cached
# token (naive), once scoring the queries against the latents (absorbed).

# %%
mla = variants["MLA"]
naive = DecoderLM(mla).eval()
absorbed = DecoderLM(mla.override({"attention.absorb": True})).eval()
absorbed.load_state_dict(naive.state_dict())
outputs = []
for model in (naive, absorbed):
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(ids[:, t : t + 1], cache=cache)[0, -1] for t in range(20)]  # one token at a time
    outputs.append(torch.stack(steps))
print("max |naive − absorbed| over 20 decoding steps:", float((outputs[0] - outputs[1]).abs().max()))

# %% [markdown]
# ## The claims, checked
# MLA's cache is smaller than MHA's (here d_c + d_r = 80 numbers per token and layer against 512) and
# than GQA's; the absorbed and naive paths agree. MQA caches even less (64 numbers here), but its one key
# and one value are shared by every head, while MLA gives each head its own keys and values, decompressed
# from the latent: more expressive for a similar cache.

# %%
mha_bytes, mla_bytes = bytes_per_token["MHA"], bytes_per_token["MLA"]
assert mha_bytes == 2 * 2 * 256 * 4  # layers × (K and V) × d_model × 4 bytes
assert mla_bytes == 2 * (d_c + d_r) * 4  # layers × (d_c + d_r) × 4 bytes
assert mla_bytes < bytes_per_token["GQA (2 kv heads)"] < mha_bytes
torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
print(f"MLA caches {mha_bytes / mla_bytes:.1f}× less than MHA")

# %% [markdown]
# ## Try this
# Set `d_c = 32`: MLA's cache goes from 80 to 48 numbers per token and layer. To see what the loss pays,
# train the default recipe (`qkv train --out-dir runs/mqa`, one key/value head) and
# `qkv train --out-dir runs/mla --model attention=mla --model attention.kv_lora_rank=64`, and compare their
# losses.
