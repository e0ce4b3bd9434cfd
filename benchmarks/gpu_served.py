"""On a GPU: what serves each attention of a run's train step, against `check --target cuda`.

For each configuration (FILE [VARIANT] [knob=value ...], `;`-separated on the command
line), the prediction is what `sexpgpu check --target cuda` reports (the step lowered
for CUDA with host devices standing in); the served kernels are what the same train
step chooses when it is compiled on the GPU itself (its probes then compile for real).
Prints one `PASS|FAIL served NAME: ...` line a configuration; exit 1 on any FAIL.

  python benchmarks/gpu_served.py "configs/gpt2-small.sx" "configs/gpt2-small.sx - precision=f32"
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _served(notes: list) -> list[str]:
  return sorted({n.get("kernel") or n["impl"] for n in notes if n.get("kind") == "attention"})


def _check(path: str, variant: str | None, sets: list[tuple[str, str]]) -> subprocess.Popen:
  """`sexpgpu check --target cuda` started as on a machine with no GPU (the CUDA platform
  hidden), so no probe of this GPU informs it; it runs on the CPU beside the GPU's work."""
  args = [sys.executable, "-m", "sexpgpu.cli.main", "check", path, "--target", "cuda"]
  args += (["--variant", variant] if variant else []) + [a for k, v in sets
                                                         for a in ("--set", f"{k}={v}")]
  env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
  return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def _prediction(p: subprocess.Popen) -> tuple[list, str]:
  out, err = p.communicate(timeout=200)
  if p.returncode != 0:
    raise RuntimeError(f"check --target cuda failed: {err.strip().splitlines()[:1]}")
  train = out.split("train step", 1)[1].split("\npass ", 1)[0]
  line = next((ln for ln in train.splitlines() if ln.strip().startswith("attention ")), "")
  kernels = line.split("→ ", 1)[1].split(" (", 1)[0].split(" + ") if "→ " in line else []
  return sorted(kernels), out


def predicted(path: str, variant: str | None, sets: list[tuple[str, str]]) -> tuple[list, str]:
  """What `sexpgpu check --target cuda` predicts: (kernels, the check's text)."""
  return _prediction(_check(path, variant, sets))


def _parse(spec: str):
  words = spec.split()
  path, variant = words[0], (words[1] if len(words) > 1 and words[1] != "-" else None)
  sets = [tuple(w.split("=", 1)) for w in words[2:]]
  return path, variant, sets, " ".join(w for w in words if w != "-")


def one(spec: str, check: subprocess.Popen) -> bool:
  """Compiles one configuration on the GPU, against its running check; prints its PASS/FAIL
  line."""
  from sexpgpu.run.compile import compile_file
  from sexpgpu.run.backend import open_devices
  from sexpgpu.run.training import build
  path, variant, sets, name = _parse(spec)
  t0 = time.perf_counter()
  want, check_text = _prediction(check)
  c = compile_file(path, variant, sets, None, None)
  k = int(c.exp.run["microbatches"])
  # what serves: the step built on this GPU and compiled here (its probes compile for real)
  training = build(c, open_devices("cuda", None))
  step = training.step(0, k)
  compiled = step.compile(training.abstract_state(), training.abstract_batches(
      c.stages[0].data, (k,)))
  served = _served(step.notes)
  ok = served == want
  text = compiled.as_text() or ""
  print(f"{'PASS' if ok else 'FAIL'} served {name}: {'+'.join(served) or 'none'} "
        f"(predicted {'+'.join(want) or 'none'}; the compiled step names cuDNN fmha "
        f"{text.count('__cudnn$fmha')}x, triton {text.count('triton')}x; "
        f"{time.perf_counter() - t0:.0f} s)", flush=True)
  why = sorted({n["why"] for n in step.notes if n.get("kind") == "attention" and n["why"]})
  if why:
    print(f"  why: {'; '.join(why)}", flush=True)
  if not ok:
    print("  check --target cuda said:\n" + "\n".join("    " + ln for ln in
                                                       check_text.splitlines()), flush=True)
  return ok


def main(argv: list[str]) -> int:
  ok = True
  checks = {spec: _check(*_parse(spec)[:3]) for spec in argv}  # all on the CPU at once
  for spec in argv:
    try:
      ok = one(spec, checks[spec]) and ok
    except Exception as e:  # a configuration that fails to build is a FAIL line, not a stop
      print(f"FAIL served {spec}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
            flush=True)
      ok = False
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
