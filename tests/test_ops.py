"""The ops of the table past transformers: values against NumPy/JAX eagerly and under jit,
gradients checked, and each op's mistakes placed at the `.sx` call with an E-code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder
from sexpgpu.front.experiment import global_env
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower.interp import run_graph
from sexpgpu.reader.read import read_text

R = np.random.default_rng(0)
X = R.normal(size=(2, 5, 6)).astype(np.float32)
M = R.normal(size=(4, 6)).astype(np.float32)
IDX = R.integers(0, 6, size=(2, 5, 3)).astype(np.int32)
IMG = R.normal(size=(2, 6, 6, 3)).astype(np.float32)
KER = R.normal(size=(3, 3, 3, 4)).astype(np.float32)
SEQ = R.normal(size=(2, 7, 4)).astype(np.float32)
KER1 = R.normal(size=(3, 1, 4)).astype(np.float32)
BOOL = R.random(size=(2, 5, 6)) > 0.5
VALUES = {"x": X, "m": M, "idx": IDX, "img": IMG, "ker": KER, "seq": SEQ, "ker1": KER1,
          "p": BOOL, "q": ~BOOL}


def graph_of(expr: str, names: tuple[str, ...]):
  """The graph of EXPR over the named test tensors, built as an experiment builds one."""
  env = global_env({})
  b = Builder(env)
  binds = " ".join(f"{n} (get batch :{n})" for n in names)
  form = read_text(f"(fn [batch] (let [{binds}] {expr}))", "ops.sx")[0]
  fields = {n: (str(np.dtype(VALUES[n].dtype).name).replace("float32", "f32")
                .replace("int32", "i32"), VALUES[n].shape) for n in names}
  g, _ = b.build("out", b.eval(form, env), fields)
  return g


def value(expr: str, *names: str, jit: bool = False):
  g = graph_of(expr, names)
  f = lambda inputs: run_graph(g, {}, inputs, LowerCtx())["out"]  # noqa: E731
  return np.asarray((jax.jit(f) if jit else f)({n: jnp.asarray(VALUES[n]) for n in names}))


def _np_cumsum_exclusive(x):
  return np.concatenate([np.zeros_like(x[..., :1]), np.cumsum(x, -1)[..., :-1]], -1)


def _np_conv2d(x, w, stride=1, pad=0):
  x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  kh, kw, _, co = w.shape
  oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
  out = np.zeros((x.shape[0], oh, ow, co), np.float32)
  for i in range(oh):
    for j in range(ow):
      patch = x[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]
      out[:, i, j] = np.einsum("bhwc,hwco->bo", patch, w)
  return out


def _np_causal_depthwise(x, w):
  k = w.shape[0]
  xp = np.pad(x, ((0, 0), (k - 1, 0), (0, 0)))
  return np.stack([np.sum(xp[:, t:t + k, :] * w[:, 0, :], axis=1) for t in range(x.shape[1])], 1)


def _np_pool(x, k, fn):
  b, h, w, c = x.shape
  return fn(x.reshape(b, h // k, k, w // k, k, c), axis=(2, 4))


CASES = [
    ("(erf x)", ("x",), lambda: jax.scipy.special.erf(X)),
    ("(softplus x)", ("x",), lambda: np.log1p(np.exp(X))),
    ("(log1p (abs x))", ("x",), lambda: np.log1p(np.abs(X))),
    ("(expm1 x)", ("x",), lambda: np.expm1(X)),
    ("(floor x)", ("x",), lambda: np.floor(X)),
    ("(ceil x)", ("x",), lambda: np.ceil(X)),
    ("(round (* x 3))", ("x",), lambda: np.round(X * 3)),
    ("(sign x)", ("x",), lambda: np.sign(X)),
    ("(isfinite (log (max x 0.0)))", ("x",), lambda: X > 0),
    ("(mod x 0.5)", ("x",), lambda: np.mod(X, 0.5)),
    ("(logical-and p q)", ("p", "q"), lambda: BOOL & ~BOOL),
    ("(logical-or p q)", ("p", "q"), lambda: BOOL | ~BOOL),
    ("(logical-not p)", ("p",), lambda: ~BOOL),
    ("(stop-gradient x)", ("x",), lambda: X),
    ("(clip x :min -0.5 :max 0.25)", ("x",), lambda: np.clip(X, -0.5, 0.25)),
    ("(clip x :max 0.0)", ("x",), lambda: np.minimum(X, 0.0)),
    ("(tril x)", ("x",), lambda: np.tril(X)),
    ("(triu x :k 1)", ("x",), lambda: np.triu(X, 1)),
    ("(flip x :axis 1)", ("x",), lambda: X[:, ::-1]),
    ("(tile m :reps [2 1])", ("m",), lambda: np.tile(M, (2, 1))),
    ("(pad m :widths [[1 0] [0 2]] :value 3.0)", ("m",),
     lambda: np.pad(M, ((1, 0), (0, 2)), constant_values=3.0)),
    ("(cumsum x)", ("x",), lambda: np.cumsum(X, -1)),
    ("(cumsum x :axis 1 :reverse true)", ("x",), lambda: np.cumsum(X[:, ::-1], 1)[:, ::-1]),
    ("(cumsum x :exclusive true)", ("x",), lambda: _np_cumsum_exclusive(X)),
    ("(cumprod x :axis 0)", ("x",), lambda: np.cumprod(X, 0)),
    ("(sort x)", ("x",), lambda: np.sort(X, -1)),
    ("(sort x :axis 1 :descending true)", ("x",), lambda: -np.sort(-X, 1)),
    ("(argsort x)", ("x",), lambda: np.argsort(X, -1, kind="stable")),
    ("(get (top-k x :k 2) 0)", ("x",), lambda: -np.sort(-X, -1)[..., :2]),
    ("(get (top-k x :k 2) 1)", ("x",), lambda: np.argsort(-X, -1, kind="stable")[..., :2]),
    ("(take-along x idx :axis -1)", ("x", "idx"), lambda: np.take_along_axis(X, IDX, -1)),
    ("(scatter-add m (get (top-k (sum x [0 2]) :k 2) 1) (squeeze (slice (slice x 0 0 1) 1 0 2) 0))",
     ("m", "x"), None),
    ("(conv img ker)", ("img", "ker"), lambda: _np_conv2d(IMG, KER)),
    ("(conv img ker :padding \"same\")", ("img", "ker"), lambda: _np_conv2d(IMG, KER, pad=1)),
    ("(conv img ker :stride 2 :padding [[1 1] [1 1]])", ("img", "ker"),
     lambda: _np_conv2d(IMG, KER, stride=2, pad=1)),
    ("(conv seq ker1 :padding \"causal\" :groups 4)", ("seq", "ker1"),
     lambda: _np_causal_depthwise(SEQ, KER1)),
    ("(max-pool img :window 2)", ("img",), lambda: _np_pool(IMG, 2, np.max)),
    ("(avg-pool img :window [2 2] :stride 2)", ("img",), lambda: _np_pool(IMG, 2, np.mean)),
]


def _scatter_reference():
  idx = np.argsort(-X.sum((0, 2)), kind="stable")[:2]
  out = M.copy()
  for j, i in enumerate(idx):
    out[i] += X[0, j]
  return out


@pytest.mark.parametrize("expr,names,ref", CASES, ids=[c[0] for c in CASES])
def test_values_equal_the_reference_eagerly_and_under_jit(expr, names, ref):
  want = _scatter_reference() if ref is None else np.asarray(ref())
  for jit in (False, True):
    got = value(expr, *names, jit=jit)
    assert got.shape == want.shape
    assert got.dtype == {"b": np.bool_, "i": np.int32}.get(want.dtype.kind, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"jit={jit}")


GRADS = ["(erf x)", "(softplus x)", "(expm1 x)", "(clip x :min -0.5 :max 0.25)", "(tril x)",
         "(flip x :axis 1)", "(pad m :widths [[1 0] [0 2]])", "(tile m :reps [1 2])",
         "(cumsum x :axis 1)", "(cumprod x)", "(cumsum x :exclusive true :reverse true)",
         "(sort x)", "(get (top-k x :k 3) 0)", "(take-along x idx :axis -1)",
         "(conv img ker :padding \"same\")", "(conv seq ker1 :padding \"causal\" :groups 4)",
         "(max-pool img :window 2)", "(avg-pool img :window 3 :stride 1 :padding \"same\")"]


@pytest.mark.parametrize("expr", GRADS)
def test_gradients_match_finite_differences(expr):
  names = tuple(n for n in ("x", "m", "img", "ker", "seq", "ker1") if n in expr.split()
                or f" {n})" in expr or f" {n} " in expr)
  ints = {"idx": jnp.asarray(IDX)} if "idx" in expr else {}
  g = graph_of(expr, names + tuple(ints))

  def f(*floats):
    inputs = dict(zip(names, floats), **ints)
    return jnp.sum(jnp.sin(run_graph(g, {}, inputs, LowerCtx())["out"]))

  check_grads(f, tuple(jnp.asarray(VALUES[n], jnp.float32) for n in names), order=1,
              modes=("rev",), atol=3e-2, rtol=3e-2, eps=1e-3)


def test_stop_gradient_stops_the_gradient():
  g = graph_of("(* x (stop-gradient x))", ("x",))
  grad = jax.grad(lambda x: jnp.sum(run_graph(g, {}, {"x": x}, LowerCtx())["out"]))(
      jnp.asarray(X))
  np.testing.assert_allclose(np.asarray(grad), X, rtol=1e-6)


@pytest.mark.parametrize("expr,names,code,fragment", [
    ("(cumsum x :axis 3)", ("x",), "E-SHAPE-001", "axis 3 is out of range for rank 3"),
    ("(cumsum x :axes 1)", ("x",), "E-FORM-002", "cumsum has no keyword :axes"),
    ("(cumsum x :reverse 1)", ("x",), "E-TYPE-001", ":reverse is true or false"),
    ("(top-k x)", ("x",), "E-FORM-001", "top-k needs :k"),
    ("(top-k x :k 9)", ("x",), "E-SHAPE-001", "k 9 is outside 1..6"),
    ("(tril (sum x [0 1]))", ("x",), "E-SHAPE-001", "needs at least 2 axes"),
    ("(logical-and x p)", ("x", "p"), "E-TYPE-001", "boolean"),
    ("(take-along x (floor x))", ("x",), "E-TYPE-001", "integer"),
    ("(conv x m)", ("x", "m"), "E-SHAPE-001", "W has 2 axes"),
    ("(conv img ker :padding \"wide\")", ("img", "ker"), "E-SHAPE-001", "is not \"valid\""),
    ("(conv img ker :groups 2)", ("img", "ker"), "E-SHAPE-001", "groups 2 must divide"),
    ("(max-pool x :window 2 :stride [1 1])", ("x",), "E-SHAPE-001", "stride [1, 1]"),
    ("(pad m :widths [[1 0]])", ("m",), "E-SHAPE-001", "widths has 1 pairs for 2 axes"),
    ("(pad m :widths [1 0])", ("m",), "E-TYPE-001", ":widths is [[lo hi] ...]"),
    ("(bernoulli [2 3] :p 2.0)", (), "E-SHAPE-001", "p 2.0 is outside [0, 1]"),
    ("(random-int [2] :high 0)", (), "E-SHAPE-001", "low 0 must be below high 0"),
    ("(random-normal [2] :dtype i32)", (), "E-TYPE-001", "not a float dtype"),
    ("(random-normal x)", ("x",), "E-TYPE-001", ":shape is a vector of static sizes"),
    ("(cumsum 1.0)", (), "E-TYPE-001", "cumsum needs a tensor"),
    ("(sort x 1)", ("x",), "E-FORM-001", "sort takes 1 argument, given 2"),
])
def test_mistakes_are_placed_at_the_call(expr, names, code, fragment):
  with pytest.raises(SxError) as e:
    graph_of(expr, names)
  assert e.value.code == code, e.value.render()
  assert fragment in e.value.render(), e.value.render()
  assert e.value.location is not None and e.value.location.file == "ops.sx"
  assert e.value.fix


def _draws(expr: str, rng, training: bool = True):
  g = graph_of(expr, ())
  return np.asarray(run_graph(g, {}, {}, LowerCtx(rng=rng, training=training))["out"])


def test_random_draws_are_a_pure_function_of_the_key_and_differ_by_site():
  k = jax.random.key(3)
  a = _draws("(random-uniform [256])", k)
  np.testing.assert_array_equal(a, _draws("(random-uniform [256])", k))
  assert not np.array_equal(a, _draws("(random-uniform [256])", jax.random.key(4)))
  assert a.min() >= 0.0 and a.max() < 1.0
  # two calls in one graph draw apart
  two = _draws("(- (random-normal [64]) (random-normal [64]))", k)
  assert np.abs(two).max() > 0.1
  # a pass (no run key) draws the same each time
  np.testing.assert_array_equal(_draws("(bernoulli [128] :p 0.3)", None, False),
                                _draws("(bernoulli [128] :p 0.3)", None, False))


def test_random_ops_have_the_declared_distributions():
  k = jax.random.key(0)
  b = _draws("(bernoulli [20000] :p 0.15)", k)
  assert b.dtype == np.bool_ and abs(b.mean() - 0.15) < 0.01
  n = _draws("(random-normal [20000] :mean 2.0 :std 0.5)", k)
  assert abs(n.mean() - 2.0) < 0.02 and abs(n.std() - 0.5) < 0.02
  i = _draws("(random-int [20000] :low 3 :high 7)", k)
  assert i.dtype == np.int32 and set(np.unique(i)) == {3, 4, 5, 6}
  p = _draws("(random-permutation 50)", k)
  assert sorted(p.tolist()) == list(range(50)) and p.tolist() != list(range(50))


def _np_linear_recurrence(a, x, axis, reverse=False):
  a, x = np.moveaxis(a, axis, 0), np.moveaxis(x, axis, 0)
  h, out = np.zeros_like(x[0]), np.zeros_like(x)
  for t in (reversed(range(len(x))) if reverse else range(len(x))):
    h = a[t] * h + x[t]
    out[t] = h
  return np.moveaxis(out, 0, axis)


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_recurrence_equals_the_loop_it_stands_for(reverse):
  a = 1.0 / (1.0 + np.exp(-X))
  expr = f"(linear-recurrence (sigmoid x) m2 :axis 1 :reverse {'true' if reverse else 'false'})"
  VALUES["m2"] = X[::-1].copy()
  try:
    for jit in (False, True):
      got = value(expr, "x", "m2", jit=jit)
      np.testing.assert_allclose(got, _np_linear_recurrence(a, X[::-1], 1, reverse), rtol=2e-5,
                                 atol=2e-5)
    g = graph_of(expr, ("x", "m2"))
    check_grads(lambda x, m: jnp.sum(jnp.sin(run_graph(g, {}, {"x": x, "m2": m},
                                                       LowerCtx())["out"])),
                (jnp.asarray(X), jnp.asarray(VALUES["m2"])), order=1, modes=("rev",),
                atol=3e-2, rtol=3e-2, eps=1e-3)
  finally:
    del VALUES["m2"]


def test_linear_recurrence_refuses_operands_of_two_shapes():
  with pytest.raises(SxError) as e:
    graph_of("(linear-recurrence x m)", ("x", "m"))
  assert e.value.code == "E-SHAPE-001" and "must have one shape" in e.value.render()


@pytest.mark.parametrize("expr,want", [("(ceil (/ 10 4))", 3), ("(floor -2.5)", -3),
                                       ("(round 2.5)", 2), ("(mod -7 3)", 2), ("(sign -0.5)", -1),
                                       ("(clip 7 :max 5)", 5), ("(clip -1.5 :min 0)", 0)])
def test_static_numbers_fold_as_python_computes_them(expr, want):
  env = global_env({})
  b = Builder(env)
  assert b.eval(read_text(expr, "ops.sx")[0], env) == want


def test_a_static_fold_that_fails_is_placed():
  env = global_env({})
  with pytest.raises(SxError) as e:
    Builder(env).eval(read_text("(mod 7 0)", "ops.sx")[0], env)
  assert e.value.code == "E-TYPE-001" and e.value.location.line == 1


def test_random_calls_of_every_op_raise_only_placed_errors():
  """Calls a newcomer might write: every declared op, arguments and keywords drawn from
  tensors, numbers past int32, strings, vectors, dtypes and nil."""
  import random
  import warnings
  from sexpgpu.ir.ops import OPS
  vals = ["x", "m", "idx", "img", "p", "1", "-1", "0", "2.5", "true", "nil", '"same"', '"x"',
          "[1 2]", "[[1 0] [0 1]]", "[]", "[-1]", "f32", "i32", "99999999999", "(sum x)",
          "-9223372036854775808", "1e308", "[[1 2 3]]"]
  rnd = random.Random(0)
  names = sorted(n for n, op in OPS.items() if op.source is None)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(600):
      op = rnd.choice(names)
      args = [rnd.choice(vals) for _ in range(rnd.randint(0, 3))]
      kws = [w for a in OPS[op].attrs if rnd.random() < 0.5 for w in (f":{a.name}",
                                                                       rnd.choice(vals))]
      try:
        graph_of(f"({op} {' '.join(args)} {' '.join(kws)})", ("x", "m", "idx", "img", "p"))
      except SxError as e:
        assert e.location is not None and e.fix


@pytest.mark.parametrize("expr", ["(max-pool img :window 2)", "(avg-pool img :window 2)",
                                  "(conv img ker :padding \"same\")", "(cumprod x :axis 1)",
                                  "(get (top-k x :k 2) 0)", "(sort x)"])
def test_gradients_under_jit_equal_the_eager_ones(expr):
  names = tuple(n for n in ("x", "img", "ker") if f" {n}" in expr)
  g = graph_of(expr, names)

  def f(*xs):
    return jnp.sum(jnp.sin(run_graph(g, {}, dict(zip(names, xs)), LowerCtx())["out"]))

  xs = tuple(jnp.asarray(VALUES[n]) for n in names)
  eager = jax.grad(f, argnums=tuple(range(len(xs))))(*xs)
  jitted = jax.jit(jax.grad(f, argnums=tuple(range(len(xs)))))(*xs)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# --- cross-entropy over a mask with no true position ---------------------------------------

def test_cross_entropy_over_an_all_false_mask_is_nan_chunked_or_not():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from sexpgpu.ir.ops import OPS, LowerCtx
  from sexpgpu.lower.registry import lowering
  ctx = LowerCtx()
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 40, (2, 5)), jnp.int32)
  none = jnp.zeros((2, 5), bool)
  plain = OPS["cross-entropy"].lower(ctx, OPS["matmul"].lower(ctx, h, w), y, none)
  chunked = jax.jit(lambda h, w: lowering("chunked-cross-entropy", "cpu")(
      ctx, h, w, y, none, chunks=3))(h, w)
  assert np.isnan(float(plain)) and np.isnan(float(chunked))
  one = none.at[0, 0].set(True)  # one true position: its own loss, chunked as not
  a = OPS["cross-entropy"].lower(ctx, OPS["matmul"].lower(ctx, h, w), y, one)
  b = lowering("chunked-cross-entropy", "cpu")(ctx, h, w, y, one, chunks=3)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  assert np.isfinite(float(a))
