"""A checkpoint's meta: what a step folder records beside its arrays, and the checks that a
checkpoint is of this experiment and of this placement.

Everything here takes plain values (fingerprints, knob values, counts), so `run`, `import`
and `export` write and read one schema without sharing anything else.
"""

from __future__ import annotations

from typing import Any, Mapping

from sexpgpu.errors import SxError
from sexpgpu.lang.select import NOT_IN_FINGERPRINT, format_value
from sexpgpu.paths import scrub, scrubbed
from sexpgpu.record import jsonable, versions


def identity(fingerprint: str, graph_fingerprint: str, slug: str, knobs: Mapping[str, Any],
             sources: Mapping[str, str]) -> dict:
  """What names the experiment a checkpoint is of.

  Args:
    fingerprint, graph_fingerprint: the selection's and the graph's fingerprints.
    slug: the run's slug (it carries no credentials: lang/select.py's make_slug).
    knobs: knob name → its bound value; written scrubbed of credentials (paths.scrub), as
      everything a checkpoint's meta shows is (`--set init-from=s3://K:S@b/x` is kept as
      `s3://***@b/x`: the run had the value, the meta need not).
    sources: the `.sx` sources, path → text.
  """
  return {"fingerprint": fingerprint, "graph_fingerprint": graph_fingerprint,
          "slug": slug, "knobs": scrubbed({k: jsonable(v) for k, v in knobs.items()}),
          "sources": dict(sources)}


def build(ident: dict, step: int, stage: int, *, counters: Mapping[str, int],
          last_pass: Mapping[str, float], train_loss: float | None,
          loaders: Mapping[str, dict], ranks: int = 1, nodes: int = 1,
          node_gradients: str = "f32", stacking: int | None = None,
          sharding: str = "replicate", mesh: Mapping[str, int] | None = None) -> dict:
  """The meta written beside the state: everything a resume needs besides the arrays.

  Args:
    ident: the experiment's identity().
    step, stage: where the state is.
    counters, last_pass, train_loss: the run's progress as of `step`.
    loaders: loader name → state as of `step` (not as of batches drawn ahead).
    ranks, nodes: the placement that wrote it (a resume needs the same).
    node_gradients, stacking: how the run sums its gradients (a resume keeps both); no
      stacking lets the run that starts from it choose its own.
    sharding, mesh: the run's :sharding and device mesh (a resume may choose another).
  """
  out = {"fingerprint": ident["fingerprint"], "graph_fingerprint": ident["graph_fingerprint"],
         "slug": ident["slug"], "step": step, "stage": stage, "ranks": ranks, "nodes": nodes,
         "node_gradients": node_gradients}
  if stacking is not None:
    out["stacking"] = stacking
  out.update(sharding=sharding, mesh=dict(mesh or {}), counters=dict(counters),
             last_pass=dict(last_pass), train_loss=train_loss, loaders=dict(loaders),
             knobs=dict(ident["knobs"]), versions=versions(), sources=dict(ident["sources"]))
  return out


def check_placement(meta: Mapping[str, Any], step_dir: str, ranks: int, nodes: int) -> None:
  """Refuses a checkpoint written by another rank or node count.

  Raises:
    SxError: E-DP-002, naming both counts.
  """
  if meta.get("ranks", 1) == ranks and meta.get("nodes", 1) == nodes:
    return
  raise SxError("E-DP-002", f"the checkpoint was written by {meta.get('ranks')} ranks on "
                f"{meta.get('nodes')} nodes; this run has {ranks} rank"
                f"{'s' if ranks != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''}",
                where=step_dir)


def check_experiment(meta: Mapping[str, Any], step_dir: str, fingerprint: str,
                     knobs: Mapping[str, Any]) -> None:
  """Refuses a checkpoint of another experiment.

  Args:
    meta: the checkpoint's meta.
    step_dir: its step folder (for the error).
    fingerprint: this experiment's fingerprint.
    knobs: this experiment's knob name → value.

  Raises:
    SxError: E-CKPT-002, naming the knobs that differ (or the IR when none does).
  """
  if meta.get("fingerprint") == fingerprint:
    return
  theirs = meta.get("knobs", {})
  # the meta keeps values scrubbed (identity), so both sides are compared as shown
  diffs = [f"{k} {format_value(theirs.get(k))} → {format_value(knobs.get(k))}"
           for k in sorted(set(theirs) | set(knobs)) if k not in NOT_IN_FINGERPRINT
           and scrub(str(theirs.get(k))) != scrub(str(knobs.get(k)))]
  what = ("knobs differ: " + ", ".join(diffs)) if diffs else "the model's IR differs"
  raise SxError("E-CKPT-002", f"the checkpoint is of another experiment ({what})",
                where=step_dir, fix="resume with the selection that wrote it, or start afresh "
                "without --resume")
