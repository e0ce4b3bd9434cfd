"""`sexpgpu export | import | sample | eval`: flags and output; the work is in sexpgpu.models."""

from __future__ import annotations

import json
import sys

from absl import flags

from sexpgpu import env
from sexpgpu.cli.main import parse_flags, selection_flags, parse_sets, python_trust
from sexpgpu.errors import SxError
from sexpgpu.lang.blame import guarded
from sexpgpu.run import output


def _compile(path: str, fv, command: str = "sexpgpu"):
  """The experiment `path` names, compiled as `run` compiles it: a bundle's own experiment
  and selection (its Python only with --trust-python), a file's with its own folder's."""
  from sexpgpu.run.compile import compile_file
  from sexpgpu.tools.bundle import bundle_hints, bundle_selection
  given, variant, sets = path, fv.variant, parse_sets(fv.set)
  if given.endswith(".sxb"):  # a --set given here wins over the bundle's
    path, variant, sets = bundle_selection(given, variant, sets)
  with python_trust(fv.trust_python, given.endswith(".sxb"), command), bundle_hints(given):
    return guarded(path, variant, sets, {}, None,
                   lambda: compile_file(path, variant, sets, {}, None))


def _checkpoint_flags(fv: flags.FlagValues) -> None:
  selection_flags(fv)
  flags.DEFINE_string("resume", None, "the checkpoint: a step folder, a run folder, s3://... "
                      "or latest (with --checkpoint-dir)", flag_values=fv)
  flags.DEFINE_string("checkpoint_dir", None, "where `--resume latest` looks "
                      "(SEXPGPU_CHECKPOINT_DIR)", flag_values=fv)


def _restored(path: str, fv, command: str):
  """The compiled experiment, its checkpoint's parameters and meta (E-CKPT-002 if another's)."""
  from sexpgpu.models import source
  if not fv.resume:
    raise SxError("E-FORM-001", f"sexpgpu {command} needs --resume (the checkpoint)",
                  where="the command line",
                  fix=f"sexpgpu {command} {path} --resume runs/<slug>/<step> ...")
  c = _compile(path, fv, f"sexpgpu {command}")
  where = fv.checkpoint_dir if fv.checkpoint_dir is not None else env.get(
      "SEXPGPU_CHECKPOINT_DIR")
  step_dir = source.step_dir_of(fv.resume, where, c.slug)
  params, meta = source.checkpoint_params(step_dir)
  source.check_experiment(c, meta, step_dir)
  return c, params, meta


def _one(rest: list[str], command: str, usage: str) -> str:
  if len(rest) != 1:
    raise SxError("E-FORM-001", f"sexpgpu {command} takes one experiment file, given "
                  f"{len(rest)}", where="the command line", fix=usage)
  return rest[0]


# --- export --------------------------------------------------------------------------------

def cmd_export(argv: list[str]) -> int:
  """`sexpgpu export FILE.sx --resume DIR -o OUT [--format safetensors|hf|peft]`."""
  from sexpgpu.models import export, sample
  fv = flags.FlagValues()
  _checkpoint_flags(fv)
  flags.DEFINE_string("output", None, "the .safetensors file, or the hf folder", short_name="o",
                      flag_values=fv)
  flags.DEFINE_enum("format", "safetensors", list(export.FORMATS), "what to write",
                    flag_values=fv)
  flags.DEFINE_string("tokenizer", None, "a tokenizer.json to put in the hf folder (default: "
                      "the text loader's)", flag_values=fv)
  flags.DEFINE_bool("merge_lora", False, "fold each LoRA adapter into its base weight "
                    "(W + alpha/rank·A·B) and write the base model's parameters only",
                    flag_values=fv)
  usage = "sexpgpu export my-run.sx --resume runs/my-run/100 -o model/ --format hf"
  path = _one(parse_flags(fv, argv, "export"), "export", usage)
  if not fv.output:
    raise SxError("E-FORM-001", "sexpgpu export needs -o OUT", where="the command line",
                  fix=usage)
  c, params, meta = _restored(path, fv, "export")
  tok = fv.tokenizer
  if tok is None and fv.format == "hf":
    found = sample.tokenizer_path(c)
    tok = found
  written = export.export(c, params, meta, fv.output, fv.format, tokenizer=tok,
                          merge_lora=fv.merge_lora)
  sys.stderr.write(f"export: step {meta.get('step')} of {meta.get('slug')} as {fv.format}: "
                   + ", ".join(written) + "\n")
  return 0


# --- import --------------------------------------------------------------------------------

def cmd_import(argv: list[str]) -> int:
  """`sexpgpu import HF_DIR -o CKPT_DIR FILE.sx [--allow-nonfinite]`: a step-0 checkpoint of
  FILE.sx; NaN or infinity in the folder's tensors or config.json is E-INIT-001 unless
  --allow-nonfinite."""
  from sexpgpu.models import export, source
  fv = flags.FlagValues()
  selection_flags(fv)
  flags.DEFINE_string("output", None, "the checkpoint location (the step is <it>/<slug>/0)",
                      short_name="o", flag_values=fv)
  flags.DEFINE_bool("allow_nonfinite", False, "import tensors and a config.json holding NaN "
                    "or infinity (refused otherwise: such a model cannot train)",
                    flag_values=fv)
  usage = "sexpgpu import hf-model/ -o runs/ my-run.sx"
  rest = parse_flags(fv, argv, "import")
  if len(rest) != 2 or not fv.output:
    raise SxError("E-FORM-001", "sexpgpu import takes a Hugging Face folder, -o CKPT_DIR and "
                  "the experiment file", where="the command line", fix=usage)
  folder, path = rest
  c = _compile(path, fv, "sexpgpu import")
  params = source.twin_params(
      c, folder, folder, "sexpgpu import",
      lambda g, problems: SxError(
          "E-INIT-001", f"{folder} does not fit {c.program.path}: " + "; ".join(problems),
          where=folder, fix=f"import into an experiment whose {g.kind} has the folder's shape "
          "(the values of its config.json, set as knobs)"),
      allow_nonfinite=fv.allow_nonfinite)
  if not fv.allow_nonfinite:
    source.refuse_nonfinite(params, folder, folder,
                            fix="import a folder of finite weights, or pass --allow-nonfinite "
                            "to import these as they are")
  step_dir = export.write_step0(c, params, fv.output)
  sys.stderr.write(f"import: {folder} → {step_dir} (step 0 of {c.slug}); train from it with "
                   f"sexpgpu run {path} --resume {step_dir}\n")
  return 0


# --- sample --------------------------------------------------------------------------------

def cmd_sample(argv: list[str]) -> int:
  """`sexpgpu sample FILE.sx --resume DIR --prompt TEXT [--tokens N] ...`."""
  from sexpgpu.models import sample, source
  fv = flags.FlagValues()
  _checkpoint_flags(fv)
  flags.DEFINE_string("fn", None, "the function of the tokens that returns logits",
                      flag_values=fv)
  flags.DEFINE_string("prompt", None, "the prompt: text, or token ids separated by spaces",
                      flag_values=fv)
  flags.DEFINE_string("prompt_file", None, "read the prompt from this file", flag_values=fv)
  flags.DEFINE_integer("tokens", 200, f"how many tokens to write (1 to {sample.MAX_TOKENS})",
                       flag_values=fv)
  flags.DEFINE_float("temperature", 0.8, "0 is greedy; at most 100", flag_values=fv)
  flags.DEFINE_integer("top_k", 0, "keep the k likeliest tokens (0: all)", flag_values=fv)
  flags.DEFINE_float("top_p", 1.0, "keep the likeliest tokens holding this mass (0 to 1]",
                     flag_values=fv)
  flags.DEFINE_integer("seed", 0, "the sampling seed (32 bits): the same continuation every "
                       "run", flag_values=fv)
  flags.DEFINE_string("tokenizer", None, "a tokenizer.json (default: the text loader's cache's)",
                      flag_values=fv)
  flags.DEFINE_bool("json", False, "print ids, text and tokens/s as one JSON line",
                    flag_values=fv)
  flags.DEFINE_bool("no_echo", False, "print the continuation alone, not the prompt before it",
                    flag_values=fv)
  flags.DEFINE_enum("window", None, ["recompute"], "recompute: past a position table or an "
                    "attention window, slide the window (each token recomputed from the last "
                    "window of tokens)", flag_values=fv)
  usage = 'sexpgpu sample my-run.sx --resume runs/my-run/100 --prompt "Once upon"'
  path = _one(parse_flags(fv, argv, "sample"), "sample", usage)
  if (fv.prompt is None) == (fv.prompt_file is None):
    raise SxError("E-FORM-001", "sexpgpu sample takes --prompt TEXT or --prompt-file FILE",
                  where="the command line", fix=usage)
  # The flags and the prompt file first: a refusal costs no compile.
  settings = sample.Settings(fv.tokens, fv.temperature, fv.top_k, fv.top_p, fv.seed)
  sample.check_settings(settings)
  text = fv.prompt if fv.prompt_file is None else sample.read_prompt(fv.prompt_file)
  c, params, meta = _restored(path, fv, "sample")
  fn = fv.fn or source.default_fn(c)
  tok = sample.tokenizer_of(c, fv.tokenizer)
  prompt = sample.encode_prompt(tok, text) if tok is not None else sample.parse_ids(text)
  result = sample.generate(c, fn, params, prompt, settings, fv.window)
  words = tok.decode(result.ids) if tok is not None else " ".join(map(str, result.ids))
  how = result.path + (f" decoding ({result.reason})" if result.reason else " decoding")
  note = f"sample: {how}; {len(result.ids)} tokens, {result.tokens_per_s:.1f} tokens/s\n"
  if fv.json:
    output.write(sys.stdout, json.dumps(
        {"prompt_ids": prompt, "ids": result.ids, "text": words, "tokens_per_s":
         round(result.tokens_per_s, 3), "path": result.path, "step": meta.get("step")},
        separators=(",", ":")) + "\n")
  else:  # the prompt, as the tokenizer renders it, then the continuation (nanoGPT's way)
    output.write(sys.stdout, (words if fv.no_echo else sample.echoed(tok, prompt, result.ids))
                 + "\n")
  sys.stderr.write(note)
  return 0


def cmd_eval(argv: list[str]) -> int:
  """`sexpgpu eval FILE.sx --resume DIR [--tasks A.jsonl,B.jsonl] [--json]`."""
  from sexpgpu.models import evaluate, sample, source
  from sexpgpu.run.evaluating import Evaluators
  fv = flags.FlagValues()
  _checkpoint_flags(fv)
  flags.DEFINE_list("tasks", None, "task files (.jsonl) to score instead of the experiment's "
                    "defevals", flag_values=fv)
  flags.DEFINE_string("fn", None, "with --tasks: the function of the tokens that returns "
                      "logits (default: the defeval's, else the only candidate)", flag_values=fv)
  flags.DEFINE_string("tokenizer", None, "with --tasks: a tokenizer.json (default: the "
                      "defeval's, else the text loader's cache's)", flag_values=fv)
  flags.DEFINE_integer("batch", 8, f"with --tasks: rows a call (1 to {evaluate.MAX_BATCH}, "
                       "and what the device's memory holds)", flag_values=fv)
  flags.DEFINE_integer("limit", None, "with --tasks: the first documents of each task",
                       flag_values=fv)
  flags.DEFINE_bool("json", False, "print the scores as one JSON object", flag_values=fv)
  usage = "sexpgpu eval my-run.sx --resume runs/my-run/100 [--tasks data/choice.jsonl]"
  path = _one(parse_flags(fv, argv, "eval"), "eval", usage)
  # The flags and the task files first: a refusal costs no compile.
  if not 1 <= fv.batch <= evaluate.MAX_BATCH:
    raise SxError("E-FORM-001", f"--batch is {fv.batch}; it takes 1 to {evaluate.MAX_BATCH}",
                  where="--batch", fix=f"give --batch 1 to {evaluate.MAX_BATCH} rows a call "
                  "(8 by default; the device's memory may hold fewer)")
  if fv.limit is not None and fv.limit < 1:
    raise SxError("E-FORM-001", f"--limit is {fv.limit}; it takes 1 or more documents",
                  where="--limit", fix="give --limit 1 or more, or leave it out for every "
                  "document")
  tasks = [evaluate.load_task(t, fv.limit) for t in fv.tasks or ()]
  c, params, meta = _restored(path, fv, "eval")
  jobs = []  # (eval name, scorer, task)
  if fv.tasks:
    decls = list(c.exp.evals.values())
    fn = fv.fn or (decls[0].fn if len({d.fn for d in decls}) == 1 else source.default_fn(c))
    tok = sample.tokenizer_of(c, fv.tokenizer or (decls[0].tokenizer if len(decls) == 1
                                                  else None))
    if tok is None:
      raise SxError("E-EVAL-002", "sexpgpu eval has no tokenizer: the experiment reads no "
                    "text loader's token cache", where="--tokenizer",
                    fix="pass --tokenizer FILE (a tokenizer.json)")
    scorer = evaluate.Scorer(c, fn, tok, batch=fv.batch)
    jobs = [("eval", scorer, task) for task in tasks]
  else:
    if not c.exp.evals:
      raise SxError("E-FORM-001", f"{path} has no defeval, and no --tasks were given",
                    where="--tasks", fix=usage)
    jobs = [(e.decl.name, e.scorer, t) for e in Evaluators(c).items for t in e.tasks]
  scores, rows = {}, []
  for name, scorer, task in jobs:
    res = scorer.score(params, task)
    got = {f"{name}/{task.name}/{k}": v for k, v in res.metrics.items()}
    scores.update(got)
    rows.append({"eval": name, "task": task.name, "kind": task.kind, "metrics": got,
                 "documents": len(res.docs), "skipped_lines": res.skipped,
                 "requests": res.requests, "rows": res.rows, "packed": scorer.packed})
  if fv.json:
    output.write(sys.stdout, json.dumps({"step": meta.get("step"), "metrics": scores,
                                         "tasks": rows}, separators=(",", ":")) + "\n")
  else:
    width = max(map(len, scores))
    output.write(sys.stdout, "".join(f"{k:<{width}}  {v:.6f}\n" for k, v in scores.items()))
  for r in rows:
    if r["skipped_lines"]:
      sys.stderr.write(f"eval: {r['task']}: {len(r['skipped_lines'])} documents longer than "
                       f"the window skipped (lines {', '.join(map(str, r['skipped_lines']))})\n")
  return 0


def cmd_generate(argv: list[str]) -> int:
  """`sexpgpu generate FILE.sx --resume CKPT [--fn F] [--seed S] -o OUT.npz`."""
  from sexpgpu.models import generate
  fv = flags.FlagValues()
  _checkpoint_flags(fv)
  flags.DEFINE_string("fn", None, "the defgenerate (or its function) to run (default: the "
                      "only one)", flag_values=fv)
  flags.DEFINE_integer("seed", None, "the key of the draws (default: the defgenerate's :seed)",
                       flag_values=fv)
  flags.DEFINE_string("output", None, "the .npz to write (a PNG grid beside it for images)",
                      short_name="o", flag_values=fv)
  usage = "sexpgpu generate my-run.sx --resume runs/my-run/100 -o samples.npz"
  path = _one(parse_flags(fv, argv, "generate"), "generate", usage)
  if not fv.output:
    raise SxError("E-FORM-001", "sexpgpu generate needs -o OUT.npz", where="the command line",
                  fix=usage)
  if fv.seed is not None and not 0 <= fv.seed < 2**32:
    raise SxError("E-FORM-001", f"--seed is {fv.seed}; it takes 0 to {2**32 - 1}",
                  where="--seed", fix="give --seed a 32-bit seed (0 to 4294967295)")
  c, params, meta = _restored(path, fv, "generate")
  d = generate.decl(c, fv.fn)
  fn = d.fn if d is not None else fv.fn
  seed = fv.seed if fv.seed is not None else (d.seed if d is not None else 0)
  outputs = generate.run(c, fn, params, seed)
  written = generate.write(outputs, fv.output)
  shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items())
  sys.stderr.write(f"generate: ({fn}) at step {meta.get('step')}, seed {seed}: {shapes}; "
                   + ", ".join(written) + "\n")
  return 0


COMMANDS = {"export": cmd_export, "import": cmd_import, "sample": cmd_sample, "eval": cmd_eval,
            "generate": cmd_generate}
