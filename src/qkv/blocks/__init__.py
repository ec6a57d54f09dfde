"""Building blocks: dropout, feed-forward (dense and mixture of experts), residual + norm, encoder and decoder
layers and the stacks of them, each with the config that builds it."""

from qkv.blocks.block import BlockConfig, DecoderLayer, EncoderLayer
from qkv.blocks.dropout import Dropout
from qkv.blocks.feed_forward import FeedForward, FeedForwardConfig
from qkv.blocks.moe import MoEConfig, MoEFeedForward
from qkv.blocks.residual import ResidualNorm
from qkv.blocks.stack import Decoder, Encoder, StackConfig

__all__ = [
    "BlockConfig",
    "Decoder",
    "DecoderLayer",
    "Dropout",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "FeedForwardConfig",
    "MoEConfig",
    "MoEFeedForward",
    "ResidualNorm",
    "StackConfig",
]
