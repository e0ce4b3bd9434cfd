"""IR → JAX: graph interpretation under jit, initializers, optimizers, steps."""
