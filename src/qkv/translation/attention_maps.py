"""Cross-attention maps: which source tokens each target token looked at, one PNG per decoder layer."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from qkv.attention import AttentionRecorder, padding_mask_from_ids, record_attention
from qkv.models import Transformer
from qkv.translation.run import Translator


def _labels(translator: Translator, ids: list[int]) -> list[str]:
    """Readable token strings (byte-level BPE pieces decoded one by one)."""
    sp = translator.specials
    names = {sp.bos: "<s>", sp.eos: "</s>", sp.pad: "<pad>"}
    return [names.get(i) or translator.tokenizer.decode([i]) for i in ids]


@torch.no_grad()
def teacher_forced_attention(model: Transformer, src: Tensor, tgt: Tensor, pad: int | None = None) -> AttentionRecorder:
    """Every attention weight of one teacher-forced pass: source (1, S), decoder input (1, T); pad masks the source."""
    src_mask = padding_mask_from_ids(src, pad) if pad is not None else None  # (1, 1, 1, S)
    with record_attention(model) as recorder:
        model.decode(tgt, model.encode(src, src_mask), src_mask)
    return recorder


def recorded_translation(
    translator: Translator, sentence: str, beam_size: int = 1
) -> tuple[list[int], list[int], AttentionRecorder]:
    """Translate a sentence, then record one teacher-forced pass over <s> + the output.

    Returns the source ids, the decoder's input ids (<s> + output) and the recorded attention. These
    are the weights incremental decoding used: the same prefixes, the same memory.
    """
    src = translator.encode_sources([sentence])  # (1, S)
    sp = translator.specials
    tgt = [sp.bos, *translator.decode_ids(src, beam_size)[0]]
    recorder = teacher_forced_attention(translator.model, src, torch.tensor([tgt], device=src.device), sp.pad)
    return src[0].tolist(), tgt, recorder


def cross_attention(
    translator: Translator, sentence: str, beam_size: int = 1
) -> tuple[list[str], list[str], list[Tensor]]:
    """Source labels, target labels and per-layer cross-attention weights (H, T, S) for a sentence's translation."""
    src, tgt, recorder = recorded_translation(translator, sentence, beam_size)
    # Target labels name what each row predicted: output token t was produced while reading tgt[t].
    targets = _labels(translator, [*tgt[1:], translator.specials.eos])
    layers = [w[0].float().cpu() for w in recorder.weights_of("decoder.layers.*.cross_attn")]
    return _labels(translator, src), targets, layers


def save_cross_attention_maps(translator: Translator, sentence: str, out_dir: Path, beam_size: int = 1) -> list[Path]:
    """Write cross_attention_layer{N}.png (heads in a grid) for the sentence; return the paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, headless
    import matplotlib.pyplot as plt

    sources, targets, layers = cross_attention(translator, sentence, beam_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, weights in enumerate(layers, start=1):  # weights (H, T, S)
        n_heads = weights.shape[0]
        cols = math.ceil(math.sqrt(n_heads))
        rows = math.ceil(n_heads / cols)
        size = (max(4.0, 0.32 * len(sources)) * cols, max(3.0, 0.3 * len(targets)) * rows)
        fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, dpi=100)
        for head, ax in enumerate(axes.flat):
            if head >= n_heads:
                ax.axis("off")
                continue
            ax.imshow(weights[head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_xticks(range(len(sources)), sources, rotation=90, fontsize=7)
            ax.set_yticks(range(len(targets)), targets, fontsize=7)
            ax.set_title(f"head {head + 1}", fontsize=9)
            ax.set_xlabel("source (German)", fontsize=8)
            ax.set_ylabel("target (English)", fontsize=8)
        fig.suptitle(f"cross-attention, decoder layer {layer}")
        fig.tight_layout()
        path = out_dir / f"cross_attention_layer{layer}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
