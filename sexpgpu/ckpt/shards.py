"""A sharded state written by every process for the shards it holds, read into any sharding.

orbax writes a multi-process state only into a folder that every process sees, and no
array data at all to `s3://` (measured with orbax-checkpoint 0.12.8). So a state sharded over several
processes (`:sharding fsdp|hsdp` over nodes) is written here with tensorstore, the
library orbax itself writes with: one zarr array per leaf under `state/`, its chunk the
saved sharding's shard, so each shard is one file that exactly one process writes.

- `create` (node 0) writes every array's metadata and `state/shards.json`, the leaves'
  paths, shapes and dtypes; the other processes write chunks only (`assume_metadata`).
- `write_mine` writes the shards this process owns, one at a time: the host never holds
  more than one shard's copy, never the state. A shard held by several devices (a
  replicated array, hsdp's copies over nodes) is written once, by one of its holders,
  chosen round-robin over its pieces so the writing spreads over the processes.
- `read` gives each leaf back placed in a target sharding (each process reads only the
  slices its devices hold), or whole on the host: a resume may choose another sharding.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

# the file beside the arrays that names them; its presence marks a state written here
INDEX = "shards.json"
FORMAT = 1


def _leaves(state: Any) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def _keys(tree_path) -> list[str]:
  """A leaf's path as plain names (dict keys, attributes, indices), for readers that do
  not know the tree: ["params", "layers/block/w"], ["opt", "0", "mu", ...]."""
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in tree_path]


def _spec(folder: str, i: int, shape=None, chunks=None, dtype=None) -> dict:
  spec = {"driver": "zarr", "kvstore": {"driver": "file",
                                        "path": os.path.join(folder, "state", f"{i:05d}") + "/"}}
  if shape is not None:
    spec["metadata"] = {"shape": list(shape), "chunks": list(chunks), "dtype": dtype,
                        "compressor": None}
  return spec


def _zarr_dtype(dtype) -> str:
  dtype = np.dtype(dtype)
  return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def _chunk(x) -> tuple[int, ...]:
  sharding = getattr(x, "sharding", None)
  return tuple(sharding.shard_shape(x.shape)) if sharding is not None else tuple(x.shape)


def is_sharded(step_dir: str) -> bool:
  """Whether a local step folder's state was written here (not by orbax)."""
  return os.path.isfile(os.path.join(step_dir, "state", INDEX))


def create(folder: str, state: Any) -> None:
  """Node 0: every leaf's array metadata and the index, before any process writes."""
  import tensorstore as ts
  entries = []
  for i, (tree_path, x) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
    ts.open(_spec(folder, i, x.shape, _chunk(x), _zarr_dtype(x.dtype)), create=True,
            delete_existing=True).result()
    entries.append({"path": jax.tree_util.keystr(tree_path), "keys": _keys(tree_path), "shape": list(x.shape),
                    "dtype": np.dtype(x.dtype).name, "chunks": list(_chunk(x))})
  body = {"format": FORMAT, "leaves": entries}
  with open(os.path.join(folder, "state", INDEX), "w") as f:
    json.dump(body, f, indent=1)


def _owned(x) -> list:
  """This process's shards of `x` that it writes: one holder of each distinct piece."""
  me = jax.process_index()
  pieces: dict[tuple, list] = {}
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    key = tuple((s.start or 0, s.stop if s.stop is not None else n)
                for s, n in zip(index, x.shape))
    pieces.setdefault(key, []).append(device)
  mine = []
  by_device = {s.device: s for s in x.addressable_shards}
  for g, key in enumerate(sorted(pieces)):
    holders = sorted(pieces[key], key=lambda d: d.id)
    writer = holders[g % len(holders)]
    if writer.process_index == me:
      mine.append((key, by_device[writer]))
  return mine


def _chunk_file(i: int, key: tuple, chunks: tuple[int, ...]) -> str:
  """The file, relative to the step folder, that holds leaf i's chunk at `key` (zarr v2
  names a chunk by its grid position, dot-separated; a 0-d array's one chunk is `0`)."""
  grid = ".".join(str(a // c) for (a, _), c in zip(key, chunks)) or "0"
  return f"state/{i:05d}/{grid}"


def write_mine(folder: str, state: Any) -> list[str]:
  """Writes the shards this process owns into `folder/state/`.

  The arrays' metadata is assumed (node 0 writes it with `create`), so a process whose
  folder is its own (a staging folder before an upload) writes chunk files only.

  Returns:
    The files written, relative to `folder`.
  """
  import tensorstore as ts
  written = []
  for i, (_, x) in enumerate(_leaves(state)):
    owned = _owned(x)
    if not owned:
      continue
    arr = ts.open(_spec(folder, i, x.shape, _chunk(x), _zarr_dtype(x.dtype)), open=True,
                  assume_metadata=True).result()
    for key, shard in owned:
      data = np.asarray(shard.data)
      # the shard is written from its own buffer (no copy), which lives until the write ends
      arr[tuple(slice(a, b) for a, b in key)].write(
          data, can_reference_source_data_indefinitely=True).result()
      written.append(_chunk_file(i, key, _chunk(x)))
      del data
  return written


class LayoutError(ValueError):
  """The saved leaves differ from the ones asked for (names the first difference)."""


def read(step_dir: str, target: Any) -> Any:
  """The state saved in a local step folder, shaped like `target`.

  Args:
    step_dir: a complete local step folder written by `create`/`write_mine`.
    target: a pytree of ShapeDtypeStructs; a leaf with a `sharding` comes back as a
      jax.Array placed in it (each process reading only its devices' slices), one
      without as a numpy array.

  Raises:
    LayoutError: when the saved leaves' paths, shapes or dtypes differ from `target`'s.
  """
  import tensorstore as ts
  with open(os.path.join(step_dir, "state", INDEX)) as f:
    index = json.load(f)
  saved = {e["path"]: (i, e) for i, e in enumerate(index["leaves"])}
  flat, treedef = jax.tree_util.tree_flatten_with_path(target)
  wanted = [jax.tree_util.keystr(p) for p, _ in flat]
  if set(wanted) != set(saved):
    extra = sorted(set(saved) - set(wanted))
    missing = sorted(set(wanted) - set(saved))
    raise LayoutError("its state's structure differs from this run's ("
                      + "; ".join(filter(None, [
                          f"only there: {', '.join(extra[:3])}" if extra else "",
                          f"only here: {', '.join(missing[:3])}" if missing else ""])) + ")")
  out = []
  for path, (_, want) in zip(wanted, flat):
    i, entry = saved[path]
    if tuple(entry["shape"]) != tuple(want.shape) or entry["dtype"] != np.dtype(want.dtype).name:
      raise LayoutError(f"{path} is {entry['dtype']}{entry['shape']} there, "
                        f"{np.dtype(want.dtype).name}{list(want.shape)} here")
    arr = ts.open(_spec(step_dir, i), open=True).result()
    sharding = getattr(want, "sharding", None)
    if sharding is None:
      out.append(np.asarray(arr.read().result()))
    else:
      out.append(jax.make_array_from_callback(
          tuple(want.shape), sharding, lambda idx, a=arr: np.asarray(a[idx].read().result())))
  return jax.tree_util.tree_unflatten(treedef, out)


def read_group(step_dir: str, group: str) -> dict[str, np.ndarray]:
  """The leaves saved as `state[group][name]` (the parameters), whole on the host, by name:
  for readers that do not know the experiment that wrote the state."""
  import tensorstore as ts
  with open(os.path.join(step_dir, "state", INDEX)) as f:
    index = json.load(f)
  out = {}
  for i, entry in enumerate(index["leaves"]):
    keys = entry.get("keys") or []
    if len(keys) == 2 and keys[0] == group:
      out[keys[1]] = np.asarray(ts.open(_spec(step_dir, i), open=True).result().read().result())
  return out
