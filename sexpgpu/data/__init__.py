"""Data loaders: make_loader(spec) turns a `defloader` into a pure, resumable batch source."""

from __future__ import annotations

from sexpgpu.data import chat, files, mix, pairs, synthetic, text
from sexpgpu.data.base import Context, Loader
from sexpgpu.data.spec import LoaderSpec, bind_args, check_fields
from sexpgpu.errors import SxError, did_you_mean

__all__ = ["KINDS", "Loader", "LoaderSpec", "keywords", "make_loader", "takes_file"]

# Every loader kind and its class; the class's `arg_table` lists its keywords. A new loader
# is registered here and nowhere else: `defloader` (front/experiment.py), `check` and the
# language reference read its keywords from its table.
KINDS: dict[str, type[Loader]] = {
    "markov": synthetic.MarkovLoader,
    "copy": synthetic.TaskLoader,
    "reverse": synthetic.TaskLoader,
    "sort": synthetic.TaskLoader,
    "add": synthetic.AddLoader,
    "tokens": files.TokensLoader,
    "bytes": files.BytesLoader,
    "arrays": files.ArraysLoader,
    "mix": mix.MixLoader,
    "text": text.TextLoader,
    "chat": chat.ChatLoader,
    "pairs": pairs.PairsLoader,
}


# Table entries that are not `:keyword`s: a file kind's path is written first, a mix's
# components are its (WEIGHT LOADER) pairs.
POSITIONAL = ("path", "components")


def keywords(kind: str) -> tuple[str, ...]:
  """The `:keyword`s that loader `kind` takes, from its class's arg_table (required first)."""
  return tuple(k for k in KINDS[kind].arg_table.known() if k not in POSITIONAL)


def takes_file(kind: str) -> bool:
  """Whether loader `kind` reads a file (or s3:// URI) written before its keywords."""
  return "path" in KINDS[kind].arg_table.required


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
  cls = KINDS[spec.kind]
  ctx = Context(seed=seed, cache_dir=cache_dir, shuffle_default=shuffle_default,
                make=lambda sub: make_loader(sub, seed, cache_dir, shuffle_default))
  loader = cls(spec, bind_args(spec, cls.arg_table), ctx)
  check_fields(spec, loader.fields)
  return loader
