"""A notebook that trains, reads the trained parameters, samples and exports through the Python
API alone, run in a real kernel (nbclient); and the API's names and help."""

import json
import os
import pydoc

import pytest

import sexpgpu
from conftest import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    """import numpy as np
import sexpgpu
exp = sexpgpu.compile(os.path.join(ROOT, "configs", "tiny-lm.sx"), variant="smoke")
run = exp.run(steps=6, checkpoint_dir=CK)
print(json.dumps({"steps": run.steps, "same_paths": sorted(run.params) == sorted(exp.params),
                  "shapes": {k: list(v.shape) for k, v in run.params.items()
                             if k.endswith("embed")}}))""",
    """greedy = exp.sample(run.params, "3 1 4", tokens=5, temperature=0)
print(json.dumps({"ids": greedy.ids, "prompt": greedy.prompt_ids, "text": str(greedy)}))""",
    """loaded = exp.load("latest", checkpoint_dir=CK)
again = exp.sample(loaded, [3, 1, 4], tokens=5, temperature=0)
print(json.dumps({"equal": all(np.array_equal(loaded[k], run.params[k]) for k in exp.params),
                  "ids": again.ids}))""",
    """from safetensors.numpy import load_file
files = run.export(os.path.join(OUT, "tiny.safetensors"))
back = load_file(files[0])
print(json.dumps({"files": [os.path.basename(f) for f in files],
                  "equal": sorted(back) == sorted(exp.params)
                  and all(np.array_equal(back[k], run.params[k]) for k in back)}))""",
    """print(json.dumps(sorted(n for n in dir(sexpgpu) if not n.startswith("_"))))""",
]


def _json(cell):
  text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")
  return json.loads(text.strip().splitlines()[-1])


@pytest.mark.slow  # a notebook kernel trains, samples and exports
def test_a_notebook_trains_reads_params_samples_and_exports(tmp_path):
  setup = (f"import json, os\nROOT = {ROOT!r}\nCK = {str(tmp_path / 'ck')!r}\n"
           f"OUT = {str(tmp_path)!r}")
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup)]
                                + [nbformat.v4.new_code_cell(c) for c in CELLS])
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  cells = nb.cells[1:]
  for c in cells:
    assert all(o.get("output_type") != "error" for o in c.get("outputs", [])), c.outputs
  trained = _json(cells[0])
  assert trained["steps"] == 6 and trained["same_paths"]
  assert trained["shapes"] == {"lm/transformer-lm/embed": [32, 32],
                               "lm/transformer-lm/unembed": [32, 32]}
  greedy = _json(cells[1])
  assert greedy["prompt"] == [3, 1, 4] and len(greedy["ids"]) == 5
  assert all(0 <= i < 32 for i in greedy["ids"])
  assert greedy["text"] == " ".join(map(str, greedy["ids"]))
  loaded = _json(cells[2])
  assert loaded["equal"] and loaded["ids"] == greedy["ids"]  # the checkpoint is the run's end
  assert _json(cells[3]) == {"files": ["tiny.safetensors"], "equal": True}
  assert _json(cells[4]) == sorted(sexpgpu.__all__)


def test_the_api_is_listed_and_documented():
  assert dir(sexpgpu) == sorted(sexpgpu.__all__)
  assert {"Experiment", "Run", "Sample", "compile", "compile_text", "SxError"} <= set(dir(sexpgpu))
  for name in sexpgpu.__all__:
    obj = getattr(sexpgpu, name)
    assert obj.__doc__ and obj.__doc__.strip(), name
  text = pydoc.render_doc(sexpgpu.Experiment, renderer=pydoc.plaintext)
  for method in ("load", "sample", "export", "run", "call", "init"):
    doc = getattr(sexpgpu.Experiment, method).__doc__
    assert doc and method in text, method
  assert "Returns" in sexpgpu.Experiment.load.__doc__ and "Raises" in sexpgpu.Experiment.load.__doc__
  assert "trained parameters" in pydoc.render_doc(sexpgpu.Run, renderer=pydoc.plaintext)


def test_wrong_params_and_format_are_coded(tmp_path):
  exp = sexpgpu.compile(os.path.join(ROOT, "configs", "tiny-lm.sx"), variant="smoke")
  with pytest.raises(sexpgpu.SxError) as e:
    exp.export({"loss/lm/nope": 0}, str(tmp_path / "x.safetensors"))
  assert e.value.code == "E-FORM-001" and "lack" in str(e.value)
  with pytest.raises(sexpgpu.SxError) as e:
    exp.export(exp.init().params, str(tmp_path / "x.bin"), format="onnx")
  assert e.value.code == "E-FORM-001" and "safetensors" in e.value.fix
  with pytest.raises(sexpgpu.SxError) as e:
    exp.load("latest", checkpoint_dir=str(tmp_path / "none"))
  assert e.value.code.startswith("E-CKPT")
