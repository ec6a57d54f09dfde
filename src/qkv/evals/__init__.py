"""Benchmarks the field reports: zero-shot multiple choice (HellaSwag, ARC, PIQA, Winogrande), LAMBADA, and
bits per byte, scored offline as lm-evaluation-harness scores them."""
