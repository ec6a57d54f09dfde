"""Translation with the encoder–decoder Transformer: corpora, batches, the loss, decoding, BLEU, attention maps.

    corpus.py          the Ding German–English sentence pairs, a user's TSV pairs, fixed splits
    batching.py        padded source, shifted target (teacher forcing), length buckets
    step.py            the label-smoothed loss and its evaluation
    decoding.py        greedy decoding and beam search (GNMT's length and coverage penalties)
    hf_beam.py         transformers' beam search (its length penalty, early stopping, forced </s>), for MarianMT
    run.py             Translator: text in, text out
    metrics.py         BLEU and chrF (sacrebleu, in the translate extra)
    attention_maps.py  cross-attention maps of a translation
Training a translation model is the translate task of the one loop: qkv.tasks.translate.
"""
