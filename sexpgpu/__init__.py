"""sexpgpu: an experiment compiler. One `.sx` file in, a training run on XLA out."""

__all__ = ["Experiment", "Loc", "State", "SxError", "compile", "compile_text", "op"]


def __getattr__(name: str):
  # Everything is imported on first use, so the CLI's entry point (which imports this
  # package first) installs its signal handlers before anything else is loaded.
  if name in ("Loc", "SxError"):
    from sexpgpu import errors
    return getattr(errors, name)
  if name in ("Experiment", "State", "compile", "compile_text"):
    from sexpgpu import api
    return getattr(api, name)
  if name == "op":
    from sexpgpu import userops
    return userops.op
  raise AttributeError(f"module 'sexpgpu' has no attribute {name!r}")
