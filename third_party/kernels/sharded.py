"""A kernel call that keeps its batch split inside a sharded step: a sharding rule, and vmap.

XLA's partitioner sees a Pallas call as an opaque custom call: with no rule it
gathers every operand whole onto each device (the whole batch on every rank).
`batch_split(fn)` wraps a kernel function of arrays whose first axis is the
batch (and, for 3-D and 4-D arrays, whose second is the heads) in
`jax.experimental.custom_partitioning` with a Shardy rule that lets batch and
heads stay split, and runs the kernel on each device's shard. Under the sharded
step's `jax.vmap` over ranks (which custom_partitioning cannot batch) the ranks
axis is folded into the batch first (`jax.custom_batching.custom_vmap`).
"""

from __future__ import annotations

import string

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P


def _rule(ranks: list[int], outs: list[int]) -> str:
  """The Shardy rule: factor b (axis 0) and h (axis 1 of 3-D and 4-D arrays) shared by
  every array; every other axis a factor of its own, kept whole."""
  free = iter(string.ascii_lowercase.replace("b", "").replace("h", ""))

  def one(rank):
    return " ".join(["b"] + (["h"] if rank >= 3 else []) +
                    [next(free) for _ in range(rank - (2 if rank >= 3 else 1))])
  return (", ".join(one(r) for r in ranks) + " -> " + ", ".join(one(r) for r in outs))


def _split(mesh, shapes, lead):
  """Each array's sharding: the lead array's batch and heads split, nothing else."""
  spec = tuple(lead.spec) + (None, None) if isinstance(lead, NamedSharding) else (None, None)
  b, h = spec[0], spec[1]
  return [NamedSharding(mesh, P(b, *((h,) if len(s.shape) >= 3 else ()),
                                *([None] * (len(s.shape) - (2 if len(s.shape) >= 3 else 1)))))
          for s in shapes]


def batch_split(fn, ranks: list[int], out_ranks: list[int]):
  """`fn(*arrays) -> tuple of arrays` as a call whose batch (and heads) stay split.

  Args:
    fn: the kernel function; every array's axis 0 is the batch, axis 1 of 3-D and
      4-D arrays the heads.
    ranks, out_ranks: the number of axes of each argument and of each result.

  Returns:
    a function of the same arrays, also under `jax.vmap` (the vmapped axis is folded
    into the batch).
  """
  part = custom_partitioning(fn)

  def infer(mesh, arg_shapes, result_shape):
    results = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
    return tuple(_split(mesh, results, arg_shapes[0].sharding))

  def partition(mesh, arg_shapes, result_shape):
    results = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
    lead = arg_shapes[0].sharding
    return (mesh, fn, tuple(_split(mesh, results, lead)),
            tuple(_split(mesh, arg_shapes, lead)))

  part.def_partition(partition, infer_sharding_from_operands=infer,
                     sharding_rule=_rule(ranks, out_ranks))

  @jax.custom_batching.custom_vmap
  def call(*args):
    return part(*args)

  @call.def_vmap
  def _fold(axis_size, in_batched, *args):
    args = [x if batched else jax.numpy.broadcast_to(x, (axis_size,) + x.shape)
            for x, batched in zip(args, in_batched)]
    outs = call(*[x.reshape((-1,) + x.shape[2:]) for x in args])
    return (tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in outs),
            tuple(True for _ in outs))

  return call
