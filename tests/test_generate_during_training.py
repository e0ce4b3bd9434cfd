"""`defgenerate :every N` during training: F runs at every N steps (and the last), its outputs
written beside the metrics stream as .npz and a PNG grid, a `generate` event naming them, the
grids as images in TensorBoard (read back from the event file), W&B and MLflow, and a
progress line; a program the loss cannot train is refused before step 0."""

import contextlib
import glob
import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from sexpgpu.errors import SxError

TEXT = """(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 7))
(defrun :loss loss :data train :steps 5 :optimizer (adamw :lr 0.05) :precision f32 :seed 3)
(defn unet [x] (tanh (matmul x (param w [3 3] :init (normal 1.0)))))
(defn loss [batch]
  (mean (square (unet (take (param table [8 3] :init (normal 1.0)) (get batch :tokens))))))
(defn sample-images []
  (let [[x _] (scan (fn [x t] [(+ (* 0.5 x) (unet x)) t]) (random-normal [2 4 4 3])
                    (zeros [2 1]) :axis 0)]
    x))
(defgenerate images :fn sample-images :every 2 :seed 5)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  import sexpgpu
  tmp = tmp_path_factory.mktemp("gentrain")
  path = tmp / "gen.sx"
  path.write_text(TEXT)
  exp = sexpgpu.compile(str(path))
  spec = f"jsonl:{tmp / 'm.jsonl'},tensorboard:{tmp / 'tb'}"
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    summary = exp.run(metrics=spec, checkpoint_dir=str(tmp / "ck"), quiet=False)
  events = [json.loads(line) for line in open(tmp / "m.jsonl")]
  return tmp, exp, summary, events, err.getvalue()


def test_a_generate_event_at_every_n_steps_and_the_last(trained):
  tmp, _, summary, events, _ = trained
  assert summary.steps == 5
  gens = [e for e in events if e["kind"] == "generate"]
  assert [e["step"] for e in gens] == [2, 4, 5]
  folder = tmp / "m.files" / "generate" / "images"
  for e in gens:
    assert e["name"] == "images" and e["fn"] == "sample-images" and e["seed"] == 5
    assert e["outputs"] == {"out": [2, 4, 4, 3]}
    stem = str(folder / f"step-{e['step']}")
    assert e["files"] == [stem + ".npz", stem + ".png"]
    assert e["images"] == {"out": stem + ".png"}
  got = {s: np.load(folder / f"step-{s}.npz")["out"] for s in (2, 4, 5)}
  assert all(a.shape == (2, 4, 4, 3) and np.isfinite(a).all() for a in got.values())
  assert np.abs(got[2] - got[4]).max() > 1e-4  # training moved the weights between them


def test_the_last_samples_are_those_of_the_trained_parameters(trained):
  from sexpgpu.models import generate
  tmp, exp, summary, _, _ = trained
  params = {k: np.asarray(v) for k, v in summary.params.items()}
  again = generate.run(exp._c, "sample-images", params, 5)["out"]
  last = np.load(tmp / "m.files" / "generate" / "images" / "step-5.npz")["out"]
  np.testing.assert_allclose(last, again, rtol=1e-5, atol=1e-6)


def test_tensorboard_holds_the_grids_at_the_steps(trained):
  from PIL import Image
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  tmp, exp, _, _, _ = trained
  acc = EventAccumulator(str(tmp / "tb" / exp._c.slug), size_guidance={"images": 0})
  acc.Reload()
  assert acc.Tags()["images"] == ["generate/images"]
  shots = acc.Images("generate/images")
  assert [s.step for s in shots] == [2, 4, 5]
  for s in shots:
    assert (s.width, s.height) == (11, 6)  # two 4×4 images, a pixel between
    png = np.asarray(Image.open(io.BytesIO(s.encoded_image_string)))
    want = np.asarray(Image.open(tmp / "m.files" / "generate" / "images" / f"step-{s.step}.png"))
    assert np.array_equal(png, want)


def test_a_progress_line_and_the_files_at_each_step(trained):
  tmp, _, _, _, err = trained
  lines = [ln for ln in err.splitlines() if ln.startswith("images: ")]
  assert len(lines) == 6, err
  for step, line, files in zip((2, 4, 5), lines[::2], lines[1::2]):
    assert line.startswith(f"images: step {step}/5 loss ") and " | images/samples-per-s " in line
    assert line.endswith("s") and f" | {2 * step} records | " in line
    stem = tmp / "m.files" / "generate" / "images" / f"step-{step}"
    assert files == f"images: out [2, 4, 4, 3]; {stem}.npz, {stem}.png"


@pytest.mark.slow  # a run of its own (its compile)
def test_mlflow_holds_the_grids_at_the_steps(tmp_path, monkeypatch):
  import sexpgpu
  (tmp_path / "cwd").mkdir()
  monkeypatch.chdir(tmp_path / "cwd")
  from mlflow import MlflowClient
  path = tmp_path / "g.sx"
  path.write_text(TEXT.replace(":steps 5", ":steps 2").replace(":every 2", ":every 1"))
  uri = f"sqlite:///{tmp_path / 'ml.db'}"
  exp = sexpgpu.compile(str(path))
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    exp.run(metrics=f"mlflow:{uri}", quiet=False)
  lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("images: ")]
  # no local stream: the grids reach MLflow from a folder removed after, and a line says so
  assert lines[0].startswith("images: its outputs are not kept as files: give --metrics")
  assert lines[1].startswith("images: step 1/2 loss ") and lines[2].endswith("; no files")
  assert len(lines) == 5
  client = MlflowClient(tracking_uri=uri)
  (run,) = client.search_runs([client.get_experiment_by_name(exp._c.slug).experiment_id])
  names = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
  assert len(names) == 4, names  # each step's image and its thumbnail
  # beside the database, not in MLflow's default ./mlruns
  assert len(os.listdir(tmp_path / "mlartifacts")) == 1 and not os.listdir(tmp_path / "cwd")
  for step in (1, 2):
    assert [n.endswith(".png") for n in names if f"generate~images+step+{step}+" in n] in (
        [True, False], [False, True]), names


def test_a_program_training_cannot_reach_is_refused_before_step_0(tmp_path):
  import sexpgpu
  path = tmp_path / "bad.sx"
  path.write_text(TEXT.replace("(defgenerate images :fn sample-images",
                               "(defn other [] (* (unet (zeros [2 3])) "
                               "(param extra [3] :init ones)))\n"
                               "(defgenerate images :fn other"))
  exp = sexpgpu.compile(str(path))
  with pytest.raises(SxError) as e:
    exp.run(checkpoint_dir=str(tmp_path / "ck"))
  assert e.value.code == "E-RUN-002" and "extra" in e.value.message
  assert os.listdir(tmp_path / "ck" / "bad") == []  # nothing trained, nothing saved


def test_wandb_logs_the_grid_as_an_image(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  from sexpgpu.models import generate
  from sexpgpu.track import open_metrics
  for name in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
    monkeypatch.delenv(name, raising=False)
  for name, folder in (("WANDB_DIR", "wb"), ("WANDB_DATA_DIR", "wb-data"),
                       ("WANDB_CACHE_DIR", "wb-cache"), ("WANDB_CONFIG_DIR", "wb-config")):
    (tmp_path / folder).mkdir()
    monkeypatch.setenv(name, str(tmp_path / folder))
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
  monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
  images = np.random.RandomState(0).rand(2, 4, 4, 3).astype(np.float32)
  (png,) = [f for f in generate.write({"out": images}, str(tmp_path / "s.npz"))
            if f.endswith(".png")]
  m = open_metrics("wandb:gen-test", "gen-slug")
  m.emit("generate", step=3, name="images", fn="f", seed=0, outputs={"out": [2, 4, 4, 3]},
         files=[], images={"out": png})
  m.close()
  (media,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "files" / "media" /
                           "images" / "generate" / "images_*.png"))
  assert np.array_equal(np.asarray(Image.open(media)), np.asarray(Image.open(png)))
