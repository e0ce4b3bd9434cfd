"""`(reference X)`: X as the model the run started from computes it, held constant (DPO's
reference model; the graph's copy is ir/reference.py's)."""

from __future__ import annotations

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder, Call, describe, is_tensor
from sexpgpu.front.prims import builtin
from sexpgpu.ir import reference as ref


@builtin("reference", "(reference X)",
         "X as the model the run started from computes it (DPO's reference): each parameter X "
         "reads replaced by a frozen copy of its starting value, `reference/PATH` (no gradient, "
         "no optimizer state, not in checkpoints: a resume reads `:init-from` again, E-REF-001 "
         "when it changed), without dropout")
def reference(b: Builder, call: Call):
  """`(reference X)`: the value X, recomputed with every parameter it reads replaced by that
  parameter's starting value, a constant of the step (no gradient, no optimizer state, not
  in checkpoints), without dropout.

  Raises:
    SxError: E-FORM-001 for another arity; E-TYPE-001 for a value that is no tensor;
      E-ARG-001 for a value that reads no parameter (its reference is itself); E-RUN-002
      inside a `repeat` body, and for a pass metric's reference of a parameter whose
      reference the loss never reads.
  """
  if len(call.args) != 1 or call.kw:
    raise SxError("E-FORM-001", f"reference takes one value, given {len(call.args)}"
                  + (" and keywords" if call.kw else ""), location=call.loc,
                  fix="(reference (logps tokens mask)): one value of the trained model")
  x = call.args[0]
  if not is_tensor(x):
    raise SxError("E-TYPE-001", f"reference takes a tensor computed from parameters; found "
                  f"{describe(x)}", location=call.arg_forms[0].loc,
                  fix="pass the model's output, e.g. (reference (logps chosen chosen-mask))")
  if len(b.frames) > 1:
    raise SxError("E-RUN-002", "reference is called inside a repeat body, whose parameters "
                  "are one layer's", location=call.loc,
                  fix="call reference on the repeat's output, outside the function it repeats")
  node, copies = ref.copy(x, b.params)
  if not copies:
    raise SxError("E-ARG-001", "reference's value reads no parameter, so the reference "
                  "computes it as the policy does", location=call.arg_forms[0].loc,
                  fix="pass a value the model computes from its parameters, or drop reference")
  for path, p in copies.items():
    if path not in b.params:
      if not b.allow_new_params:
        raise SxError("E-RUN-002", f"{b.program} reads the reference copy {path}, which the "
                      "loss's references never read, so the run holds no such copy",
                      location=call.loc,
                      fix="call reference in the loss on the same model's value, so the run "
                      "keeps the starting copy this metric reads")
      b.params[path] = p
    b.used[path] = b.params[path]
  return node
