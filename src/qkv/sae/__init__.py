"""Sparse autoencoders: a model's activations split into many sparse, often readable features.

    model      the SAE (TopK, BatchTopK, ReLU + L1) and its training loss, equal to SAELens's
    saelens    SAELens's format (cfg.json + sae_weights.safetensors), both ways
"""

from qkv.sae.model import Architecture, SAEConfig, SAELoss, SparseAutoencoder
from qkv.sae.saelens import load_saelens, save_saelens

__all__ = ["Architecture", "SAEConfig", "SAELoss", "SparseAutoencoder", "load_saelens", "save_saelens"]
