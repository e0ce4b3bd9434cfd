"""`:sharding auto` (run/planning/layout_plan.py): on 4 host devices the plan chooses a layout that
fits, names its runners-up and why the rest were dropped, and choices.json remembers it; a
mesh that does not divide a size is E-KNOB-003 naming the axis, the size and the sizes that
would; the paper plan of Llama-3-8B on 8 H100s prints its layout, memory, collectives, MFU."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, sexpgpu_cmd

LLAMA8 = os.path.join(ROOT, "configs", "llama3-8b.sx")
TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")

# One process with 4 host devices: auto resolved twice (the second from choices.json), and
# once under a memory limit that only split layouts meet.
_AUTO = """
import json, os
from sexpgpu.run.compile import compile_file
from sexpgpu.run.backend import open_devices
from sexpgpu.run.planning.layout_choice import resolve
from sexpgpu.run.training import build
place = open_devices("cpu", [0, 1, 2, 3])
out = {{}}
for name in ("first", "again"):
  c = compile_file({path!r}, "smoke", [("sharding", "auto"), ("microbatches", "4")])
  ch = resolve(c, place, {cache!r})
  build(c, place)  # the chosen layout builds
  out[name] = {{"sharding": str(c.exp.run["sharding"]), "how": ch.how, "lines": ch.lines(),
               "fits": [x.text for x in ch.candidates if not x.dropped],
               "timed": {{x.text: x.measured for x in ch.candidates if x.measured}},
               "planned": ch.chosen.planned}}
os.environ["SEXPGPU_MEMORY"] = "2400KiB"
c = compile_file({path!r}, "smoke", [("sharding", "auto"), ("microbatches", "4")])
try:
  ch = resolve(c, place, {cache!r} + "/tight")
  out["tight"] = {{"sharding": str(c.exp.run["sharding"]), "lines": ch.lines()}}
except Exception as e:
  out["tight"] = {{"error": str(e)}}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("cache"))
  env = dict(os.environ, SEXPGPU_DEVICES="0,1,2,3",
             XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             + os.environ.get("XLA_FLAGS", ""))
  env.pop("SEXPGPU_MEMORY", None)
  p = subprocess.run([sys.executable, "-c", _AUTO.format(path=LLAMA8, cache=cache)],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))
  return json.loads(line[len("RESULT"):]), cache


@pytest.mark.slow  # reads auto's runs over 4 host devices
def test_auto_picks_a_layout_that_fits_and_says_why(auto):
  out, _ = auto
  first = out["first"]
  assert first["sharding"] in first["fits"]
  assert first["planned"] and first["planned"] > 0  # the compiled memory plan confirmed it
  text = "\n".join(first["lines"])
  assert f"layout      {first['sharding']}:" in text
  assert "runner-up" in text and "a device (plan)" in text and "model" in text
  # the smoke model's 2 key/value heads refuse tensor:4, and the line says so
  assert "dropped   tensor:4 — tensor:4 does not divide the 2 heads" in text
  # host devices: every layout that fits was timed, and the fastest was chosen
  assert first["how"] == "timed" and "each timed at the first steps" in text
  assert len(first["timed"]) == min(6, len(first["fits"])) and set(first["timed"]) <= set(first["fits"])
  assert first["timed"][first["sharding"]] == min(first["timed"].values())
  assert text.count(", measured ") == min(4, len(first["timed"]))


@pytest.mark.slow  # reads auto's runs over 4 host devices
def test_choices_json_remembers_the_layout(auto):
  out, cache = auto
  assert out["again"]["sharding"] == out["first"]["sharding"]
  assert out["again"]["how"] == "remembered"
  data = json.load(open(os.path.join(cache, "choices.json")))
  entries = [v for k, v in data.items() if k.endswith("|layout")]
  assert [e["layout"] for e in entries] == [out["first"]["sharding"]]


@pytest.mark.slow  # reads auto's runs over 4 host devices
def test_a_run_with_auto_trains_on_the_remembered_layout(auto):
  """`--set sharding=auto` from the command line: the run's layout is the one choices.json
  remembers for this graph and these devices, and it trains."""
  out, cache = auto
  env = dict(os.environ, SEXPGPU_DEVICES="0,1,2,3", SEXPGPU_CACHE_DIR=cache,
             XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             + os.environ.get("XLA_FLAGS", ""))
  env.pop("SEXPGPU_MEMORY", None)
  p = subprocess.run(sexpgpu_cmd("run", LLAMA8, "--variant", "smoke",
                                 "--set", "sharding=auto", "--set", "microbatches=4", "--steps", "2"),
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  chosen = out["first"]["sharding"]
  head = next(x for x in p.stderr.splitlines() if x.startswith("  layout      "))
  assert head.startswith(f"  layout      {chosen}:") and "remembered" in head, p.stderr
  assert " ranks 4 " in p.stderr and "done: 2 steps" in p.stderr


@pytest.mark.slow  # reads auto's runs over 4 host devices
def test_a_memory_limit_drops_the_layouts_that_do_not_fit(auto):
  out, _ = auto
  tight = out["tight"]
  assert "error" not in tight, tight
  assert tight["sharding"] != "replicate"
  assert any(line.strip().startswith("dropped   replicate — does not fit")
             for line in tight["lines"]), tight["lines"]


def test_a_mesh_that_does_not_divide_names_axis_size_and_sizes():
  from sexpgpu.errors import SxError
  from sexpgpu.lower.layouts import param_specs
  from sexpgpu.run.compile import compile_file
  c = compile_file(TINY, "smoke", [])
  with pytest.raises(SxError) as e:
    param_specs(c.stages[0].graph, c.params, (("tensor", 3),))
  err = e.value
  assert err.code == "E-KNOB-003"
  assert "tensor:3 does not divide" in err.message
  assert "tensor sizes that divide" in err.fix


def test_auto_is_accepted_by_the_knob_and_refused_unresolved():
  from sexpgpu.errors import SxError
  from sexpgpu.lang.mesh import check_devices, is_mesh, parse_mesh
  assert is_mesh("auto") and parse_mesh("auto") == ()
  with pytest.raises(SxError) as e:
    check_devices("auto", 4)
  assert e.value.code == "E-KNOB-003" and "sharding=auto" in str(e.value.where)


def test_meshes_cover_every_factorization():
  from sexpgpu.run.planning.layout_plan import meshes
  got = {tuple(s for _, s in m) for m in meshes(8, False)}
  assert len(got) == 10 and (8, 1, 1, 1) in got and (1, 1, 1, 8) in got
  assert all(a * b * c * d == 8 for a, b, c, d in got)


def test_paper_plan_for_llama3_8b_on_8_h100s():
  from sexpgpu.run.check import CheckOptions, check
  text = check(LLAMA8, None, [("sharding", "auto")],
               opts=CheckOptions(target="cuda", gpu="H100", devices=8))
  assert text.startswith("plan on paper: llama3-8b")
  assert "8 × H100" in text and "layout      " in text and "runner-up" in text
  assert "dropped   replicate — does not fit" in text  # 8B with Adam is past 80 GiB whole
  assert "  memory      " in text and "GiB a device of 80.0 GiB" in text
  assert "  collectives" in text and "all-" in text
  assert "MFU" in text and "tokens/s a GPU" in text


def test_paper_flags_need_a_target():
  from sexpgpu.errors import SxError
  from sexpgpu.run.check import CheckOptions, check
  with pytest.raises(SxError) as e:
    check(TINY, "smoke", [], opts=CheckOptions(devices=8))
  assert e.value.code == "E-FORM-001"
  with pytest.raises(SxError) as e:
    check(TINY, "smoke", [], opts=CheckOptions(target="cuda", devices=8, nodes=3))
  assert e.value.code == "E-FORM-001"
