"""Pallas kernels: flash attention, forward and backward, on Triton.

This folder is third_party/kernels/ at the repository's root; it is installed inside the
package as `sexpgpu.lower.kernels` (pyproject.toml's package-dir), under which name the
rest of sexpgpu imports it.

Each runs on the CPU with `interpret=True` (the tests do) and lowers to one
`__gpu$xla.gpu.triton` call a kernel on a GPU. `lower.attention` imports them
lazily, where a step lowers for a GPU. A chunked cross-entropy kernel once lived
here: no step used it (the `chunked-cross-entropy` op's `lax.scan` in
`lower.xent` is what runs), so it was removed.
"""
