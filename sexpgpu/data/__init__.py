"""Data loaders: make_loader(spec) turns a `defloader` into a pure, resumable batch source."""

from __future__ import annotations

from sexpgpu.data import chat, files, mix, pairs, synthetic, text
from sexpgpu.data.base import Context, Loader
from sexpgpu.data.spec import LoaderDef, LoaderSpec, bind_args, check_fields
from sexpgpu.errors import SxError, did_you_mean

__all__ = ["KINDS", "Loader", "LoaderDef", "LoaderSpec", "keywords", "make_loader", "takes_file"]

# Every loader kind, declared beside the class that builds it (LoaderDef: its typed keywords,
# a doc line, the builder), in the reference's order. `defloader` (front/experiment.py),
# bind_args (here and at `check`) and the language reference read a kind's keywords from its
# declaration and nowhere else.
KINDS: dict[str, LoaderDef] = {d.name: d for d in (
    synthetic.MARKOV, synthetic.COPY, synthetic.REVERSE, synthetic.SORT, synthetic.ADD,
    files.TOKENS, files.BYTES, files.ARRAYS, mix.MIX, text.TEXT, chat.CHAT, pairs.PAIRS)}


# The kinds of Key written without a `:keyword`: a file kind's path first, a mix's
# components as its (WEIGHT LOADER) pairs.
POSITIONAL = ("path", "components")


def keywords(kind: str) -> tuple[str, ...]:
  """The `:keyword`s that loader `kind` takes, from its declaration (required first)."""
  decl = KINDS[kind]
  return tuple(k for k in decl.known() if decl.key(k).kind not in POSITIONAL)


def takes_file(kind: str) -> bool:
  """Whether loader `kind` reads a file (or s3:// URI) written before its keywords."""
  return any(KINDS[kind].key(k).kind == "path" for k in KINDS[kind].required)


def make_loader(spec: LoaderSpec, seed: int = 0, cache_dir: str | None = None,
                shuffle_default: bool = True) -> Loader:
  """Builds the loader a `defloader` declares.

  Args:
    spec: the declaration: name, kind, evaluated arguments, base directory.
    seed: the run's seed; every record is a pure function of it, the
      arguments and the record's position.
    cache_dir: the cache root for remote files (`<cache_dir>/data/`);
      None means `SEXPGPU_CACHE_DIR` or `~/.cache/sexpgpu`.
    shuffle_default: whether file loaders shuffle when `:shuffle` is not
      written (true for training, false for passes).

  Returns:
    The loader, at position 0.

  Raises:
    SxError: E-FORM-001 for an unknown kind, a missing or ill-typed
      argument; E-FORM-002 for an unknown keyword; E-LOAD-001 … 004 for bad
      or unreachable data.
  """
  if spec.kind not in KINDS:
    hint = did_you_mean(spec.kind, KINDS)
    raise SxError("E-FORM-001", f"loader `{spec.name}`: unknown loader kind `{spec.kind}`",
                  location=spec.location,
                  fix=(hint + " " if hint else "") + "kinds: " + " ".join(KINDS))
  decl = KINDS[spec.kind]
  ctx = Context(seed=seed, cache_dir=cache_dir, shuffle_default=shuffle_default,
                make=lambda sub: make_loader(sub, seed, cache_dir, shuffle_default))
  loader = decl.builder(spec, bind_args(spec, decl), ctx)
  check_fields(spec, loader.fields)
  return loader
