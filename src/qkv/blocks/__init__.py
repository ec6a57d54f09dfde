"""Building blocks: dropout, feed-forward, residual + norm, encoder and decoder layers and stacks."""

from qkv.blocks.dropout import Dropout
from qkv.blocks.feed_forward import FeedForward
from qkv.blocks.layers import Decoder, DecoderLayer, Encoder, EncoderLayer
from qkv.blocks.residual import ResidualNorm

__all__ = [
    "Decoder",
    "DecoderLayer",
    "Dropout",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "ResidualNorm",
]
