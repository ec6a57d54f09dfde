"""Looking inside a model: named activations, patching, the logit lens, logit attribution, induction heads.

    hooks        every layer's streams, sublayer outputs and per-head outputs, cached or replaced
    lens         each layer's stream read through the final norm and the output head
    attribution  each layer's and head's direct contribution to a logit
    patching     exact activation patching between a clean and a corrupted prompt
    induction    induction and previous-token scores of every head, and where induction attention goes
"""

from qkv.interpret.attribution import Attribution, logit_attribution
from qkv.interpret.hooks import Site, head_results, hook_names, hook_sites, hooked, run_with_cache
from qkv.interpret.induction import (
    attention_breakdown,
    head_scores,
    induction_scores,
    previous_token_scores,
    repeated_tokens,
)
from qkv.interpret.lens import LensResult, Readout, logit_lens, readout_of
from qkv.interpret.patching import PatchingResult, activation_patching, logit_diff

__all__ = [
    "Attribution",
    "LensResult",
    "PatchingResult",
    "Readout",
    "Site",
    "activation_patching",
    "attention_breakdown",
    "head_results",
    "head_scores",
    "hook_names",
    "hook_sites",
    "hooked",
    "induction_scores",
    "logit_attribution",
    "logit_diff",
    "logit_lens",
    "previous_token_scores",
    "readout_of",
    "repeated_tokens",
    "run_with_cache",
]
