"""sexpgpu: an experiment compiler. One `.sx` file in, a training run on XLA out."""

from sexpgpu.api import Experiment, State, compile, compile_text
from sexpgpu.errors import Loc, SxError

__all__ = ["Experiment", "Loc", "State", "SxError", "compile", "compile_text"]
