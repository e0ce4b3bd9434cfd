"""sexpgpu: an experiment compiler. One `.sx` file in, a training run on XLA out.

    import sexpgpu
    exp = sexpgpu.compile("configs/tiny-lm.sx", variant="smoke")
    run = exp.run()                    # trains here; run.params are the trained parameters
    exp.sample(run.params, "3 1 4", tokens=8).text
    exp.export(run.params, "tiny.safetensors")

`help(sexpgpu.Experiment)` lists what an experiment does; `sexpgpu.__all__` is the API.
"""

__all__ = ["Experiment", "Loc", "Run", "Sample", "State", "SxError", "compile", "compile_text",
           "op"]

_API = ("Experiment", "Run", "Sample", "State", "compile", "compile_text")


def __getattr__(name: str):
  # Everything is imported on first use, so the CLI's entry point (which imports this
  # package first) installs its signal handlers before anything else is loaded.
  if name in ("Loc", "SxError"):
    from sexpgpu import errors
    return getattr(errors, name)
  if name in _API:
    from sexpgpu import api
    return getattr(api, name)
  if name == "op":
    from sexpgpu import userops
    return userops.op
  raise AttributeError(f"module 'sexpgpu' has no attribute {name!r}")


def __dir__() -> list[str]:
  # Tab completion and dir() see the public API (which __getattr__ imports on first use),
  # not the submodules that importing it leaves as attributes.
  return sorted(__all__)
