"""Pallas kernels: flash attention and a chunked cross-entropy (forward passes).

Each runs on the CPU with `interpret=True` (the tests do) and compiles through
Triton on a GPU. `lower.attention` imports flash attention lazily, on a GPU only.
"""
