"""The package's imports, read from the source: no cycle, no private API, layers that look one way.

The order of the layers is docs/architecture.md's: its package list names every package of
sexpgpu/, and each may import (at module level or inside a function) only the ones listed above it.
"""

import ast
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "sexpgpu")
PRIVATE = ("jax._src", "orbax.checkpoint._src", "jaxlib._src")

# package → the sexpgpu packages and modules it may import (itself always)
# (sexpgpu.env: the SEXPGPU_* variables, SEXPGPU_DEBUG and SEXPGPU_RUN_SLUG among them)
LAYERS = {
    "sexpgpu.reader": {"sexpgpu.errors", "sexpgpu.catalogue"},
    "sexpgpu.lang": {"sexpgpu.errors", "sexpgpu.catalogue", "sexpgpu.reader", "sexpgpu.env"},
    "sexpgpu.ir": {"sexpgpu.errors", "sexpgpu.catalogue", "sexpgpu.env"},
    "sexpgpu.front": {"sexpgpu.errors", "sexpgpu.catalogue", "sexpgpu.reader", "sexpgpu.lang",
                      "sexpgpu.ir", "sexpgpu.data", "sexpgpu.env"},
    "sexpgpu.lower": {"sexpgpu.errors", "sexpgpu.catalogue", "sexpgpu.ir", "sexpgpu.front"},
}


def _modules(pkg: str = PKG) -> dict[str, str]:
  """Module name → path, for every .py file of the package at `pkg`."""
  out = {}
  root = os.path.dirname(pkg)
  for dirpath, _, files in os.walk(pkg):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        out[".".join(rel)] = os.path.join(dirpath, f)
  return out


MODULES = _modules()
# The Pallas kernels live in third_party/kernels/ at the repository's root and are installed as
# sexpgpu.lower.kernels (pyproject.toml's package-dir): checked under that name, in lower's layer.
MODULES.update({"sexpgpu.lower." + m: p for m, p in
                _modules(os.path.join(ROOT, "third_party", "kernels")).items()})


def _resolve(name: str, level: int, here: str, is_pkg: bool) -> str:
  if not level:
    return name
  base = here.split(".") if is_pkg else here.split(".")[:-1]
  base = base[:len(base) - (level - 1)]
  return ".".join(base + ([name] if name else []))


def _imports(mod: str, modules: dict[str, str] = MODULES) -> list[tuple[str, bool, int]]:
  """(imported module, at module level, line) for each import of `mod`.

  `from P import x` names module P.x when that is a module of the package, else P.
  Imports under `if TYPE_CHECKING:` are left out (they never run).
  """
  path = modules[mod]
  is_pkg = path.endswith("__init__.py")
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  found = []

  def visit(node, top):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
        continue
      inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                             ast.Lambda, ast.ClassDef))
      if isinstance(child, ast.ClassDef):
        inner = top  # a class body runs at import
      if isinstance(child, ast.Import):
        found.extend((a.name, top, child.lineno) for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = _resolve(child.module or "", child.level, mod, is_pkg)
        for a in child.names:
          sub = f"{base}.{a.name}"
          found.append((sub if sub in modules else base, top, child.lineno))
      visit(child, inner)

  visit(tree, True)
  return found


def test_no_private_imports():
  bad = [f"{mod}:{line} imports {name}" for mod in MODULES for name, _, line in _imports(mod)
         if name.startswith(PRIVATE) or "._src" in name]
  assert bad == []


def test_no_private_name_crosses_a_module():
  """`from sexpgpu.x import _name` is a private name used outside its module: it becomes
  public (documented, named for what it is) or stays where it is used."""
  bad = []
  for mod, path in MODULES.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sexpgpu"):
        bad += [f"{mod}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")]
  assert bad == []


def _graph(module_level: bool = True) -> dict[str, set[str]]:
  return {mod: {name for name, top, _ in _imports(mod) if (top or not module_level)
                and name in MODULES and name != mod}
          for mod in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def strong(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        strong(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      strong(v)
  return out


def test_no_cycle_among_module_level_imports():
  assert _cycles(_graph()) == []


def test_no_cycle_hidden_in_a_function_level_import():
  assert _cycles(_graph(module_level=False)) == []


def test_the_cycle_finder_finds_one():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_layers_look_one_way(package):
  allowed = LAYERS[package] | {package}
  bad = []
  for mod in MODULES:
    if mod == package or mod.startswith(package + "."):
      for name, _, line in _imports(mod):
        if name.startswith("sexpgpu.") and not any(name == a or name.startswith(a + ".")
                                                   for a in allowed):
          bad.append(f"{mod}:{line} imports {name}")
  assert bad == []


# --- the layers, in docs/architecture.md's order ------------------------------------------------------------

def layout_order(readme: str) -> list[str]:
  """The packages and top-level modules the architecture page lists, in its order (`reader/` →
  sexpgpu.reader, `api.py` → sexpgpu.api): the first name of each entry of the block."""
  section = readme[readme.index("## Packages"):]
  start = section.index("```\n") + 4
  block = section[start:section.index("```", start)]
  out = []
  for line in block.splitlines():
    if line.startswith("  ") and not line.startswith("   "):
      name = line.split()[0]
      out.append("sexpgpu." + name.rstrip("/").removesuffix(".py"))
  return out


def package_of(mod: str) -> str:
  """sexpgpu.run.loop → sexpgpu.run; sexpgpu.api → sexpgpu.api; sexpgpu → sexpgpu."""
  return ".".join(mod.split(".")[:2])


def back_arrows(modules: dict[str, str], order: list[str]) -> list[str]:
  """Every import of a package listed at or below the importer's own place in `order`:
  `mod:line imports name`. The package's own `__init__` (`import sexpgpu`, the front
  door) stands above every layer."""
  rank = {p: i for i, p in enumerate(order)}
  bad = []
  for mod in sorted(modules):
    here = package_of(mod)
    if here == "sexpgpu":
      continue
    for name, _, line in _imports(mod, modules):
      there = package_of(name)
      if (name.startswith("sexpgpu.") and there != here
          and rank.get(there, len(order)) >= rank.get(here, -1)):
        bad.append(f"{mod}:{line} imports {name}")
  return bad


with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as _f:
  ORDER = layout_order(_f.read())


def test_the_architecture_page_lists_every_package_once():
  packages = {package_of(m) for m in MODULES} - {"sexpgpu"}
  assert sorted(ORDER) == sorted(set(ORDER)), ORDER
  python = [p for p in ORDER if p in packages]
  assert sorted(python) == sorted(packages)
  # A listed name without Python is a folder of other files (std/, the .sx library).
  for p in set(ORDER) - packages:
    assert os.path.isdir(os.path.join(ROOT, *p.split("."))), p


def test_packages_import_only_those_above_them_in_the_list():
  assert back_arrows(MODULES, ORDER) == []


def test_an_upward_import_is_found(tmp_path):
  """The check of the check: the real tree plus one module that imports upward, inside a
  function, fails it, naming the module, the line and the import."""
  copy = tmp_path / "sexpgpu"
  shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__", "*.sx", "*.so"))
  assert back_arrows(_modules(str(copy)), ORDER) == []
  (copy / "ir" / "upward_probe.py").write_text(
      '"""A probe."""\n\n\ndef f():\n  from sexpgpu.run import loop\n  return loop\n')
  assert back_arrows(_modules(str(copy)), ORDER) == [
      "sexpgpu.ir.upward_probe:5 imports sexpgpu.run.loop"]


def test_a_package_at_the_same_place_is_no_back_arrow(tmp_path):
  """Modules of one package import each other freely; a package listed above is allowed."""
  (tmp_path / "sexpgpu" / "lower").mkdir(parents=True)
  (tmp_path / "sexpgpu" / "__init__.py").write_text("")
  (tmp_path / "sexpgpu" / "lower" / "__init__.py").write_text("")
  (tmp_path / "sexpgpu" / "lower" / "a.py").write_text(
      "from sexpgpu.lower import b\nfrom sexpgpu.ir import ops\nimport sexpgpu.errors\n")
  (tmp_path / "sexpgpu" / "lower" / "b.py").write_text("")
  assert back_arrows(_modules(str(tmp_path / "sexpgpu")), ORDER) == []


# --- the private handles sexpgpu keeps, each with its reason beside it ---------------------

def test_private_handles_are_where_they_were():
  """Each library attribute outside a public API that sexpgpu reaches by name (none is
  imported) is still where its one user looks: this fails on the release that moves one,
  before a multi-node run or a failed save meets it."""
  import importlib
  import threading

  from sexpgpu.devices import nodes
  from sexpgpu.lower import cuda_target

  # devices/nodes.py: the jax.distributed client, and what the rendezvous calls on it
  state = importlib.import_module(nodes.CLIENT_HOME).global_state
  assert hasattr(state, "client")
  from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
  for method in ("wait_at_barrier", "key_value_set", "blocking_key_value_get"):
    assert hasattr(_jax.DistributedRuntimeClient, method), method
  with pytest.raises(RuntimeError, match="no jax.distributed client"):
    nodes.distributed_client()  # this process never initialized one
  # ckpt/orbax_io.py cancel_stuck_threads: orbax's waiting thread and its signal keys
  future = importlib.import_module("orbax.checkpoint._src.futures.future")
  t = future._SignalingThread(target=lambda: None, send_signals=[], receive_signals=[],
                              timeout_secs=1)
  assert isinstance(t, threading.Thread) and not t.daemon
  for attr in ("_cancelled", "_receive_signals", "_operation_id"):
    assert hasattr(t, attr), attr
  assert callable(future.signaling_client.get_signaling_client)
  assert callable(future.AwaitableSignalsContract.get_unique_awaitable_singal_key)
  # lower/cuda_target.py: cuDNN attention's version check
  assert hasattr(importlib.import_module(cuda_target.CUDNN_MODULE), "check_cudnn_version")
