"""The lab: every claim about attention as a function with numbers, a command with a table, and a plot.

Each experiment is a function here returning a dataclass of numbers with a `.table()` text rendering;
its module has `plot(result, path)` (writes a PNG, returns the matplotlib Figure) and `run(out_dir)`
(what `qkv lab NAME` does). `qkv lab report` puts them all on one self-contained HTML page.

    variance       why attention divides by √d_k
    softmax        saturation: one-hot outputs and vanishing Jacobians
    walkthrough    attention as contextualisation, step by step ("bank" by the river vs at the bank)
    positional     the sinusoidal encoding, and PE(p+k) as a rotation of PE(p)
    norms          BatchNorm vs LayerNorm vs RMSNorm
    masks          causal and padding masks in real attention weights
    heads          multi-head attention, shape by shape, checked against the module
    attention_map  a trained model's attention, every layer and head (PNG grids, bertviz JSON)
    induction      induction heads form in a phase change (a 2-layer attention-only model), and SmolLM2's

Importing this package does not import matplotlib: figures are drawn only when plot() is called.
"""

# Each function has its module's name, so after these imports qkv.lab.variance is the function;
# the modules stay reachable as `from qkv.lab.variance import plot` (Python resolves that via sys.modules).
from qkv.lab.attention_map import (
    AttentionMapResult,
    attention_map,
    decoder_attention_maps,
    encoder_attention_maps,
    transformer_attention_maps,
)
from qkv.lab.heads import HeadsResult, heads
from qkv.lab.induction import InductionResult, SmolLM2Heads, induction, smollm2_heads
from qkv.lab.masks import MasksResult, masks
from qkv.lab.norms import NormsResult, norms
from qkv.lab.plotting import Section
from qkv.lab.positional import PositionalResult, positional
from qkv.lab.report import build_report
from qkv.lab.softmax import SoftmaxResult, softmax, softmax_jacobian
from qkv.lab.variance import VarianceResult, variance
from qkv.lab.walkthrough import TrainableWalkthrough, Walkthrough, load_embeddings, trainable_walkthrough, walkthrough

__all__ = [
    "AttentionMapResult",
    "HeadsResult",
    "InductionResult",
    "MasksResult",
    "NormsResult",
    "PositionalResult",
    "Section",
    "SmolLM2Heads",
    "SoftmaxResult",
    "TrainableWalkthrough",
    "VarianceResult",
    "Walkthrough",
    "attention_map",
    "build_report",
    "decoder_attention_maps",
    "encoder_attention_maps",
    "heads",
    "induction",
    "load_embeddings",
    "masks",
    "norms",
    "positional",
    "smollm2_heads",
    "softmax",
    "softmax_jacobian",
    "trainable_walkthrough",
    "transformer_attention_maps",
    "variance",
    "walkthrough",
]
