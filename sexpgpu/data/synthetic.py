"""Synthetic loaders: a random Markov chain and algorithmic tasks (copy, reverse, sort, add)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from sexpgpu.data import base
from sexpgpu.data.spec import LoaderDef, LoaderSpec, form_error, key

_I32 = np.dtype(np.int32)
_BOOL = np.dtype(np.bool_)

# The most states a markov chain may have: its transition table is built at the first
# batch or description (131072 states, a Llama 3 vocabulary, take about 8 s), so a larger
# :vocab is refused before anything is built.
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

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    # each value is in the range MARKOV (at the end of this file) declares: bind_args checked
    self.vocab, self.seq, self.batch_size = args["vocab"], args["seq"], args["batch"]
    self.chain_seed, self.branching, self.stream = args["seed"], args["branching"], args["stream"]
    if self.branching > self.vocab:
      raise form_error(spec, f"`:branching {self.branching}` exceeds `:vocab {self.vocab}`",
                       "use a branching of at most the vocabulary size")
    self.seed = ctx.seed
    self.fields = {"tokens": ((self.batch_size, self.seq), _I32)}

  @functools.cached_property
  def _chain(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(successors, weights, their cumulative sums, stationary law, its cumulative sum),
    built at the first batch or description: a paper plan that never draws a batch does not
    pay for a large vocabulary's table."""
    successors, weights = _transition_table(self.vocab, self.branching, self.chain_seed)
    cum_weights = np.cumsum(weights, axis=1)
    cum_weights[:, -1] = 1.0
    stationary = _stationary(successors, weights)
    cum_stationary = np.cumsum(stationary)
    cum_stationary[-1] = 1.0
    return successors, weights, cum_weights, stationary, cum_stationary

  successors = property(lambda self: self._chain[0], doc="each state's successors [V, K]")
  weights = property(lambda self: self._chain[1], doc="their transition weights [V, K]")
  cum_weights = property(lambda self: self._chain[2], doc="cumulative weights [V, K]")
  stationary = property(lambda self: self._chain[3], doc="the stationary law [V]")
  cum_stationary = property(lambda self: self._chain[4], doc="its cumulative sum [V]")

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
    successors, _, cum_weights, _, cum_stationary = self._chain
    state = np.searchsorted(cum_stationary, u[:, 0], side="right")
    out[:, 0] = state
    for t in range(1, n):
      choice = (u[:, t, None] >= cum_weights[state]).sum(axis=1)
      state = successors[state, choice]
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

  _KIND_IDS = {"copy": 1, "reverse": 2, "sort": 3, "add": 4}

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.kind = spec.kind
    self.batch_size, self.task_seed, self.stream = args["batch"], args["seed"], args["stream"]
    self.seed = ctx.seed
    self._setup(spec, args)
    self.fields = {"tokens": ((self.batch_size, self.seq), _I32),
                   "mask": ((self.batch_size, self.seq), _BOOL)}

  def _setup(self, spec: LoaderSpec, args: dict[str, Any]) -> None:
    self.vocab, self.seq = args["vocab"], args["seq"]
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

  def _setup(self, spec: LoaderSpec, args: dict[str, Any]) -> None:
    self.digits = args["digits"]
    if self.digits > 18:
      raise form_error(spec, f"`:digits {self.digits}` is more than 18",
                       "use at most 18 digits")
    need = 3 * self.digits + 3
    self.seq = args["seq"] or need
    if self.seq < need:
      raise form_error(spec, f"`:seq {self.seq}` is too short for {self.digits} digits",
                       f"use :seq {need} or more, or leave it out")
    self.vocab = args["vocab"]

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


# The synthetic kinds, declared beside their builders: each keyword's range and default.
MARKOV = LoaderDef(
    "markov", "a random Markov chain of tokens (:tokens [B seq], each row a walk from the "
    "chain's stationary law); check prints its entropy rate",
    (key("vocab", required=True, hi=MARKOV_STATES), key("seq", required=True),
     key("batch", required=True), key("seed", required=True), key("branching", default=4),
     key("stream")), MarkovLoader)
_TASK_KEYS = (key("seed"), key("stream"))
_TASK = (key("vocab", required=True, lo=3), key("seq", required=True, lo=3),
         key("batch", required=True)) + _TASK_KEYS
COPY = LoaderDef(
    "copy", "copy a random token sequence: :tokens [B seq] is `x, 1, x, 0…` (L = (seq−1)//2 "
    "symbols x drawn from 2..vocab−1, the separator 1, the answer, padding 0) and :mask [B seq] "
    "(bool) is true exactly on the answer's L positions", _TASK, TaskLoader)
REVERSE = LoaderDef(
    "reverse", "reverse a random token sequence: :tokens is `x, 1, reversed x, 0…` and :mask "
    "true on the reversed x (the second half), laid out as `copy`'s", _TASK, TaskLoader)
SORT = LoaderDef(
    "sort", "sort a random token sequence: :tokens is `x, 1, sorted x, 0…` and :mask true on "
    "the sorted x, laid out as `copy`'s", _TASK, TaskLoader)
ADD = LoaderDef(
    "add", "add two numbers digit by digit: :tokens is `a, 1 (+), b, 2 (=), c, 0…` with a and b "
    "D digits, c = a + b D+1 digits, most significant first, zero-padded, digit d as token 3+d "
    "(a vocabulary of 13); :mask true on c's digits; :seq defaults to 3D+3",
    (key("digits", required=True), key("batch", required=True), key("seq", default=0, lo=0),
     key("vocab", default=ADD_VOCAB, lo=ADD_VOCAB)) + _TASK_KEYS, AddLoader)
