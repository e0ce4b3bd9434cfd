"""The evaluator: static values fold at compile time, tensors become IR nodes."""

from __future__ import annotations

import dataclasses
from typing import Any

from sexpgpu.errors import Loc, SxError, did_you_mean
from sexpgpu.front import homes as _homes
from sexpgpu.front.values import Batch, Builtin, Closure, Env, ParamRef, Spec
from sexpgpu.ir.graph import Body, Graph, Init, Node, Param, type_str
from sexpgpu.ir.roles import check_role
from sexpgpu.ir.shapes import ShapeRuleError, infer, literal_type
from sexpgpu.lang.forms import SPECIALS
from sexpgpu.lang.program import split_keywords, std_libraries_of
from sexpgpu.reader import Atom, Form, Keyword, List, Symbol, Vector

SPECIAL_FORMS = tuple(SPECIALS)  # declared in lang/forms.py; each evaluated by `_sf_NAME`


@dataclasses.dataclass
class Call:
  """A call being evaluated: its form, argument values and forms."""

  name: str
  form: List
  args: list[Any]
  kw: dict[str, Any]
  arg_forms: list[Form]
  kw_forms: dict[str, Form]
  kw_locs: dict[str, Loc] = dataclasses.field(default_factory=dict)  # where each :key is written

  @property
  def loc(self) -> Loc:
    return self.form.loc


@dataclasses.dataclass
class Frame:
  """A graph being built: the top level, or a repeat's body."""

  interned: dict
  stack: tuple[int, ...]  # the repeat sizes above this frame, outermost first
  params: list[str]


def is_tensor(v: Any) -> bool:
  return isinstance(v, Node)


def is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


class Builder:
  """Evaluates forms; one Builder per experiment, reused for each entry graph.

  Attributes:
    params: every parameter seen so far, by path (shared by all entry graphs).
    selected_taps: names of taps a selected diagnostic reads.
  """

  def __init__(self, globals_env: Env, selected_taps: set[str] = frozenset(),
               knob_locs: dict[str, Loc] | None = None):
    self.globals = globals_env
    self.knob_locs = dict(knob_locs or {})
    self.params: dict[str, Param] = {}
    self.selected_taps = set(selected_taps)
    self._recorded: dict = {}  # a loss's calls of each function (front/homes.py)
    self._reset()

  def _reset(self) -> None:
    self.scope: list[str] = []
    self.counters: dict[tuple, int] = {}
    self.chain: list[str] = []
    self.frames = [Frame({}, (), [])]
    self.taps: dict[str, list[Node]] = {}
    self.used: dict[str, Param] = {}
    self.sites = 0
    self.allow_new_params = True
    self.program = ""  # the graph being built ("loss", "eval/loss", "sample/lm")
    self.calls: list[tuple[Closure, str | None]] = []  # named calls open, with their :as

  # --- entry points ----------------------------------------------------------
  def build(self, name: str, fn: Any, fields: dict[str, tuple[str, tuple[int, ...]]],
            allow_new_params: bool = True, extra_args: tuple = ()) -> tuple[Graph, Any]:
    """Builds the graph of `fn(batch)` on abstract inputs.

    Args:
      name: the graph's name ("loss", "eval/loss").
      fn: a Closure taking the batch.
      fields: the batch's fields: name → (dtype, shape of one microbatch).
      allow_new_params: False for pass metrics (a parameter only they create is E-RUN-002).
      extra_args: further arguments after the batch.

    Returns:
      (the graph, fn's value): the graph's output is that value when it is a tensor.
    """
    self._reset()
    self.allow_new_params, self.program = allow_new_params, name
    if allow_new_params:
      _homes.start(self._recorded)
    inputs = {f: self._intern("input", (), (("field", f),), dt, sh, None)
              for f, (dt, sh) in fields.items()}
    self.chain = [name.split("/")[-1]]
    out = self.apply(fn, [Batch(inputs), *extra_args], {}, None, open_scope=False)
    if allow_new_params:  # another program's call of a function the loss calls opens its scope
      _homes.finish(self._recorded)
    return Graph(name, inputs, {"out": out} if is_tensor(out) else {}, dict(self.used),
                 dict(self.taps)), out

  # --- evaluation ------------------------------------------------------------
  def eval(self, form: Form, env: Env) -> Any:
    if isinstance(form, Atom):
      v = form.value
      if isinstance(v, Symbol):
        return self.lookup(str(v), form, env)
      return v
    if isinstance(form, Vector):
      return tuple(self.eval(i, env) for i in form.items)
    if isinstance(form, List):
      if not form.items:
        raise SxError("E-FORM-001", "empty list `()` is not an expression", location=form.loc,
                      fix="write a call (F ARGS...)")
      head = form.items[0]
      if isinstance(head, Atom) and isinstance(head.value, Symbol):
        hname = str(head.value)
        if hname in SPECIAL_FORMS:
          return getattr(self, "_sf_" + hname)(form, env)
      return self.call_form(form, env)
    raise SxError("E-FORM-001", f"cannot evaluate `{form}`", location=form.loc,
                  fix="write a number, a string, a symbol, a vector or a call (F ARGS...)")

  def lookup(self, name: str, form: Form, env: Env) -> Any:
    try:
      v = env.lookup(name)
    except KeyError:
      libs = std_libraries_of(name)
      if libs:  # a nearby spelling would hide the require that brings the name
        fix = " or ".join(f"(require {lib})" for lib in libs) + f" brings `{name}`"
      else:
        fix = (did_you_mean(name, env.names() | set(SPECIAL_FORMS))
               or "define it with def, defn or let, or require the library that has it")
      raise SxError("E-NAME-001", f"`{name}` is not defined", location=form.loc,
                    fix=fix) from None
    if isinstance(v, ParamRef):
      return self.param_node(v.name, v.shape, v.init, v.dtype, form.loc, shared=True)
    return v

  def eval_body(self, forms, env: Env) -> Any:
    out = None
    for f in forms:
      out = self.eval(f, env)
    return out

  def call_form(self, form: List, env: Env) -> Any:
    fn = self.eval(form.items[0], env)
    arg_forms, kw_forms, kw_locs = split_keywords(form, 1, None, "a call")
    args = [self.eval(f, env) for f in arg_forms]
    kw = {k: f if k == "as" else self.eval(f, env) for k, f in kw_forms.items()}
    name = str(form.items[0]) if isinstance(form.items[0], Atom) else "fn"
    return self.apply(fn, args, kw, Call(name, form, args, kw, arg_forms, kw_forms, kw_locs))

  def apply(self, fn: Any, args: list, kw: dict, call: Call | None, open_scope: bool = True) -> Any:
    """Calls a closure or builtin with evaluated arguments."""
    if isinstance(fn, Builtin):
      if "as" in kw:
        raise SxError("E-FORM-002", f"{fn.name} is a primitive: :as names user functions only",
                      location=call.kw_forms["as"].loc, fix="remove :as")
      return fn.fn(self, call)
    if not isinstance(fn, Closure):
      loc = call.form.items[0].loc if call else None
      if call is not None:
        self._check_hidden_primitive(call.name, fn, loc)
      raise SxError("E-TYPE-001", f"`{call.name if call else fn}` is not a function "
                    f"(it is {describe(fn)})", location=loc, fix="call a defn, fn or primitive")
    as_form = kw.pop("as", None)
    env = self._bind(fn, args, kw, call)
    if not open_scope or fn.name is None:
      return self.eval_body(fn.body, env)
    if as_form is not None:
      if not (isinstance(as_form, Atom) and isinstance(as_form.value, Symbol)):
        raise SxError("E-FORM-001", ":as takes a name", location=as_form.loc, fix=":as q")
      scope_name, crumb = str(as_form.value), f"{fn.name}:{as_form.value}"
    else:
      scope_name, crumb = self._number(fn.name), fn.name
    natural, where = tuple(self.scope) + (scope_name,), call.loc if call else fn.loc
    as_name, stack = (scope_name if as_form is not None else None), self.frames[-1].stack
    if self.allow_new_params:
      _homes.record(self._recorded, fn, as_name, natural, stack, where)
      home = None
    else:  # the trained function the loss calls, whatever the path here
      home = _homes.home(self.params, fn, as_name, natural, stack,
                         _homes.who_of(self.program), where)
    self.calls.append((fn, as_name))
    try:
      if home is None:
        return self._in_scope(scope_name, crumb, lambda: self.eval_body(fn.body, env))
      return self._at_home(home, crumb, lambda: self.eval_body(fn.body, env))
    finally:
      self.calls.pop()

  def _at_home(self, scope: tuple[str, ...], crumb: str, thunk):
    """`thunk` in the scope the loss gave a function, its numbering as the loss's."""
    saved = self.scope, self.counters
    self.scope, self.counters = list(scope[:-1]), {}
    try:
      return self._in_scope(scope[-1], crumb, thunk)
    finally:
      self.scope, self.counters = saved

  def _number(self, name: str) -> str:
    key = (tuple(self.scope), name)
    n = self.counters.get(key, 0)
    self.counters[key] = n + 1
    return name if n == 0 else f"{name}.{n}"

  def _in_scope(self, scope_name: str, crumb: str, thunk):
    self.scope.append(scope_name)
    self.chain.append(crumb)
    try:
      return thunk()
    finally:
      self.scope.pop()
      self.chain.pop()

  def _check_hidden_primitive(self, name: str, value: Any, call_loc: Loc | None) -> None:
    """Raises E-NAME-002 when a knob or def named like a primitive is called.

    The user's files share one top level (the standard library has its own namespaces,
    front/namespaces.py), so `(defknob top-k 2)` hides the primitive `top-k` from the user's
    own calls; the fix belongs at the knob, not at the call.
    """
    if name not in self.globals.vars or self.globals.vars[name] is not value:
      return
    env = self.globals.parent
    while env is not None and name not in env.vars:
      env = env.parent
    if env is None or not isinstance(env.vars[name], (Builtin, Closure)):
      return
    what = "knob" if name in self.knob_locs else "def"
    from sexpgpu.front.namespaces import hidden_std_function
    hidden_std_function(name, what, env.vars[name], call_loc)  # a std function: its lib/name
    raise SxError("E-NAME-002", f"the {what} `{name}` hides the primitive `{name}`, which "
                  f"is called at {call_loc}", location=self.knob_locs.get(name, call_loc),
                  fix=f"rename the {what}: a top-level name must not be a primitive's")

  def _bind(self, fn: Closure, args: list, kw: dict, call: Call | None) -> Env:
    where = call.loc if call else fn.loc
    if len(args) != len(fn.params):
      raise SxError("E-FORM-001", f"{fn.name or 'fn'} takes {len(fn.params)} positional "
                    f"argument{'s' if len(fn.params) != 1 else ''}, given {len(args)}",
                    location=where, fix=f"parameters: [{' '.join(str(p) for p in fn.params)}"
                    + "".join(f" :{k}" for k, _ in fn.kwparams) + "]")
    known = dict(fn.kwparams)
    for k in kw:
      if k not in known:
        loc = call.kw_locs.get(k, where) if call else where
        raise SxError("E-FORM-002", f"{fn.name or 'fn'} has no keyword :{k}", location=loc,
                      fix="known keywords: " + (" ".join(":" + n for n in known) or "none"))
    env = Env(fn.env)
    for p, v in zip(fn.params, args):
      self.destructure(p, v, env)
    for k, default in fn.kwparams:
      env.vars[k] = kw[k] if k in kw else self.eval(default, env)
    return env

  def destructure(self, target: Form, value: Any, env: Env) -> None:
    if isinstance(target, Atom) and isinstance(target.value, Symbol):
      env.vars[str(target.value)] = value
      return
    if isinstance(target, Vector):
      if not isinstance(value, tuple) or len(value) != len(target.items):
        raise SxError("E-TYPE-001", f"cannot destructure {describe(value)} into "
                      f"{len(target.items)} names", location=target.loc,
                      fix="the vector's length must match the value's")
      for t, v in zip(target.items, value):
        self.destructure(t, v, env)
      return
    raise SxError("E-FORM-001", f"`{target}` cannot be bound", location=target.loc,
                  fix="bind a symbol or a vector of symbols")

  # --- special forms ---------------------------------------------------------
  def _sf_let(self, form: List, env: Env) -> Any:
    if len(form.items) < 3 or not isinstance(form.items[1], Vector) \
        or len(form.items[1].items) % 2:
      raise SxError("E-FORM-001", "let needs a vector of name/value pairs and a body",
                    location=form.loc, fix="(let [a 1 b (+ a 1)] BODY)")
    env = Env(env)
    pairs = form.items[1].items
    for i in range(0, len(pairs), 2):
      self.destructure(pairs[i], self.eval(pairs[i + 1], env), env)
    return self.eval_body(form.items[2:], env)

  def _sf_do(self, form: List, env: Env) -> Any:
    return self.eval_body(form.items[1:], env)

  def _sf_if(self, form: List, env: Env) -> Any:
    if len(form.items) not in (3, 4):
      raise SxError("E-FORM-001", "if takes a condition, a then and an optional else",
                    location=form.loc, fix="(if C A B)")
    c = self.eval(form.items[1], env)
    if is_tensor(c):
      raise SxError("E-TYPE-001", "if needs a static condition; found a tensor "
                    f"{c.type_str}", location=form.items[1].loc,
                    fix="use (where C A B) to choose between tensors elementwise")
    if truthy(c):
      return self.eval(form.items[2], env)
    return self.eval(form.items[3], env) if len(form.items) == 4 else None

  def _static_logic(self, form: List, env: Env) -> list:
    vals = []
    for f in form.items[1:]:
      v = self.eval(f, env)
      if is_tensor(v):
        raise SxError("E-TYPE-001", f"{form.items[0]} works on static values; found a tensor "
                      f"{v.type_str}", location=f.loc, fix="compare tensors with < > = and where")
      vals.append(v)
    return vals

  def _sf_or(self, form: List, env: Env) -> Any:
    for f in form.items[1:]:
      v = self._static_logic(List(form.loc, (form.items[0], f)), env)[0]
      if truthy(v):
        return v
    return None if len(form.items) == 1 else v

  def _sf_and(self, form: List, env: Env) -> Any:
    v = True
    for f in form.items[1:]:
      v = self._static_logic(List(form.loc, (form.items[0], f)), env)[0]
      if not truthy(v):
        return v
    return v

  def _sf_not(self, form: List, env: Env) -> Any:
    if len(form.items) != 2:
      raise SxError("E-FORM-001", "not takes one value", location=form.loc, fix="(not X)")
    return not truthy(self._static_logic(form, env)[0])

  def _sf_fn(self, form: List, env: Env) -> Closure:
    if len(form.items) < 3 or not isinstance(form.items[1], Vector):
      raise SxError("E-FORM-001", "fn needs a parameter vector and a body", location=form.loc,
                    fix="(fn [x] BODY)")
    params, kwparams = parse_params(form.items[1])
    return Closure(None, params, kwparams, form.items[2:], env, form.loc)

  def _sf_get(self, form: List, env: Env) -> Any:
    if len(form.items) != 3:
      raise SxError("E-FORM-001", "get takes a batch and a :field", location=form.loc,
                    fix="(get batch :tokens)")
    batch = self.eval(form.items[1], env)
    key = self.eval(form.items[2], env)
    if isinstance(batch, Batch):
      if key not in batch.fields:
        raise SxError("E-NAME-001", f"the batch has no field :{key}", location=form.items[2].loc,
                      fix="fields: " + " ".join(":" + f for f in batch.fields))
      return batch.fields[key]
    if isinstance(batch, tuple) and isinstance(key, int) and not isinstance(key, bool):
      if not -len(batch) <= key < len(batch):
        raise SxError("E-SHAPE-001", f"index {key} out of a vector of {len(batch)}",
                      location=form.items[2].loc, fix="index within the vector")
      return batch[key]
    raise SxError("E-TYPE-001", f"get needs a batch (or a vector and an index); found "
                  f"{describe(batch)}", location=form.items[1].loc,
                  fix="(get batch :tokens), or (get v 0) for a vector's first item")

  def _sf_tap(self, form: List, env: Env) -> Any:
    if len(form.items) != 3 or not (isinstance(form.items[1], Atom)
                                    and isinstance(form.items[1].value, Symbol)):
      raise SxError("E-FORM-001", "tap takes a name and a tensor", location=form.loc,
                    fix="(tap attention/entropy X)")
    name = str(form.items[1].value)
    x = self.eval(form.items[2], env)
    if name not in self.selected_taps or not is_tensor(x):
      return x
    node = self.op("tap", [x], {"name": name}, None, form)
    self.taps.setdefault(name, []).append(node)
    return node

  def _sf_param(self, form: List, env: Env) -> Node:
    if len(form.items) < 3 or not (isinstance(form.items[1], Atom)
                                   and isinstance(form.items[1].value, Symbol)):
      raise SxError("E-FORM-001", "param takes a name, a shape and :init", location=form.loc,
                    fix="(param w [in out] :init (fan-in 1.0))")
    name = str(form.items[1].value)
    shape = self.eval(form.items[2], env)
    kw = self._keywords(form, 3, env, SPECIALS["param"].keys, "param")
    init = as_init(kw.get("init", Init("zeros")), form)
    dtype = str(kw.get("dtype", "f32"))
    shape = static_shape(shape, form.items[2])
    path = "/".join(self.scope + [name])
    role = None
    if "role" in kw:  # written as a name (:role norm), checked against ir.roles.ROLES
      r = kw["role"]
      role = check_role(str(r.value) if isinstance(r, Atom) else str(r), loc=r.loc)
    return self.param_node(path, shape, init, dtype, form.loc, role=role)

  def _keywords(self, form: List, start: int, env: Env, allowed: tuple, what: str) -> dict:
    """The `:key value` options after `start`, evaluated (`:as` kept as written)."""
    pos, kws, _ = split_keywords(form, start, allowed, what)
    if pos:
      raise SxError("E-FORM-001", f"{what}: expected a :keyword, found `{pos[0]}`",
                    location=pos[0].loc, fix="known keywords: " + " ".join(":" + a for a in allowed))
    return {k: v if k in ("as", "role") else self.eval(v, env) for k, v in kws.items()}

  def _sf_repeat(self, form: List, env: Env) -> Node:
    if len(form.items) < 4:
      raise SxError("E-FORM-001", "repeat takes a count, a function and an input",
                    location=form.loc, fix="(repeat layers block x :remat true)")
    n = self.eval(form.items[1], env)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise SxError("E-TYPE-001", f"repeat's count must be a static integer ≥ 1; found "
                    f"{describe(n)}", location=form.items[1].loc, fix="(repeat 4 F X)")
    fn = self.eval(form.items[2], env)
    x = self.eval(form.items[3], env)
    kw = self._keywords(form, 4, env, SPECIALS["repeat"].keys, "repeat")
    if not is_tensor(x):
      raise SxError("E-TYPE-001", f"repeat's input must be a tensor; found {describe(x)}",
                    location=form.items[3].loc, fix="pass the tensor F is applied to")
    if "as" in kw:
      scope_name = str(kw["as"].value) if isinstance(kw["as"], Atom) else "repeat"
    else:
      scope_name = self._number("repeat")
    outer = self.frames[-1]
    frame = Frame({}, outer.stack + (n,), [])
    self.frames.append(frame)
    carry = self._intern("carry", (), (("frame", id(frame)),), x.dtype, x.shape, form.loc)
    try:
      out = self._in_scope(scope_name, "repeat", lambda: self.apply(
          fn, [carry], {}, Call("repeat", form, [carry], {}, [form.items[3]], {})))
    finally:
      self.frames.pop()
    if not is_tensor(out) or out.shape != x.shape or out.dtype != x.dtype:
      raise SxError("E-SHAPE-001", f"repeat's function must return its input's type "
                    f"{x.type_str}; it returned {describe(out)}", location=form.items[2].loc,
                    fix="make F map a tensor to one of the same shape and dtype",
                    notes=[("in", " › ".join(self.chain))])
    outer.params.extend(p for p in frame.params if p not in outer.params)
    body = Body(carry, out, tuple(frame.params))
    return self._intern("repeat", (x,), (("body", body), ("n", n),
                        ("remat", bool(kw.get("remat", False)))), x.dtype, x.shape, form.loc)

  # --- nodes -----------------------------------------------------------------
  def param_node(self, path: str, shape: tuple, init: Init, dtype: str, loc: Loc,
                 shared: bool = False, role: str | None = None) -> Node:
    stack = () if shared else self.frames[-1].stack
    existing = self.params.get(path)
    if existing is not None:
      if existing.shape != shape or existing.dtype != dtype or existing.stack != stack:
        raise SxError("E-SHAPE-001", f"parameter {path} is {type_str(dtype, shape)} here but "
                      f"{type_str(existing.dtype, existing.shape)} at {existing.loc}",
                      location=loc, fix="a parameter path has one shape; name one with :as")
      param = existing
    else:
      if not self.allow_new_params:
        raise _homes.untrained(path, _homes.who_of(self.program), self.chain, self.calls, loc)
      param = Param(path, shape, dtype, init, loc, stack)
      self.params[path] = param
    self.used[path] = param
    if not shared:
      for fr in self.frames[1:]:
        if path not in fr.params:
          fr.params.append(path)
    attrs = (("path", path),) + ((("role", role),) if role is not None else ())
    return self._intern("param", (), attrs, dtype, shape, loc)

  def _intern(self, op, inputs, attrs, dtype, shape, loc) -> Node:
    frame = self.frames[-1]
    key = (op, tuple(i.uid if isinstance(i, Node) else (type(i).__name__, i) for i in inputs),
           attrs)
    node = frame.interned.get(key)
    if node is None:
      node = Node(op, tuple(inputs), attrs, dtype, tuple(shape), loc, "/".join(self.scope))
      frame.interned[key] = node
    return node

  def op(self, name: str, inputs: list, attrs: dict, call: Call | None, form: Form = None,
         operand_names: list[str] | None = None, fix: str | None = None) -> Node:
    """Makes a node of primitive `name`, checking shapes and dtypes by its lowering.

    `fix` replaces the generic fix of a refusal (an op's usage, for one read from its
    declaration)."""
    form = form if form is not None else call.form
    attrs_t = tuple(sorted(attrs.items()))
    in_types = tuple(("T", i.dtype, i.shape) if is_tensor(i) else literal_type(i) for i in inputs)
    try:
      dtype, shape = infer(name, attrs_t, in_types)
    except ShapeRuleError as e:
      names = operand_names or ([_short(f) for f in call.arg_forms] if call else [])
      raise self.shape_error(name, e.kind, e.message, inputs, names, form.loc, fix) from None
    return self._intern(name, inputs, attrs_t, dtype, shape, form.loc)

  def shape_error(self, name: str, kind: str, message: str, inputs: list, names: list[str],
                  loc: Loc, fix: str | None = None) -> SxError:
    ops = []
    for i, v in enumerate(inputs):
      nm = names[i] if i < len(names) else f"#{i}"
      ops.append(f"{nm} {v.type_str}" if is_tensor(v) else f"{nm} {v!r}")
    code = {"type": "E-TYPE-001", "op": "E-OP-001"}.get(kind, "E-SHAPE-001")
    if kind == "op":
      fix = "fix the op's Python function (SEXPGPU_DEBUG=1 prints the whole traceback)"
    if fix is None:
      fix = ("convert one operand with (cast X f32) so the dtypes agree" if kind == "type" else
             "make the operands' shapes fit the operation")
    return SxError(code, f"{name}: {message}", location=loc, fix=fix,
                   notes=[("operands", ", ".join(ops)), ("in", " › ".join(self.chain))])


def parse_params(vec: Vector) -> tuple[tuple[Form, ...], tuple[tuple[str, Form], ...]]:
  """Splits a parameter vector into positional targets and (keyword, default) pairs."""
  params, kwparams = [], []
  items = vec.items
  i = 0
  while i < len(items):
    it = items[i]
    if isinstance(it, Atom) and isinstance(it.value, Keyword):
      if i + 1 >= len(items):
        raise SxError("E-FORM-001", f"keyword parameter :{it.value} has no default",
                      location=it.loc, fix=f"write :{it.value} DEFAULT")
      kwparams.append((str(it.value), items[i + 1]))
      i += 2
    else:
      if kwparams:
        raise SxError("E-FORM-001", "positional parameter after keyword parameters",
                      location=it.loc, fix="put keyword parameters last")
      if not (isinstance(it, Vector) or (isinstance(it, Atom) and isinstance(it.value, Symbol))):
        raise SxError("E-FORM-001", f"`{it}` is not a parameter name", location=it.loc,
                      fix="parameters are symbols or vectors of symbols")
      params.append(it)
      i += 1
  return tuple(params), tuple(kwparams)


def truthy(v: Any) -> bool:
  return v is not None and v is not False


def describe(v: Any) -> str:
  if is_tensor(v):
    return f"a tensor {v.type_str}"
  if isinstance(v, bool):
    return f"the boolean {'true' if v else 'false'}"
  if is_number(v):
    return f"the number {v}"
  if isinstance(v, tuple):
    return f"a vector of {len(v)}"
  if v is None:
    return "nil"
  if isinstance(v, (Closure, Builtin)):
    return "a function"
  if isinstance(v, Batch):
    return "a batch"
  if isinstance(v, str):
    return f'the string "{v}"'
  if isinstance(v, Init):
    return f"the initializer {v}"
  if isinstance(v, Spec):
    return f"the {v.kind} {v.name}"
  return type(v).__name__


def _short(form: Form) -> str:
  s = str(form)
  return s if len(s) <= 24 else s[:21] + "..."


def static_shape(v: Any, form: Form) -> tuple[int, ...]:
  """A static vector of non-negative ints, else E-TYPE-001."""
  if isinstance(v, int) and not isinstance(v, bool):
    v = (v,)
  if not isinstance(v, tuple) or not all(isinstance(d, int) and not isinstance(d, bool)
                                         for d in v):
    raise SxError("E-TYPE-001", f"a shape is a vector of static integers; found {describe(v)}"
                  + (f" {v}" if isinstance(v, tuple) else ""), location=form.loc,
                  fix="use integers (static / of integers that divide exactly is an integer)")
  return tuple(v)


def as_init(v: Any, form: Form) -> Init:
  if isinstance(v, Init):
    return v
  if isinstance(v, Builtin) and v.name in ("zeros", "ones"):
    return Init(v.name)
  if is_number(v):
    return Init("constant", float(v))
  raise SxError("E-TYPE-001", f":init takes an initializer; found {describe(v)}",
                location=form.loc, fix="zeros, ones, (normal 0.02), (fan-in 1.0), (constant V), "
                "(truncated-normal S), (uniform L)")
