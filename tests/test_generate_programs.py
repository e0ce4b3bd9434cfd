"""Trained functions reachable from any program: a function the loss calls keeps its
parameters when another program (a pass metric, `Experiment.call`) reaches it through callers
of its own; a function the loss calls at two places with different parameters, or stacks in a
repeat, is ambiguous (E-PARAM-001); a parameter no training program creates is E-RUN-002,
naming who asked for it and why training would miss it."""

import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError

HEAD = """(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 7))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
(defn embed [t] (take (param table [8 4] :init (normal 1.0)) t))
"""

# a denoiser trained by the loss and a sampling loop that reaches it through its own step,
# the way a DDIM sampler calls a trained U-Net
DENOISE = HEAD + """
(defn unet [x] (tanh (matmul x (param w [4 4] :init (normal 1.0)))))
(defn loss [batch] (mean (* (unet (embed (get batch :tokens))) 1.0)))
(defn ddim-step [x] (+ (* 0.5 x) (unet x)))
(defn generate [x] (ddim-step (ddim-step x)))
(defn gen-metric [batch] (mean (generate (embed (get batch :tokens)))))
(defpass eval :data train :every 1 :metrics [gen-metric])
"""


@pytest.fixture(scope="module")
def denoiser():
  exp = sexpgpu.compile_text(DENOISE, "denoise.sx")
  return exp, {k: np.asarray(v) for k, v in exp.init(seed=1).params.items()}


def test_a_sampling_loop_reaches_the_trained_function(denoiser):
  exp, params = denoiser
  assert sorted(params) == ["embed/table", "unet/w"]  # the pass metric made none of its own
  x = np.random.RandomState(0).randn(2, 4).astype(np.float32)
  w = params["unet/w"]
  step = lambda v: 0.5 * v + np.tanh(v @ w)  # noqa: E731 (the loop in plain numpy)
  got = np.asarray(exp.call("generate", params, x))
  np.testing.assert_allclose(got, step(step(x)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(exp.call("unet", params, x)), np.tanh(x @ w),
                             rtol=1e-5, atol=1e-6)


def _error(text: str) -> SxError:
  with pytest.raises(SxError) as e:
    sexpgpu.compile_text(HEAD + text, "prog.sx")
  return e.value


TWICE = """
(defn block [x] (tanh (matmul x (param w [4 4] :init (normal 1.0)))))
(defn loss [batch] (let [h (embed (get batch :tokens))] (mean (+ (block h) (block h)))))
(defn helper [x] (block x))
(defn m [batch] (mean (helper (embed (get batch :tokens)))))
(defpass eval :data train :every 1 :metrics [m])
"""


def test_a_function_the_loss_calls_at_two_places_is_ambiguous():
  e = _error(TWICE)
  assert e.code == "E-PARAM-001", e
  assert ("a pass metric `eval/m` calls `block`, which the loss calls at 2 places with "
          "different parameters (block (prog.sx:") in e.message
  assert "; block.1 (prog.sx:" in e.message and "ambiguous" in e.message
  assert e.location is not None and e.location.line == 7  # the helper's call of block
  assert "name each of the loss's calls of `block` with :as" in e.fix


NAMED = """
(defn block [x] (tanh (matmul x (param w [4 4] :init (normal 1.0)))))
(defn loss [batch]
  (let [h (embed (get batch :tokens))] (mean (+ (block h :as enc) (block h :as dec)))))
(defn helper [x] (block x :as dec))
(defn other [x] (block x))
(defn m [batch] (mean (helper (embed (get batch :tokens)))))
"""


def test_an_as_name_picks_one_of_the_loss_calls():
  exp = sexpgpu.compile_text(HEAD + NAMED + "(defpass eval :data train :every 1 "
                             ":metrics [m])\n", "named.sx")
  params = {k: np.asarray(v) for k, v in exp.init(seed=2).params.items()}
  assert sorted(params) == ["dec/w", "embed/table", "enc/w"]
  x = np.random.RandomState(1).randn(2, 4).astype(np.float32)
  np.testing.assert_allclose(np.asarray(exp.call("helper", params, x)),
                             np.tanh(x @ params["dec/w"]), rtol=1e-5, atol=1e-6)
  with pytest.raises(SxError) as e:  # without a name: which of enc and dec?
    exp.call("other", params, x)
  assert e.value.code == "E-PARAM-001" and "`other`" not in e.value.fix
  assert "(block ... :as dec) (the loss's names: dec, enc)" in e.value.fix


def test_a_function_the_loss_stacks_in_a_repeat_is_ambiguous():
  e = _error("""
(defn block [x] (tanh (matmul x (param w [4 4] :init (normal 1.0)))))
(defn loss [batch] (mean (repeat 3 block (embed (get batch :tokens)))))
(defn m [batch] (mean (block (embed (get batch :tokens)))))
(defpass eval :data train :every 1 :metrics [m])
""")
  assert e.code == "E-PARAM-001" and "stacks in a repeat of 3 (repeat/block" in e.message
  assert "call the function that repeats `block`" in e.fix


def test_a_parameter_no_training_program_creates_names_who_asked_and_why():
  e = _error("""
(defn loss [batch] (mean (embed (get batch :tokens))))
(defn extra [x] (* x (param s [4] :init ones)))
(defn step [x] (extra x))
(defn m [batch] (mean (step (embed (get batch :tokens)))))
(defpass eval :data train :every 1 :metrics [m])
""")
  assert e.code == "E-RUN-002" and e.location.line == 6  # the param form in extra
  assert ("parameter step/extra/s is created only by a pass metric `eval/m` (through m › step "
          "› extra), never by the loss, so training would never update it: the loss never "
          "calls `extra`") in e.message
  assert "call `extra` from the loss" in e.fix


def test_an_as_name_the_loss_never_uses_makes_untrained_parameters(denoiser):
  exp = sexpgpu.compile_text(HEAD + NAMED + "(defn third [x] (block x :as mid))\n"
                             "(defpass eval :data train :every 1 :metrics [m])\n", "n.sx")
  params = {k: np.asarray(v) for k, v in exp.init(seed=2).params.items()}
  with pytest.raises(SxError) as e:
    exp.call("third", params, np.zeros((2, 4), np.float32))
  assert e.value.code == "E-RUN-002" and "third › block:mid" in e.value.message
  assert "the loss calls `block` but never :as mid (its :as names: enc, dec)" in e.value.message


# --- defgenerate and `sexpgpu generate` ------------------------------------------------------

IMAGES = """(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 7))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
(defn unet [x] (tanh (matmul x (param w [3 3] :init (normal 1.0)))))
(defn loss [batch]
  (mean (unet (take (param table [8 3] :init (normal 1.0)) (get batch :tokens)))))
(defn ddim-step [x] (+ (* 0.5 x) (unet x)))
(defn sample-images []
  (let [[x _] (scan (fn [x t] (let [n (ddim-step x)] [n t])) (random-normal [2 4 4 3])
                    (zeros [3 1]) :axis 0)]
    x))
(defgenerate images :fn sample-images :every 10 :seed 5)
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  tmp = tmp_path_factory.mktemp("gen")
  path = str(tmp / "images.sx")
  with open(path, "w") as f:
    f.write(IMAGES)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(4, c.params).items()}
  return tmp, path, c, params, write_step0(c, params, str(tmp / "ck"))


def test_generate_writes_the_samples_of_a_plain_loop_and_a_png_grid(images, capsys):
  import jax
  from PIL import Image
  from sexpgpu.cli.main import main
  from sexpgpu.models import generate
  tmp, path, c, params, step_dir = images
  out = str(tmp / "out" / "samples.npz")
  assert main(["generate", path, "--resume", step_dir, "-o", out]) == 0
  err = capsys.readouterr().err
  assert "generate: (sample-images) at step 0, seed 5: out [2, 4, 4, 3]; " in err, err
  got = np.load(out)["out"]
  # the same loop in numpy over the checkpoint's parameters, the noise drawn as the graph
  # draws it: the run's key folded with the draw's site
  (site,) = [n.attr("site") for n in generate.graph(c, "sample-images").nodes()
             if n.op == "random-normal"]
  x = np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(5), site), (2, 4, 4, 3)))
  for _ in range(3):
    x = 0.5 * x + np.tanh(x @ params["unet/w"])
  assert got.shape == (2, 4, 4, 3) and np.abs(got - x).max() < 1e-5
  png = Image.open(str(tmp / "out" / "samples.png"))
  assert png.size == (11, 6) and png.mode == "RGB"  # two 4×4 images, a pixel between
  assert np.array_equal(np.asarray(png), generate.grid(got))
  assert len(np.unique(np.asarray(png))) > 8  # not one flat colour
  # another seed, other draws; the same seed, the same samples
  assert main(["generate", path, "--resume", step_dir, "-o", str(tmp / "s1"), "--seed", "1"]) == 0
  assert np.abs(np.load(str(tmp / "s1.npz"))["out"] - got).max() > 1e-3
  assert main(["generate", path, "--resume", step_dir, "-o", out, "--fn", "images"]) == 0
  assert np.array_equal(np.load(out)["out"], got)


@pytest.mark.parametrize("argv,code,says", [
    (["--fn", "ddim-step"], "E-GEN-001", "`ddim-step` is not a function of no arguments"),
    (["--fn", "nothing"], "E-GEN-001", "`nothing` is not a function of no arguments"),
    (["--seed", "-1"], "E-FORM-001", "--seed is -1"),
    ([], "E-FORM-001", "needs -o OUT.npz"),
])
def test_generate_refuses_what_it_cannot_run(images, capsys, argv, code, says):
  from sexpgpu.cli.main import main
  tmp, path, _, _, step_dir = images
  out = [] if argv == [] else ["-o", str(tmp / "bad.npz")]
  assert main(["generate", path, "--resume", step_dir, *out, *argv]) == 1
  err = capsys.readouterr().err
  assert f"error[{code}]" in err and says in err and "Traceback" not in err, err
  assert not (tmp / "bad.npz").exists()


def test_an_experiment_without_defgenerate_says_how_to_write_one(tmp_path):
  from sexpgpu.models import generate
  exp = sexpgpu.compile_text(DENOISE, "denoise.sx")
  with pytest.raises(SxError) as e:
    generate.decl(exp._c, None)
  assert e.value.code == "E-GEN-001" and "defgenerate forms are none" in e.value.message
  assert "(defgenerate NAME :fn F :every N)" in e.value.fix
  bad = _error(DENOISE[len(HEAD):] + "(defgenerate g :every 3)\n")
  assert bad.code == "E-FORM-001" and "defgenerate g needs :fn" in bad.message
