"""Generated from the loaders' own tables: `defloader` (check) takes exactly what the loader (run) binds."""

import pytest

from sexpgpu.data import KINDS, LoaderSpec, keywords, takes_file
from sexpgpu.data.spec import bind_args
from sexpgpu.errors import SxError
from sexpgpu.front.experiment import LOADER_KINDS
from sexpgpu.run.compile import compile_source

# A value of each keyword that every loader taking it accepts; a new keyword needs one here.
SAMPLE = {"vocab": "16", "seq": "9", "batch": "2", "seed": "3", "branching": "2", "stream": "1",
          "digits": "2", "shuffle": "true", "split": "[0 1]", "dtype": "u16", "stride": "4",
          "fields": "[x y]", "pack": "docs", "offsets": "fixed", "tokenizer": '"tok.json"',
          "train-on": "all", "split-by": "tokens"}
EVERY = sorted({k for kind in KINDS for k in keywords(kind)})
PAIRS = [(kind, k) for kind in KINDS for k in EVERY]


def _source(kind: str, extra: str) -> str:
  table = KINDS[kind]
  parts = [kind] + (['"missing.bin"'] if takes_file(kind) else [])
  if "components" in table.required:
    parts += ["(0.5 a)", "(0.5 b)"]
  parts += [f":{k} {SAMPLE[k]}" for k in keywords(kind) if k in table.required]
  return ("(defloader a (copy :vocab 16 :seq 9 :batch 2))\n"
          "(defloader b (copy :vocab 16 :seq 9 :batch 2))\n"
          f"(defloader d ({' '.join(parts)}{extra}))\n"
          "(defn loss [batch] (sum (param w [2] :init (normal 0.02))))\n"
          "(defrun :loss loss :data d :steps 1 :optimizer (adamw :lr 0.01))\n")


def _compile_error(src: str) -> SxError | None:
  try:
    compile_source(src, "keywords.sx")
  except SxError as e:
    return e
  return None


def test_the_front_reads_the_loaders_tables():
  assert set(LOADER_KINDS) == set(KINDS)
  for kind in KINDS:
    assert LOADER_KINDS[kind] == keywords(kind)
  assert set(EVERY) <= set(SAMPLE), "give the new keyword a SAMPLE value"


@pytest.mark.parametrize("kind,key", PAIRS)
def test_check_and_run_agree_on_each_keyword(kind, key):
  required = key in KINDS[kind].required
  extra = "" if required else f" :{key} {SAMPLE[key]}"
  err = _compile_error(_source(kind, extra))
  spec = LoaderSpec("d", kind, {key: SAMPLE[key]} | ({"path": "x"} if takes_file(kind) else {}))
  try:
    bind_args(spec, KINDS[kind])
    run_refuses = False
  except SxError as e:
    run_refuses = e.code == "E-FORM-002"
  if key in keywords(kind):
    assert not run_refuses
    # accepted: it compiles, or fails past the keywords (a missing file for the file kinds)
    assert err is None or err.code == ("E-LOAD-001" if takes_file(kind) else None), err
  else:
    assert run_refuses
    assert err is not None and err.code == "E-FORM-002" and f":{key}" in str(err), err
