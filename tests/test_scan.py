"""`scan` and `associative-scan` over a user's function: values against JAX references
eagerly and under jit, gradients, the IR they make (verified, printed, rewritten), their
FLOPs against XLA's cost analysis, and their mistakes placed at the `.sx` call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sexpgpu.errors import SxError
from sexpgpu.ir import ops_scan
from sexpgpu.ir.ops import DTYPES, LowerCtx
from sexpgpu.ir.printer import print_graph
from sexpgpu.ir.rewrite import rewrite
from sexpgpu.ir.verify import verify
from sexpgpu.lower.flops import forward_flops, train_flops
from sexpgpu.lower.interp import run_graph
from test_ops import VALUES, graph_of, value

X, SEQ = VALUES["x"], VALUES["seq"]

# an RNN-like cell with a carry of two tensors and two outputs a position
CELL = ("(fn [[h c] x] (let [h2 (tanh (+ (* h 0.5) x)) c2 (+ c h2)]"
        " [[h2 c2] [h2 (* c2 2.0)]]))")
SCAN = f"(scan {CELL} [(sum x 1) (* (sum x 1) 0.0)] x :axis 1"


def _cell_reference(x, reverse=False):
  """(h, c, ys1, ys2) of CELL over axis 1 of x, by a Python loop."""
  h, c = x.sum(1), jnp.zeros_like(x.sum(1))
  ys1, ys2 = [None] * x.shape[1], [None] * x.shape[1]
  order = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
  for t in order:
    h = jnp.tanh(h * 0.5 + x[:, t])
    c = c + h
    ys1[t], ys2[t] = h, c * 2.0
  return h, c, jnp.stack(ys1, 1), jnp.stack(ys2, 1)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_equals_a_loop(jit, reverse):
  flag = " :reverse true" if reverse else ""
  ref = _cell_reference(jnp.asarray(X), reverse)
  for i, pick in enumerate(["(get c 0)", "(get c 1)", "(get ys 0)", "(get ys 1)"]):
    got = value(f"(let [[c ys] {SCAN}{flag})] {pick})", "x", jit=jit)
    np.testing.assert_allclose(got, np.asarray(ref[i]), rtol=1e-5, atol=1e-5)


def test_scan_of_one_tensor_along_a_negative_axis_with_a_vector_of_inputs():
  # carry [2 5], xs two tensors [2 5 6] scanned along their last axis; y one tensor [2 5]
  expr = ("(let [[h ys] (scan (fn [h [a b]] (let [n (+ (* h b) a)] [n (* n n)]))"
          " (sum x -1) [x (sigmoid x)] :axis -1)] ys)")
  got = value(expr, "x", jit=True)
  h, ys = X.sum(-1), []
  for t in range(X.shape[-1]):
    h = h * (1 / (1 + np.exp(-X[..., t]))) + X[..., t]
    ys.append(h * h)
  np.testing.assert_allclose(got, np.stack(ys, -1), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_associative_scan_equals_the_linear_recurrence_and_a_running_max(jit):
  pair = ("(let [a (sigmoid x) [_ h] (associative-scan (fn [[a1 x1] [a2 x2]]"
          " [(* a1 a2) (+ (* a2 x1) x2)]) [a x] :axis 1)] h)")
  want = value("(linear-recurrence (sigmoid x) x :axis 1)", "x")
  np.testing.assert_allclose(value(pair, "x", jit=jit), want, rtol=1e-5, atol=1e-6)
  got = value("(associative-scan max seq :axis 1 :reverse true)", "seq", jit=jit)
  np.testing.assert_array_equal(got, np.maximum.accumulate(SEQ[:, ::-1], 1)[:, ::-1])


def test_gradients_equal_jax_references():
  def ours(expr, name):
    g = graph_of(expr, (name,))
    return jax.grad(lambda v: run_graph(g, {}, {name: v}, LowerCtx())["out"])(
        jnp.asarray(VALUES[name]))

  got = ours(f"(let [[c ys] {SCAN})] (+ (sum (get ys 1)) (sum (get c 0))))", "x")
  ref = jax.grad(lambda x: (lambda r: r[3].sum() + r[0].sum())(_cell_reference(x)))(
      jnp.asarray(X))
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
  # F here is not associative, so compare with lax.associative_scan itself, as the rule is
  got = ours("(sum (* (associative-scan (fn [a b] (+ (* a 0.9) b)) x :axis 1) x))", "x")
  ref = jax.grad(lambda x: (jax.lax.associative_scan(lambda a, b: a * 0.9 + b, x, axis=1)
                            * x).sum())(jnp.asarray(X))
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_the_ir_is_verified_printed_and_rewritten():
  g = graph_of(f"(let [[c ys] {SCAN})] (+ (sum (get ys 1)) (sum (get c 0))))", ("x",))
  verify(g)
  text = print_graph(g, with_locs=False)
  assert "(f32[2,6] f32[2,6] f32[2,5,6] f32[2,5,6]) = scan[axis=1, carries=2, operands=3," \
         " reverse=false]" in text
  assert text.count("= part[index=") == 2  # the two values read, of four
  assert "    } -> " in text
  new, _ = rewrite(g)
  verify(new)
  assert print_graph(new, with_locs=False) == text


def test_a_function_reading_outside_values_and_parameters_is_shared_over_positions():
  # the closure reads `w`, built outside; its inputs list it after the scan's operands
  g = graph_of("(let [w (sum x 1) [h ys] (scan (fn [h x] (let [n (* (+ h x) w)] [n n]))"
               " (sum x 1) x :axis 1)] ys)", ("x",))
  scan = next(n for n in g.nodes() if n.op == "scan")
  assert scan.attr("operands") == 2 and len(scan.inputs) == 3
  w = X.sum(1)
  h, ys = X.sum(1), []
  for t in range(5):
    h = (h + X[:, t]) * w
    ys.append(h)
  np.testing.assert_allclose(value("(let [w (sum x 1) [h ys] (scan (fn [h x] (let [n (* (+ h x)"
                                   " w)] [n n])) (sum x 1) x :axis 1)] ys)", "x"),
                             np.stack(ys, 1), rtol=1e-5)


@pytest.mark.parametrize("expr,code,at,words", [
    ("(scan (fn [h] [h h]) (sum x 1) x :axis 1)", "E-FORM-001", "(fn [h]", "takes 2 arguments"),
    ("(scan (fn [h x] [(sum h 0) x]) (sum x 1) x :axis 1)", "E-SHAPE-001", "(fn [h x]",
     "INIT's type f32[2,6]; it returned f32[6]"),
    ("(scan (fn [h x] [h x]) (sum x 1) x :axis 3)", "E-SHAPE-001", "3)",
     "axis 3 is out of range for XS of rank 3"),
    ("(scan (fn [h x] [h x]) 1.0 x :axis 1)", "E-TYPE-001", "1.0", "INIT is a tensor"),
    ("(scan (fn [h x] h) (sum x 1) x :axis 1)", "E-TYPE-001", "(fn [h x]", "[carry y]"),
    ("(scan 3 (sum x 1) x)", "E-TYPE-001", "3 (sum", "F must be a function"),
    ("(scan (fn [h x] [h x]) (sum x 1) x :axes 1)", "E-FORM-002", ":axes", "no keyword :axes"),
    ("(scan (fn [h x] [h x]) (sum x 1))", "E-FORM-001", "(scan", "takes 3 arguments"),
    ("(scan (fn [h x] [h x]) (sum x 1) [x (sum x 1)] :axis 1)", "E-SHAPE-001", "[x (sum",
     "axis 1 of length 5"),
    ("(associative-scan (fn [a b] (sum a 0)) x :axis 1)", "E-SHAPE-001", "(fn [a b]",
     "one element of type f32[2,6]"),
    ("(associative-scan (fn [a b] (+ a (random-normal [2 6]))) x :axis 1)", "E-FORM-001",
     "(random-normal", "not associative"),
    ("(associative-scan (fn [a] a) x)", "E-FORM-001", "(fn [a]", "takes 2 arguments"),
])
def test_mistakes_are_placed_at_the_call(expr, code, at, words):
  with pytest.raises(SxError) as e:
    graph_of(expr, ("x",))
  text = "(fn [batch] (let [x (get batch :x)] " + expr
  assert e.value.code == code, e.value.render()
  loc = e.value.location
  assert (loc.file, loc.line, loc.col) == ("ops.sx", 1, text.index(at) + 1), e.value.render()
  assert words in e.value.render() and e.value.fix


@pytest.fixture()
def unrolled(monkeypatch):
  """XLA's cost analysis counts a loop's body once: unroll each scan's loop whole."""
  monkeypatch.setattr(ops_scan, "UNROLL", True)


@pytest.mark.parametrize("expr", [
    f"(let [[c ys] {SCAN})] (+ (sum (get ys 1)) (sum (matmul (get c 0) (transpose m [1 0])))))",
    "(let [mm (matmul (transpose m [1 0]) m) [_ h] (associative-scan (fn [[a1 x1] [a2 x2]]"
    " [(* a1 a2) (+ (* a2 x1) (matmul x2 mm))]) [(sigmoid x) x] :axis 1)] (sum h))",
])
def test_flops_are_within_10_percent_of_xla(expr, unrolled):
  g = graph_of(expr, ("x", "m"))
  inputs = {n: jax.ShapeDtypeStruct(v.shape, DTYPES[v.dtype]) for n, v in
            (("x", g.inputs["x"]), ("m", g.inputs["m"]))}
  f = lambda i: run_graph(g, {}, i, LowerCtx())["out"]  # noqa: E731
  cost = jax.jit(f).lower(inputs).cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  assert 0.9 <= forward_flops(g) / xla <= 1.1, (forward_flops(g), xla)
  # no parameters: nothing needs a gradient, so a step is its forward
  assert train_flops(g, 1) == forward_flops(g)


def test_a_scan_counts_its_body_times_its_length():
  body = "(fn [h x] [(matmul (matmul h (transpose m [1 0])) m) h])"
  five, one = (graph_of(f"(let [[h ys] (scan {body} (sum x 1) {xs} :axis 1)] h)", ("x", "m"))
               for xs in ("x", "(slice x 1 0 1)"))
  # two products a trip, [2 6]·[6 4] and [2 4]·[4 6]: 2·2·6·4 flops each
  assert forward_flops(five) - forward_flops(one) == 4 * 2 * (2 * 2 * 6 * 4)
