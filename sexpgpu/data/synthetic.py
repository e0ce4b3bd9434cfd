"""Synthetic loaders: a random Markov chain and algorithmic tasks (copy, reverse, sort, add)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sexpgpu.data import base
from sexpgpu.data.spec import SEED_LIMIT, ArgTable, LoaderSpec, form_error, positive_int

_I32 = np.dtype(np.int32)
_BOOL = np.dtype(np.bool_)

# The most states a markov chain may have: its transition table is built when the file
# compiles (131072 states, a Llama 3 vocabulary, take about 8 s), so a larger :vocab is
# refused before anything is built.
MARKOV_STATES = 2**17


class MarkovLoader(base.Loader):
  """`(markov :vocab V :seq N :batch B :seed S [:branching 4] [:stream K])`.

  The transition table is drawn from S alone (so the entropy rate does not
  depend on the run's seed): a random cycle through all V states makes the
  chain irreducible, each state's successors are its cycle successor plus
  `branching - 1` other distinct states, and their weights are drawn from a
  flat Dirichlet. Each record starts from the chain's stationary
  distribution, so every position has the same law and the loss floor per
  predicted token is exactly the entropy rate. Microbatch i is drawn from a
  generator seeded by (run seed, S, stream, i).
  """

  kind = "markov"
  arg_table = ArgTable(("vocab", "seq", "batch", "seed"), {"branching": 4, "stream": 0})

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    # the chain's table is built here, state by state: at most MARKOV_STATES of them
    self.vocab = positive_int(spec, args, "vocab", maximum=MARKOV_STATES)
    self.seq = positive_int(spec, args, "seq")
    self.batch_size = positive_int(spec, args, "batch")
    self.chain_seed = positive_int(spec, args, "seed", minimum=0, maximum=SEED_LIMIT - 1)
    self.branching = positive_int(spec, args, "branching")
    self.stream = positive_int(spec, args, "stream", minimum=0)
    if self.branching > self.vocab:
      raise form_error(spec, f"`:branching {self.branching}` exceeds `:vocab {self.vocab}`",
                       "use a branching of at most the vocabulary size")
    self.seed = ctx.seed
    self.fields = {"tokens": ((self.batch_size, self.seq), _I32)}
    self.successors, self.weights = _transition_table(self.vocab, self.branching,
                                                      self.chain_seed)
    self.cum_weights = np.cumsum(self.weights, axis=1)
    self.cum_weights[:, -1] = 1.0
    self.stationary = _stationary(self.successors, self.weights)
    self.cum_stationary = np.cumsum(self.stationary)
    self.cum_stationary[-1] = 1.0

  def entropy_rate(self) -> float:
    """The chain's exact entropy rate in nats per token: sum of pi_s H(P_s)."""
    w = self.weights
    per_state = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0), axis=1)
    return float(self.stationary @ per_state)

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch: B sequences of N tokens, a pure function of i."""
    g = base.rng(base.TAG_MARKOV, self.seed, self.chain_seed, self.stream, i)
    b, n = self.batch_size, self.seq
    u = g.random((b, n))
    out = np.empty((b, n), np.int32)
    state = np.searchsorted(self.cum_stationary, u[:, 0], side="right")
    out[:, 0] = state
    for t in range(1, n):
      choice = (u[:, t, None] >= self.cum_weights[state]).sum(axis=1)
      state = self.successors[state, choice]
      out[:, t] = state
    return {"tokens": out}

  def describe(self) -> dict[str, Any]:
    """Kind, field types, records (None: endless) and the entropy rate."""
    return {**super().describe(), "entropy_rate": self.entropy_rate()}


def _transition_table(vocab: int, branching: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  g = base.rng(base.TAG_MARKOV_TABLE, seed)
  cycle = g.permutation(vocab)
  nxt = np.empty(vocab, np.int64)
  nxt[cycle] = np.roll(cycle, -1)
  successors = np.empty((vocab, branching), np.int64)
  for s in range(vocab):
    others = g.choice(vocab - 1, size=branching - 1, replace=False)
    others = others + (others >= nxt[s])  # skip the cycle successor
    successors[s] = np.concatenate([[nxt[s]], others])
  weights = g.dirichlet(np.ones(branching), size=vocab)
  return successors, weights


def _stationary(successors: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """The stationary distribution (unique: the chain is irreducible)."""
  vocab = successors.shape[0]
  if vocab <= 2048:
    p = np.zeros((vocab, vocab))
    np.add.at(p, (np.arange(vocab)[:, None], successors), weights)
    a = np.vstack([p.T - np.eye(vocab), np.ones((1, vocab))])
    rhs = np.zeros(vocab + 1)
    rhs[-1] = 1.0
    pi = np.linalg.lstsq(a, rhs, rcond=None)[0]
  else:  # power iteration on the lazy chain (same fixed point, aperiodic)
    pi = np.full(vocab, 1.0 / vocab)
    flat_succ, rows = successors.ravel(), np.repeat(np.arange(vocab), successors.shape[1])
    for _ in range(100_000):
      step = np.bincount(flat_succ, weights=pi[rows] * weights.ravel(), minlength=vocab)
      new = 0.5 * (pi + step)
      if np.abs(new - pi).sum() < 1e-13:
        pi = new
        break
      pi = new
  pi = np.clip(pi, 0.0, None)
  return pi / pi.sum()


# Token layout of the algorithmic tasks.
PAD, SEP, FIRST_SYMBOL = 0, 1, 2
ADD_PLUS, ADD_EQUALS, ADD_DIGIT0, ADD_VOCAB = 1, 2, 3, 13


class TaskLoader(base.Loader):
  """Algorithmic tasks: `(copy|reverse|sort :vocab V :seq N :batch B [:seed S])`.

  Token layout of a record of N tokens, L = (N - 1) // 2:
  `x_1 .. x_L SEP y_1 .. y_L PAD...` with symbols x drawn uniformly from
  2 .. V-1, SEP = 1, PAD = 0, and y the copy, the reversal or the sorted x.
  `:mask` is aligned with `:tokens`: true exactly at the answer positions
  (the y's), so a next-token loss uses the mask's last N-1 positions.
  Microbatch i is drawn from a generator seeded by (run seed, kind, S,
  stream, i).
  """

  arg_table = ArgTable(("vocab", "seq", "batch"), {"seed": 0, "stream": 0})
  _KIND_IDS = {"copy": 1, "reverse": 2, "sort": 3, "add": 4}

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.kind = spec.kind
    self.batch_size = positive_int(spec, args, "batch")
    self.task_seed = positive_int(spec, args, "seed", minimum=0, maximum=SEED_LIMIT - 1)
    self.stream = positive_int(spec, args, "stream", minimum=0)
    self.seed = ctx.seed
    self._setup(spec, args)
    self.fields = {"tokens": ((self.batch_size, self.seq), _I32),
                   "mask": ((self.batch_size, self.seq), _BOOL)}

  def _setup(self, spec: LoaderSpec, args: dict[str, Any]) -> None:
    self.vocab = positive_int(spec, args, "vocab", minimum=3)
    self.seq = positive_int(spec, args, "seq", minimum=3)
    self.length = (self.seq - 1) // 2

  def _rng(self, i: int) -> np.random.Generator:
    return base.rng(base.TAG_TASK, self.seed, self._KIND_IDS[self.kind],
                    self.task_seed, self.stream, i)

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of task records, a pure function of i."""
    b, n, l = self.batch_size, self.seq, self.length
    x = self._rng(i).integers(FIRST_SYMBOL, self.vocab, size=(b, l), dtype=np.int32)
    y = {"copy": x, "reverse": x[:, ::-1], "sort": np.sort(x, axis=1)}[self.kind]
    tokens = np.full((b, n), PAD, np.int32)
    tokens[:, :l], tokens[:, l], tokens[:, l + 1:2 * l + 1] = x, SEP, y
    mask = np.zeros((b, n), bool)
    mask[:, l + 1:2 * l + 1] = True
    return {"tokens": tokens, "mask": mask}


class AddLoader(TaskLoader):
  """`(add :digits D :batch B [:seq N] [:vocab V] [:seed S])`: decimal addition.

  Layout: `a_1..a_D + b_1..b_D = c_0..c_D PAD...`, numbers written most
  significant digit first and zero-padded (c has D+1 digits); tokens:
  PAD = 0, `+` = 1, `=` = 2, digit d = 3 + d, so the vocabulary is 13
  (`:vocab` may be larger). `:seq` defaults to 3D + 3. `:mask` is true at the
  digits of c.
  """

  arg_table = ArgTable(("digits", "batch"), {"seq": 0, "vocab": ADD_VOCAB, "seed": 0, "stream": 0})

  def _setup(self, spec: LoaderSpec, args: dict[str, Any]) -> None:
    self.digits = positive_int(spec, args, "digits")
    if self.digits > 18:
      raise form_error(spec, f"`:digits {self.digits}` is more than 18",
                       "use at most 18 digits")
    need = 3 * self.digits + 3
    self.seq = args["seq"] or need
    if positive_int(spec, args | {"seq": self.seq}, "seq") < need:
      raise form_error(spec, f"`:seq {self.seq}` is too short for {self.digits} digits",
                       f"use :seq {need} or more, or leave it out")
    self.vocab = positive_int(spec, args, "vocab", minimum=ADD_VOCAB)

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of additions, a pure function of i."""
    b, d = self.batch_size, self.digits
    g = self._rng(i)
    a = g.integers(0, 10 ** d, size=b, dtype=np.int64)
    c = g.integers(0, 10 ** d, size=b, dtype=np.int64)
    tokens = np.full((b, self.seq), PAD, np.int32)
    tokens[:, :d] = _digits(a, d)
    tokens[:, d] = ADD_PLUS
    tokens[:, d + 1:2 * d + 1] = _digits(c, d)
    tokens[:, 2 * d + 1] = ADD_EQUALS
    tokens[:, 2 * d + 2:3 * d + 3] = _digits(a + c, d + 1)
    mask = np.zeros((b, self.seq), bool)
    mask[:, 2 * d + 2:3 * d + 3] = True
    return {"tokens": tokens, "mask": mask}


def _digits(x: np.ndarray, width: int) -> np.ndarray:
  powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
  return (ADD_DIGIT0 + (x[:, None] // powers) % 10).astype(np.int32)
