"""Device-side pieces of a run: variables, the memory plan, stacking, nodes, doctor, report.

Nothing here starts a JAX backend on import; `env` never imports JAX at all, so
the variables can be checked before `jax.distributed.initialize` must run.
"""
