"""The language front half: parameter counts, golden IR, selection and slugs,
knob sources, robustness to random input, build and lowering work that does not grow with depth."""

import math
import os
import random
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.errors import SxError
from sexpgpu.ir.printer import print_graph
from sexpgpu.lang.program import load_program
from sexpgpu.lang.select import make_slug, select
from sexpgpu.run.compile import compile_file, compile_source

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
GOLDEN = os.path.join(ROOT, "tests", "golden")
with open(TINY, encoding="utf-8") as _f:
  TINY_TEXT = _f.read()


def tiny(**kw):
  return compile_source(TINY_TEXT, "tiny-lm.sx", base_dir=os.path.dirname(TINY), **kw)


# ---- parameter count ---------------------------------------------------------

def hand_count(V, D, L, T):
  per_layer = 2 * D + 4 * D * D + D * 4 * D + 4 * D * D
  return V * D + T * D + L * per_layer + D + D * V


@pytest.mark.parametrize("sets,V,D,L,T", [
    ([], 32, 64, 2, 16),
    ([("layers", "3"), ("width", "32"), ("vocab", "20"), ("seq", "8")], 20, 32, 3, 8),
])
def test_transformer_lm_parameter_count(sets, V, D, L, T):
  c = tiny(sets=sets)
  total = sum(math.prod(p.full_shape) for p in c.params.values())
  assert total == hand_count(V, D, L, T)
  if not sets:
    assert total == 103_744
  shapes = {path: tuple(p.full_shape) for path, p in c.params.items()}
  assert shapes["lm/transformer-lm/embed"] == (V, D)
  assert shapes["lm/transformer-lm/pos"] == (T, D)
  assert shapes["lm/transformer-lm/repeat/block/attention/q/w"] == (L, D, D)
  assert shapes["lm/transformer-lm/repeat/block/mlp/up/w"] == (L, D, 4 * D)
  assert shapes["lm/transformer-lm/unembed"] == (D, V)


# ---- golden IR ---------------------------------------------------------------

GOLDEN_SRC = """(require std/nn)
(require std/lm)
(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 1))
(defn loss [batch]
  (let [x (take (param emb [8 16] :init (normal 0.02)) (get batch :tokens))]
    (mean (%s x :heads 2))))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01))
"""


@pytest.mark.parametrize("fn", ["attention", "block"])
def test_golden_ir(fn, monkeypatch):
  monkeypatch.setenv("SEXPGPU_PATTERNS", "off")  # the language's own IR, before any rewrite
  c = compile_source(GOLDEN_SRC % fn, f"golden-{fn}.sx")
  text = print_graph(c.stages[0].graph) + "\n"
  with open(os.path.join(GOLDEN, f"{fn}.ir"), encoding="utf-8") as f:
    assert text == f.read()


# ---- selection and slugs -----------------------------------------------------

def test_slug_variant_and_set():
  c = tiny(variant="smoke", sets=[("lr", "0.003")])
  assert c.slug == "tiny-lm-smoke-lr=0.003"


def test_slug_value_written_as_parsed():
  assert tiny(sets=[("lr", "3e-3")]).slug == "tiny-lm-lr=0.003"
  assert tiny(sets=[("lr", "1")]).slug == "tiny-lm-lr=1.0"
  assert tiny(sets=[("layers", "1_0")]).slug == "tiny-lm-layers=10"


def test_slug_last_set_wins_and_knob_order():
  c = tiny(sets=[("width", "32"), ("lr", "0.1"), ("heads", "2"), ("lr", "0.02")])
  assert c.slug == "tiny-lm-heads=2-lr=0.02-width=32"
  assert c.selection.value("lr") == 0.02


def test_slug_steps_override_stays_out():
  c = tiny(overrides={"steps": 7})
  assert c.slug == "tiny-lm"
  assert c.selection.knobs["steps"].value == 7


def test_slug_odd_characters():
  assert make_slug("my run", "v/1", [("name", "a b:c")]) == "my_run-v_1-name=a_b_c"
  assert make_slug("x", None, [("flag", True)]) == "x-flag=true"
  src = TINY_TEXT.replace('(defknob lr 0.01 "peak learning rate")',
                          '(defknob lr 0.01 "peak learning rate")\n(defknob tag "a")')
  c = compile_source(src, "odd name!.sx", base_dir=os.path.dirname(TINY),
                     sets=[("tag", "x/y z")])
  assert c.slug == "odd_name_-tag=x_y_z"


def test_slug_env_stem(monkeypatch):
  monkeypatch.setenv("SEXPGPU_RUN_SLUG", "my run")
  assert tiny(variant="smoke").slug == "my_run-smoke"


def test_knob_sources():
  c = tiny(variant="smoke", sets=[("lr", "0.02")], overrides={"steps": 5})
  k = c.selection.knobs
  assert (k["vocab"].value, k["vocab"].source) == (32, "file")
  assert (k["width"].value, k["width"].source) == (32, "variant")
  assert (k["layers"].value, k["layers"].source) == (1, "variant")
  assert (k["lr"].value, k["lr"].source) == (0.02, "set")
  assert (k["steps"].value, k["steps"].source) == (5, "override")
  # defrun literals are the run knobs' file defaults
  assert (k["seed"].value, k["seed"].source) == (1, "file")
  assert (k["microbatches"].value, k["microbatches"].source) == (2, "file")
  assert k["keep"].value == 3 and k["checkpoint-every"].value == 0


def test_set_beats_variant():
  c = tiny(variant="smoke", sets=[("width", "48")])
  assert c.selection.knobs["width"].value == 48
  assert c.selection.knobs["width"].source == "set"


def test_set_parses_by_type():
  prog = load_program(TINY)
  assert select(prog, sets=[("lr", "1")]).value("lr") == 1.0
  assert isinstance(select(prog, sets=[("lr", "1")]).value("lr"), float)
  for name, text in [("layers", "2.5"), ("lr", "abc"), ("layers", "x")]:
    with pytest.raises(SxError) as info:
      select(prog, sets=[(name, text)])
    assert info.value.code == "E-KNOB-002"
    assert info.value.location is None and name in info.value.where
  with pytest.raises(SxError) as info:
    select(prog, sets=[("precision", "f64")])
  assert info.value.code == "E-KNOB-003"
  with pytest.raises(SxError) as info:
    select(prog, sets=[("widht", "3")])
  assert info.value.code == "E-KNOB-001" and "`width`" in info.value.fix


# ---- robustness --------------------------------------------------------------

TOKENS = re.findall(r'"[^"]*"|[()\[\]]|[^\s()\[\]]+', TINY_TEXT)
ALPHABET = "()[]{}\"\\;#:, \n\t.-+*/0123456789abcdefxyz_e"


def _mutate(rnd, text, n):
  for _ in range(n):
    op = rnd.randrange(6)
    if op < 3:  # character edits
      i = rnd.randrange(len(text) + 1)
      if op == 0 and text:
        text = text[:i] + text[i + 1:]
      elif op == 1:
        text = text[:i] + rnd.choice(ALPHABET) + text[i:]
      else:
        j = min(len(text), i + rnd.randrange(1, 12))
        text = text[:j] + text[i:j] + text[j:]
    else:  # token edits
      toks = re.findall(r'"[^"]*"|[()\[\]]|[^\s()\[\]]+|\s+', text)
      if not toks:
        continue
      i = rnd.randrange(len(toks))
      if op == 3:
        del toks[i]
      elif op == 4:
        if toks[i].strip() and toks[i] not in "()[]" and rnd.random() < 0.5:
          toks[i] = rnd.choice(TOKENS)  # replace a token
        else:
          toks.insert(i, rnd.choice(TOKENS) + " ")
      else:
        toks.insert(i, toks[i])
      text = "".join(toks)
  return text


def _compile_expect_sx(text):
  try:
    compile_source(text, "fuzz.sx", base_dir=os.path.dirname(TINY))
  except SxError as e:
    e.render()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(list(ALPHABET) + ["defn ", "let ", "defrun ", ":loss ", "(+ 1 2)",
                                                 "[a b]", "(require std/nn)", "\\q"]),
                max_size=40).map("".join))
def test_random_text_raises_only_sxerror(text):
  _compile_expect_sx(text)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_mutated_config_raises_only_sxerror(seed, n):
  _compile_expect_sx(_mutate(random.Random(seed), TINY_TEXT, n))


# ---- compile work does not grow with depth -----------------------------------

def _build_sizes(layers):
  """The built graph's node count and the loss's jaxpr's equation count (JAX's trace, all
  nested jaxprs included): what reading, building and lowering work through."""
  import jax
  from sexpgpu.ir.ops import LowerCtx
  from sexpgpu.lower.interp import run_graph
  c = tiny(sets=[("layers", str(layers))])
  g = c.stages[0].graph
  params = {p.path: jax.ShapeDtypeStruct(p.full_shape, "float32") for p in g.params.values()}
  inputs = {f: jax.ShapeDtypeStruct(n.shape, "int32") for f, n in g.inputs.items()}
  closed = jax.make_jaxpr(lambda p, x: run_graph(g, p, x, LowerCtx())["out"])(params, inputs)

  def eqns(jaxpr):
    subs = [getattr(v, "jaxpr", v) for e in jaxpr.eqns for v in e.params.values()
            if hasattr(getattr(v, "jaxpr", v), "eqns")]
    return len(jaxpr.eqns) + sum(map(eqns, subs))
  return len(list(g.nodes())), eqns(closed.jaxpr)


def test_depth_does_not_grow_build_and_lowering_work():
  """A repeat is one block in the graph at any depth, and one scan in the trace past the
  depth that is unrolled: counted, not timed (a time ratio of two short builds is noise on a
  loaded machine)."""
  from sexpgpu.lower.interp import UNROLL_MAX
  short, deep, deeper = (_build_sizes(n) for n in (2, 4 * UNROLL_MAX, 12 * UNROLL_MAX))
  assert short[0] == deep[0] == deeper[0]
  assert deep[1] == deeper[1]


# ---- CLI and backends ----------------------------------------------------------

@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_cli_check_prints_params_total(capsys):
  from sexpgpu.cli.main import main
  code = main(["check", TINY, "--print", "params"])
  out, err = capsys.readouterr()
  assert code == 0, err
  rows = [l for l in out.splitlines() if l.startswith("total")]
  assert len(rows) == 1 and rows[0].split()[-1] == "103,744", out


def test_building_starts_no_jax_backend():
  code = (
      "import os, sys\n"
      "from sexpgpu.run.compile import compile_file\n"
      f"c = compile_file({TINY!r})\n"
      "assert c.stages[0].graph.params\n"
      "import jax._src.xla_bridge as xb\n"
      "assert xb._backends == {}, xb._backends\n"
      "print('no-backend')\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     timeout=300)
  assert r.returncode == 0, r.stderr
  assert "no-backend" in r.stdout


@pytest.mark.parametrize("config", ["tiny-lm", "char-lm", "classifier", "gpt2-small"])
def test_verifier_accepts_every_example_graph(config):
  from sexpgpu.ir.verify import verify
  from sexpgpu.run.compile import compile_file
  c = compile_file(os.path.join(ROOT, "configs", f"{config}.sx"), variant="smoke")
  for stage in c.stages:
    verify(stage.graph)
  for graphs in c.passes.values():
    for g in graphs.values():
      verify(g)


def test_verifier_rejects_a_node_whose_type_lies():
  import dataclasses as dc
  from sexpgpu.ir.verify import IRError, verify
  from sexpgpu.run.compile import compile_file
  c = compile_file(os.path.join(ROOT, "configs", "tiny-lm.sx"), variant="smoke")
  g = c.stages[0].graph
  out = g.outputs["out"]
  bad = dc.replace(out.inputs[0], shape=(1, 2, 3))
  broken = dc.replace(g, outputs={"out": dc.replace(out, inputs=(bad,) + out.inputs[1:])})
  with pytest.raises(IRError):
    verify(broken)


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_check_plans_for_the_devices_of_sexpgpu_devices():
  env = dict(os.environ, SEXPGPU_DEVICES="0,1")
  r = subprocess.run(sexpgpu_cmd("check", TINY, "--variant", "smoke", "--set", "microbatches=4",
                                 "--print", "plan"), capture_output=True, text=True, cwd=ROOT,
                     env=env, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "on cpu x2" in r.stdout  # each rank's share of 4 microbatches: degrees 2 and 1
  assert "degree 2" in r.stdout and "degree 1" in r.stdout and "degree 4" not in r.stdout
  r = subprocess.run(sexpgpu_cmd("check", TINY, "--variant", "smoke", "--set", "microbatches=3",
                                 "--print", "plan"), capture_output=True, text=True, cwd=ROOT,
                     env=env, timeout=300)
  assert r.returncode == 1 and r.stderr.startswith("error[E-DP-003]"), r.stderr


@pytest.mark.parametrize("what,needle", [("jaxpr", "lambda"), ("hlo", "func.func public @main"),
                                         ("plan", "stacking")])
def test_check_prints_lowered_forms_without_training(what, needle, capsys):
  from sexpgpu.cli.main import main
  code = main(["check", TINY, "--variant", "smoke", "--print", what])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert needle in out and "step 0/" not in err  # no run started
  if what == "plan":
    assert re.search(r"memory\s+\S+ \S+B of \S+ \S+B free", out)
    assert "degree 2" in out and "degree 1" in out and "flops" in out
