"""Training: config, loop, evaluation protocol, checkpoints, run directories."""

from qkv.training.config import TrainConfig
from qkv.training.evaluate import evaluate_loss, perplexity
from qkv.training.run import LoadedRun, load
from qkv.training.trainer import TrainResult, train

__all__ = ["LoadedRun", "TrainConfig", "TrainResult", "evaluate_loss", "load", "perplexity", "train"]
