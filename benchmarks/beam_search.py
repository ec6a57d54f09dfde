"""Beam search against greedy on a translation run: BLEU, output length, a paired bootstrap, and the coverage check.

For each beam setting (K, α, β of GNMT's score) it decodes a split of the run's corpus and prints corpus BLEU
(sacrebleu), the output length over the references', the decoding time, and beam − greedy with the 95 %
interval of a paired bootstrap (1,000 resamples). --coverage measures what GNMT's coverage penalty assumes:
that the last decoder layer's cross-attention (mean over heads), summed over a *reference* translation,
covers each source token about once.

    python benchmarks/beam_search.py RUN_DIR --split val --limit 500 --beam 4,0.6,0.2 --beam 4,1.0,0 --coverage
"""

from __future__ import annotations

import argparse
import time

import torch

from qkv.attention import record_attention
from qkv.tasks import load
from qkv.translation.batching import make_batch
from qkv.translation.decoding import gnmt_coverage_penalty
from qkv.translation.metrics import corpus_bleu, paired_bootstrap_bleu


def coverage_of_references(run: object, pairs: list[tuple[str, str]], beta: float = 0.2) -> tuple[float, float]:
    """(share of source tokens whose coverage on the reference stays below 1, mean cp(β) of the references)."""
    model, tokenizer = run.model, run.tokenizer  # type: ignore[attr-defined]
    sp = run.translator().specials  # type: ignore[attr-defined]
    last = f"decoder.layers.{len(model.decoder.layers) - 1}.cross_attn"
    under = total = 0
    penalties: list[float] = []
    for i in range(0, len(pairs), 32):
        chunk = pairs[i : i + 32]
        batch = make_batch([tokenizer.encode(s) for s, _ in chunk], [tokenizer.encode(t) for _, t in chunk], sp)
        with torch.no_grad(), record_attention(model, only=last) as recorder:
            model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        weights = recorder.weights_of(last)[-1].float().mean(1)  # (B, T, S)
        coverage = (weights * (batch.tgt_out != sp.pad)[..., None]).sum(1)  # (B, S): over real target tokens
        src_pad = batch.src == sp.pad
        under += int(((coverage < 1) & ~src_pad).sum())
        total += int((~src_pad).sum())
        penalties += gnmt_coverage_penalty(coverage, src_pad, beta).tolist()
    return under / total, sum(penalties) / len(penalties)


def main() -> None:
    """Decode, score and compare each setting with greedy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--split", default="val", help="val, or a test split of the run's corpus (test, books, …)")
    parser.add_argument("--limit", type=int, default=None, help="the first N pairs of the split")
    parser.add_argument("--beam", action="append", default=[], metavar="K,ALPHA,BETA")
    parser.add_argument("--coverage", action="store_true", help="also measure the coverage of the references")
    args = parser.parse_args()
    torch.set_num_threads(1)  # decoding steps are tiny matmuls (qkv.io.devices): one thread each, as qkv does
    run = load(args.run_dir)
    splits = run.config.splits()
    named = {"val": splits.val, **splits.tests}
    if args.split not in named:
        parser.error(f"--split {args.split}: choose one of {', '.join(named)}")
    pairs = named[args.split][: args.limit]
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    print(f"{args.run_dir}: {len(pairs)} {args.split} pairs")
    if args.coverage:
        share, penalty = coverage_of_references(run, pairs)
        print(f"references: {share:.1%} of source tokens covered < 1; mean cp(β = 0.2) {penalty:.2f}")
    began = time.perf_counter()
    greedy = run.translator().translate(sources, 1)
    print(f"greedy            BLEU {corpus_bleu(greedy, references):6.2f}  length {_ratio(greedy, references):.3f}"
          f"  {time.perf_counter() - began:5.0f} s")  # fmt: skip
    for setting in args.beam:
        k, alpha, beta = setting.split(",")
        began = time.perf_counter()
        hyps = run.translator(float(alpha), float(beta)).translate(sources, int(k))
        seconds = time.perf_counter() - began
        versus = paired_bootstrap_bleu(greedy, hyps, references)
        print(f"beam {k} α {alpha} β {beta}  BLEU {corpus_bleu(hyps, references):6.2f}  length "
              f"{_ratio(hyps, references):.3f}  {seconds:5.0f} s  vs greedy {versus}")  # fmt: skip


def _ratio(hypotheses: list[str], references: list[str]) -> float:
    """Output words over reference words (BLEU's brevity penalty starts below 1)."""
    return sum(len(h.split()) for h in hypotheses) / sum(len(r.split()) for r in references)


if __name__ == "__main__":
    main()
