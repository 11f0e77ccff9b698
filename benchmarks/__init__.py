"""Benchmarks for gradclip: speed, accuracy and memory against plain torch.

Run ``python -m benchmarks.run --help``; results and targets are in BENCHMARKS.md.
"""
