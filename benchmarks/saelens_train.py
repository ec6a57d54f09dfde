"""SAELens's side of benchmarks/sae_vs_saelens.py, run in .venv-saelens: its SAETrainer on a qkv activation cache.

    .venv-saelens/bin/python benchmarks/saelens_train.py CACHE OUT STEPS SCALE HOOK

The cache's buffers are read in order and cut into batches of 4,096 rows: the rows, and their order, that qkv's run
on the same cache trains on. SCALE is qkv's input scale (√d over the mean norm of its sample), given to SAELens's
activation scaler so that both normalise alike; SAELens folds it into the weights when training ends.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.saes.sae import SAEMetadata
from sae_lens.training.sae_trainer import SAETrainer
from safetensors.torch import load_file

BATCH = 4096


def batches(cache: Path) -> Iterator[torch.Tensor]:
    """The cache's rows in order, BATCH at a time (a batch may span two buffers, as qkv's do)."""
    meta = json.loads((cache / "meta.json").read_text())
    count = meta["rows"] // meta["buffer_tokens"]
    carry = torch.empty(0)
    for index in range(count):
        rows = torch.cat([carry, load_file(cache / f"buffer-{index:05d}.safetensors")["rows"]])
        whole = len(rows) // BATCH * BATCH
        yield from rows[:whole].split(BATCH)
        carry = rows[whole:]


def main(cache: str, out: str, steps: str, scale: str, hook: str) -> None:
    """Train and save the SAE in SAELens's inference format."""
    torch.manual_seed(0)
    n_steps = int(steps)
    d_in = int(load_file(Path(cache) / "buffer-00000.safetensors")["rows"].shape[1])
    metadata = SAEMetadata(hook_name=hook, model_name="SmolLM2-135M-Instruct")
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=8 * d_in, k=32, metadata=metadata,
                                                normalize_activations="expected_average_only_in"))  # fmt: skip
    cfg = SAETrainerConfig(total_training_samples=n_steps * BATCH, train_batch_size_samples=BATCH, lr=4e-4, lr_end=4e-4,
                           lr_warm_up_steps=25, lr_decay_steps=n_steps - 25, adam_beta1=0.9, adam_beta2=0.999,
                           dead_feature_window=1_000_000 // BATCH, feature_sampling_window=n_steps + 1)  # fmt: skip
    trainer = SAETrainer(cfg, sae, batches(Path(cache)))
    trainer.activation_scaler.scaling_factor = float(scale)  # qkv's, measured on its own sample: both alike
    began = time.monotonic()
    trainer.fit()
    print(f"SAELens trained {n_steps} steps in {time.monotonic() - began:.0f} s", flush=True)
    sae.save_inference_model(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
