"""The optimizers and learning-rate schedules, declared once: each an optax chain with its
keywords (type, range, default, one doc line). The language's checks (front/options.py),
its builtins (front/prims.py), the lowering (lower/optim.py) and docs/language.md
(tools/langdoc.py) all read these tables; adding an optimizer is one entry of OPTIMIZERS.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

F32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1


def range_text(integer: bool, lo, hi, lo_open: bool, hi_open: bool) -> str:
  """A range as the errors and the reference say it: "an integer from 1 to 64", ..."""
  kind = "an integer" if integer else "a number"
  top = "3.4e38 (float32's largest)" if hi == F32_MAX else str(hi)
  if lo_open or hi_open:
    return (f"{kind} {'above' if lo_open else 'at least'} {lo} and "
            f"{'below' if hi_open else 'at most'} {top}")
  return f"{kind} from {lo} to {top}"


@dataclasses.dataclass(frozen=True)
class Keyword:
  """What an optimizer or schedule keyword accepts.

  Attributes:
    kind: "number", "integer", "bool", "rate" (a number or a schedule), "patterns" (a
      vector of glob patterns over parameter paths) or "choice" (a string of `choices`).
    lo, hi: the range of a number or integer; lo_open and hi_open exclude the ends.
    example: a value to show in a fix.
    doc: one line for docs/language.md.
  """

  kind: str
  example: str
  doc: str
  lo: float = 0
  hi: float = F32_MAX
  lo_open: bool = False
  hi_open: bool = False
  choices: tuple[str, ...] = ()

  def takes(self) -> str:
    """What the keyword takes, as the reference's table says it."""
    if self.kind == "rate":
      return "a number from 0, or a schedule"
    if self.kind == "bool":
      return "true or false"
    if self.kind == "patterns":
      return "a vector of glob patterns, such as " + self.example
    if self.kind == "choice":
      return "one of " + ", ".join(f'"{c}"' for c in self.choices)
    return range_text(self.kind == "integer", self.lo, self.hi, self.lo_open, self.hi_open)


KEYWORDS: dict[str, Keyword] = {
    "lr": Keyword("rate", "1e-3", "the learning rate: a number or a schedule (required)"),
    "clip": Keyword("number", "1.0", "clip the gradients' global norm to this first",
                    lo_open=True),
    "weight-decay": Keyword("number", "0.1", "decay toward 0 by lr × this × w a step, on the "
                            "parameters whose role decays (check --print params)"),
    "decay": Keyword("patterns", '["*/wpe"]', "parameter paths (globs) decayed whatever "
                     "their role"),
    "no-decay": Keyword("patterns", '["*/ln_*/*"]', "parameter paths (globs) never decayed"),
    "b1": Keyword("number", "0.9", "the first moment's decay", hi=1, hi_open=True),
    "b2": Keyword("number", "0.95", "the second moment's decay", hi=1, hi_open=True),
    "eps": Keyword("number", "1e-8", "added to the second moment's root"),
    "momentum": Keyword("number", "0.9", "the momentum's decay", hi=1),
    "adam-lr": Keyword("rate", "3e-4", "Muon's learning rate for what it does not "
                       "orthogonalise (AdamW's): a number or a schedule"),
    "ns-steps": Keyword("integer", "5", "Muon's Newton-Schulz iterations", lo=1, hi=100),
    "nesterov": Keyword("bool", "true", "Nesterov's momentum"),
    "decay-rate": Keyword("number", "0.8", "Adafactor's second-moment decay exponent", hi=1),
    "min-dim-size-to-factor": Keyword("integer", "128", "the smallest axis Adafactor factors",
                                      lo=1, hi=INT32_MAX),
    "peak": Keyword("number", "1e-3", "the highest learning rate (required)"),
    "warmup": Keyword("integer", "100", "steps of linear warmup from 0",
                      hi=INT32_MAX),
    "floor": Keyword("number", "0.1", "the last learning rate as a FRACTION of :peak (0.1: a "
                     "tenth of it), not nanoGPT's absolute min_lr: that is :min-lr", hi=1),
    "min-lr": Keyword("number", "6e-5", "the last learning rate, absolute (nanoGPT's "
                      "min_lr); not with :floor"),
    "decay-fraction": Keyword("number", "0.2", "the last fraction of :steps over which WSD "
                              "decays", hi=1, lo_open=True),
    "shape": Keyword("choice", '"cosine"', "how WSD decays: linearly, or along a half cosine",
                     choices=("linear", "cosine")),
    "steps": Keyword("integer", "2000", "the schedule's length (default: the run's steps)",
                     lo=1, hi=INT32_MAX),
}
# Every optimizer's keywords besides its own: (keyword, default)
COMMON = (("lr", None), ("clip", None), ("weight-decay", 0.0), ("decay", ()),
          ("no-decay", ()))


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """One optimizer: its own keywords with their defaults and its optax chain.

  Attributes:
    doc: one line for docs/language.md.
    own: (keyword, default) beyond COMMON.
    chain: (learning rate, keyword values with defaults filled (a rate keyword other than
      :lr lowered to a number or schedule), decay mask, matrices) → the optax
      transformation, without clipping (chained in front by the lowering). `matrices` maps
      each hidden or expert matrix's path to its (fan-in axes, fan-out axes) in its full
      (stacked) shape, read from its role; None without a graph.
    decoupled: the optimizer applies `:weight-decay` itself (AdamW's decoupled decay);
      otherwise the lowering chains optax.add_decayed_weights before it (L2 on the gradient).
  """

  doc: str
  own: tuple[tuple[str, Any], ...]
  chain: Callable[[Any, dict, Any, Any], Any]
  decoupled: bool = False

  @property
  def keywords(self) -> tuple[str, ...]:
    """Every keyword it takes, in the order the reference lists them."""
    return ("lr",) + tuple(k for k, _ in self.own) + tuple(k for k, _ in COMMON[1:])

  def defaults(self) -> dict[str, Any]:
    """Each keyword's default (None: absent unless written)."""
    return dict(COMMON + self.own)


def _optax():
  import optax
  return optax


def _sgd(lr, kw, mask, matrices):
  return _optax().sgd(lr, nesterov=bool(kw["nesterov"]))


def _momentum(lr, kw, mask, matrices):
  return _optax().sgd(lr, momentum=float(kw["momentum"]), nesterov=bool(kw["nesterov"]))


def _adam(lr, kw, mask, matrices):
  return _optax().adam(lr, b1=float(kw["b1"]), b2=float(kw["b2"]), eps=float(kw["eps"]))


def _adamw(lr, kw, mask, matrices):
  return _optax().adamw(lr, b1=float(kw["b1"]), b2=float(kw["b2"]), eps=float(kw["eps"]),
                        weight_decay=float(kw["weight-decay"]), mask=mask)


def _lion(lr, kw, mask, matrices):
  return _optax().lion(lr, b1=float(kw["b1"]), b2=float(kw["b2"]),
                       weight_decay=float(kw["weight-decay"]), mask=mask)


def _adafactor(lr, kw, mask, matrices):
  return _optax().adafactor(lr, decay_rate=float(kw["decay-rate"]),
                            min_dim_size_to_factor=int(kw["min-dim-size-to-factor"]))


def _muon(lr, kw, mask, matrices):
  """optax.contrib.muon on the hidden and expert matrices, each matrix of a stack (repeat's
  layers, experts) orthogonalised on its own (the stacked axes are MuonDimensionNumbers'
  batch axes, vmapped), and optax.adamw on the rest; the split and the decay from roles."""
  optax = _optax()
  from optax.contrib import MuonDimensionNumbers, muon

  def dims(params):
    """Each parameter's dimension numbers (None: AdamW's); by rank 2 without a graph."""
    if matrices is None:
      return {k: MuonDimensionNumbers() if getattr(v, "ndim", 0) == 2 else None
              for k, v in params.items()}
    return {k: MuonDimensionNumbers(*matrices[k]) if k in matrices else None for k in params}

  def labels(params):
    return {k: "adamw" if d is None else "muon" for k, d in dims(params).items()}

  wd = float(kw["weight-decay"])
  return optax.partition({
      "muon": muon(lr, ns_steps=int(kw["ns-steps"]), beta=float(kw["momentum"]),
                   nesterov=bool(kw["nesterov"]), weight_decay=wd, weight_decay_mask=mask,
                   muon_weight_dimension_numbers=dims),
      "adamw": optax.adamw(kw["adam-lr"], b1=float(kw["b1"]), b2=float(kw["b2"]),
                           eps=float(kw["eps"]), weight_decay=wd, mask=mask),
  }, labels)


OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer("stochastic gradient descent (optax.sgd)", (("nesterov", False),), _sgd),
    "momentum": Optimizer("SGD with momentum (optax.sgd :momentum)",
                          (("momentum", 0.9), ("nesterov", False)), _momentum),
    "adam": Optimizer("Adam (optax.adam); :weight-decay adds L2 to the gradient",
                      (("b1", 0.9), ("b2", 0.999), ("eps", 1e-8)), _adam),
    "adamw": Optimizer("AdamW, decay decoupled from the gradient (optax.adamw)",
                       (("b1", 0.9), ("b2", 0.999), ("eps", 1e-8)), _adamw, decoupled=True),
    "lion": Optimizer("Lion, the sign of an interpolated momentum (optax.lion)",
                      (("b1", 0.9), ("b2", 0.99)), _lion, decoupled=True),
    "adafactor": Optimizer("Adafactor, factored second moments (optax.adafactor)",
                           (("decay-rate", 0.8), ("min-dim-size-to-factor", 128)), _adafactor),
    "muon": Optimizer("Muon (optax.contrib.muon) on the hidden matrices, each layer's and "
                      "expert's apart; AdamW on embeddings, readout, norms, biases and the "
                      "rest (check --print params: opt)",
                      (("momentum", 0.95), ("nesterov", True), ("ns-steps", 5),
                       ("adam-lr", 3e-4), ("b1", 0.9), ("b2", 0.999), ("eps", 1e-8)),
                      _muon, decoupled=True),
}


# Each schedule is two halves: its numbers, worked out on the host in Python exactly as optax's
# schedule functions would hold them as constants (a difference such as peak - end taken in
# float64, then rounded once to float32), and a function of those numbers that does optax's
# jnp operations on them. Given Python numbers it computes what optax's schedule does; given
# the train step's traced arguments it computes the same bits, so the numbers (a rate, a
# length) are arguments of the step, not constants: another `--steps` or `lr` reuses its
# executable (tests/test_schedule_numbers.py holds the bits against optax's own schedules).
def _jnp():
  import jax.numpy as jnp
  return jnp


def _linear(span, end, steps):
  """optax.linear_schedule(init, end, steps): `span` is init - end, taken on the host."""
  def schedule(count):
    jnp = _jnp()
    count = jnp.clip(count - 0, 0, steps)
    frac = 1 - count / steps
    return span * (frac**1) + end
  return schedule


def _cosine(peak, decay, one_minus_alpha, alpha):
  """optax.cosine_decay_schedule(peak, decay, alpha): `decay` a float, as optax makes it."""
  def schedule(count):
    jnp = _jnp()
    count = jnp.minimum(count, decay)
    cosine_decay = 0.5 * (1 + jnp.cos(jnp.pi * count / decay))
    decayed = one_minus_alpha * cosine_decay**1.0 + alpha
    return peak * decayed
  return schedule


def _join(schedules, boundaries):
  """optax.join_schedules."""
  def schedule(step):
    jnp = _jnp()
    output = schedules[0](step)
    for boundary, later in zip(boundaries, schedules[1:]):
      output = jnp.where(step < boundary, output, later(step - boundary))
    return output
  return schedule


def _alpha(peak, end):
  return 0.0 if peak == 0.0 else end / peak


def _warmup_cosine_numbers(peak, warmup, end, total, kw):
  """optax.warmup_cosine_decay_schedule(0, peak, max(warmup, 1), max(total, warmup + 1), end)
  (a cosine of at least one step: optax refuses none, as a one-step run without warmup asks)."""
  w = max(warmup, 1)
  alpha = _alpha(peak, end)
  return {"rise": 0.0 - peak, "peak": peak, "warmup": w,
          "decay": float(max(max(total, warmup + 1) - w, 1)),
          "1-alpha": 1 - alpha, "alpha": alpha}


def _warmup_cosine(n, kw):
  return _join([_linear(n["rise"], n["peak"], n["warmup"]),
                _cosine(n["peak"], n["decay"], n["1-alpha"], n["alpha"])], [n["warmup"]])


def _warmup_linear_numbers(peak, warmup, end, total, kw):
  return {"rise": 0.0 - peak, "peak": peak, "warmup": max(warmup, 1), "fall": peak - end,
          "end": end, "decay": max(total - warmup, 1), "boundary": warmup}


def _warmup_linear(n, kw):
  return _join([_linear(n["rise"], n["peak"], n["warmup"]),
                _linear(n["fall"], n["end"], n["decay"])], [n["boundary"]])


def _warmup_stable_decay_numbers(peak, warmup, end, total, kw):
  decay = max(int(round(float(kw["decay-fraction"]) * total)), 1)
  start = max(total - decay, warmup)
  alpha = _alpha(peak, end)
  return {"rise": 0.0 - peak, "peak": peak, "warmup": max(warmup, 1), "boundary": warmup,
          "start": start, "decay": max(total - start, 1), "decay-f": float(max(total - start, 1)),
          "fall": peak - end, "end": end, "1-alpha": 1 - alpha, "alpha": alpha}


def _warmup_stable_decay(n, kw):
  """Warmup to :peak, held there, then down to the end over the last :decay-fraction of the
  steps: linearly, or with `shape` "cosine" (a half cosine)."""
  down = (_cosine(n["peak"], n["decay-f"], n["1-alpha"], n["alpha"])
          if kw.get("shape", "linear") == "cosine"
          else _linear(n["fall"], n["end"], n["decay"]))
  return _join([_linear(n["rise"], n["peak"], n["warmup"]), lambda count: n["peak"], down],
               [n["boundary"], n["start"]])


def _rsqrt_numbers(peak, warmup, end, total, kw):
  w = max(warmup, 1)
  return {"peak": peak, "warmup": w, "warmup-f": float(w)}


def _rsqrt(n, kw):
  def schedule(count):
    import jax
    jnp = jax.numpy
    return n["peak"] * jnp.minimum((count + 1) / n["warmup"], 1.0) * jax.lax.rsqrt(
        jnp.maximum(count + 1.0, n["warmup-f"]) / n["warmup"])
  return schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One learning-rate schedule: its keywords with defaults, its numbers and its function.

  Attributes:
    doc: one line for docs/language.md.
    keywords: (keyword, default); :peak is required.
    numbers: (peak, warmup, end, total steps, keyword values) → the numbers the schedule is
      made of (Python ints and floats, worked out as optax would); `end` is the last
      learning rate, absolute: :min-lr, or :peak × :floor.
    make: (numbers, keyword values) → a schedule of the step count; the numbers may be
      Python's or the step's traced arguments (the same bits either way).
    written: whether the language has it as a builtin of its name (`rsqrt` is not: it is the
      op 1/√x, and `(rsqrt :peak P)` the old spelling of warmup-rsqrt, front/prims.py).
  """

  doc: str
  keywords: tuple[tuple[str, Any], ...]
  numbers: Callable[[float, int, float, int, dict], dict]
  make: Callable[[dict, dict], Callable]
  written: bool = True


_PWFS = (("peak", None), ("warmup", 0), ("floor", 0.0), ("min-lr", None), ("steps", None))
SCHEDULES: dict[str, Schedule] = {
    "warmup-cosine": Schedule("linear warmup from 0 to :peak, then a cosine to :peak × "
                              ":floor (or :min-lr) at :steps", _PWFS, _warmup_cosine_numbers,
                              _warmup_cosine),
    "warmup-linear": Schedule("linear warmup from 0 to :peak, then linear to :peak × :floor "
                              "(or :min-lr) at :steps", _PWFS, _warmup_linear_numbers,
                              _warmup_linear),
    "warmup-stable-decay": Schedule(
        "WSD: linear warmup from 0 to :peak, held at :peak, then down to :peak × :floor (or "
        ":min-lr) over the last :decay-fraction of :steps", _PWFS[:4] + (
            ("decay-fraction", 0.2), ("shape", "linear")) + _PWFS[4:],
        _warmup_stable_decay_numbers, _warmup_stable_decay),
    "warmup-rsqrt": Schedule("linear warmup from 0 to :peak, then the inverse square root, "
                             ":peak × √(warmup / step)", (("peak", None), ("warmup", 0)),
                             _rsqrt_numbers, _rsqrt),
    # the old spelling, read as warmup-rsqrt (a Spec of this name still lowers)
    "rsqrt": Schedule("the old spelling of warmup-rsqrt", (("peak", None), ("warmup", 0)),
                      _rsqrt_numbers, _rsqrt, written=False),
}


def names_text() -> str:
  """`sgd momentum adam adamw lion adafactor muon`: the optimizers, for a fix."""
  return " ".join(OPTIMIZERS)
