"""Code kept apart from sexpgpu proper: hand-written kernels the lowering may choose."""
