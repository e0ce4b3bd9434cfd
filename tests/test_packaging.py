"""The Pallas kernels live in third_party/kernels/ at the repository's root and are installed
inside the package, as sexpgpu.lower.kernels, by the editable install and by a wheel."""

import ast
import glob
import os
import subprocess
import sys
import tomllib
import zipfile

from conftest import ROOT

KERNELS = os.path.join(ROOT, "third_party", "kernels")


def _setuptools():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["tool"]["setuptools"]


def test_the_package_list_is_every_folder_and_the_kernels():
  found = {os.path.relpath(os.path.dirname(p), ROOT).replace(os.sep, ".")
           for p in glob.glob(os.path.join(ROOT, "sexpgpu", "**", "__init__.py"), recursive=True)}
  cfg = _setuptools()
  assert sorted(cfg["packages"]) == sorted(found | {"sexpgpu.lower.kernels"})
  assert cfg["package-dir"] == {"sexpgpu.lower.kernels": "third_party/kernels"}
  assert not os.path.exists(os.path.join(ROOT, "sexpgpu", "lower", "kernels"))


def test_the_installed_package_imports_the_kernels_from_third_party(tmp_path):
  """From any folder, as a user's script would (the editable install's finder)."""
  code = ("import sexpgpu.lower.kernels.flash_attention as f, sexpgpu.lower.kernels.sharded as s;"
          "print(f.__file__); print(s.__file__)")
  p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.split() == [os.path.join(KERNELS, "flash_attention.py"),
                              os.path.join(KERNELS, "sharded.py")]


def test_a_wheel_carries_the_kernels_inside_the_package(tmp_path):
  p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                      "-q", ROOT, "-w", str(tmp_path / "whl")], capture_output=True, text=True,
                     timeout=300, cwd=tmp_path)
  assert p.returncode == 0, p.stderr[-2000:]
  (wheel,) = glob.glob(str(tmp_path / "whl" / "*.whl"))
  names = zipfile.ZipFile(wheel).namelist()
  assert sorted(n for n in names if "kernels" in n) == [
      "sexpgpu/lower/kernels/__init__.py", "sexpgpu/lower/kernels/flash_attention.py",
      "sexpgpu/lower/kernels/sharded.py"]
  assert not any(n.startswith("third_party") for n in names)
  assert "sexpgpu/std/gpt2.sx" in names
  # installed where nothing else of sexpgpu is, it imports its kernels from itself
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  code = "import sexpgpu.lower.kernels.flash_attention as f; print(f.__file__)"
  p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                     env=dict(os.environ, PYTHONPATH=str(site)), timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.strip() == str(site / "sexpgpu" / "lower" / "kernels" / "flash_attention.py")


def test_every_pallas_call_names_its_backend():
  """jax 0.10.2 sends a pallas_call without compiler_params to Mosaic GPU, which cannot lower
  the flash kernel: each call passes Triton's CompilerParams (None only in interpret mode)."""
  calls = []
  for path in sorted(glob.glob(os.path.join(KERNELS, "*.py"))):
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("pallas_call"):
        kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
        calls.append((os.path.basename(path), node.lineno, kw.get("compiler_params")))
  assert len(calls) == 3, calls  # the forward, and the backward's two
  assert all(params == "_params(interpret)" for _, _, params in calls), calls
  from sexpgpu.lower.kernels import flash_attention as fa
  from jax.experimental.pallas import triton as pltriton
  assert isinstance(fa._params(False), pltriton.CompilerParams) and fa._params(True) is None
