"""examples/tiny-lm.ipynb runs top to bottom (nbclient, kernel python3 from this interpreter)."""

import os

import pytest

from conftest import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def _text(cell) -> str:
  out = []
  for o in cell.get("outputs", []):
    out.append(o.get("text", "") + (o.get("data") or {}).get("text/plain", ""))
  return "".join(out)


@pytest.mark.slow  # a notebook kernel runs the notebook
def test_tiny_lm_notebook_runs():
  nb = nbformat.read(os.path.join(ROOT, "examples", "tiny-lm.ipynb"), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": ROOT}})
  client.execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(o.get("output_type") != "error" for c in code for o in c.get("outputs", []))
  assert "tiny-lm-smoke" in _text(code[0])
  assert "width" in _text(code[1]) and "variant" in _text(code[1])
  assert "total" in _text(code[2])
  assert "(2, 16, 32)" in _text(code[3])
  assert "eval/loss" in _text(code[4])
  assert any("image/png" in (o.get("data") or {}) for o in code[5].get("outputs", []))
