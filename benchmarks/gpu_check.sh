#!/usr/bin/env bash
# The GPU machine's check, for a 15-minute lease of one H100 or H200: one command, one report.
#
# Expected duration on one H100/H200 with the [cuda] extra installed: about 7 minutes, nearly
# all of it XLA compiling the six runs' steps; the time limits of the steps sum to
# 30+30+120+2*60+2*90+3*30 = 570 s, under the 10 minutes it promises. Installing the extra,
# when it is missing, adds at most 120 s (GPU_CHECK_INSTALL=0: stop instead).
#
#   0. setup     sexpgpu and the CUDA plugin importable; `pip install -e .[cuda]` when not
#   1. doctor    sexpgpu doctor --device cuda
#   2. lowering  `check --target cuda --gpu G` of gpt2-small in bf16 and in fp8 (the
#                attention kernel, the float8 products), and the paper plan of each of the
#                four runs below (`--devices 1`): memory and predicted step time
#   3. runs      30 timed steps each of gpt2-small and of a 1B llama (configs/tinyllama.sx) at
#                seq 4096, in bf16 and in fp8: tokens/s, MFU, the measured step beside the
#                plan's prediction, peak memory against the plan, the attention kernel served
#   4. resume    SEXPGPU_DETERMINISTIC=1: a run killed (SIGKILL) after a checkpoint, resumed,
#                and its losses from there bitwise equal to a straight run's
#
# Usage: benchmarks/gpu_check.sh [--dry] [--gpu H100|H200] [--steps N] [OUT_DIR]
#   --dry (or GPU_CHECK_DRY=1): end to end on the CPU with tiny stand-ins (the configs' smoke
#   variants cut to one layer, one microbatch, 16 tokens of width 64 and a 512-token
#   vocabulary; 3 steps, a resume of 8; no install, no time limits), for the tests that keep
#   its arguments and its report's format honest.
# Writes OUT_DIR/report.txt (and each step's own output beside it); exit 0 when nothing
# FAILed, 1 when something did, 2 for arguments it does not take.
# The interpreter: $PYTHON, else the checkout's .venv/bin/python, else python3.
set -u -o pipefail

usage() { echo "usage: benchmarks/gpu_check.sh [--dry] [--gpu H100|H200] [--steps N] [OUT_DIR]" >&2; exit 2; }
DRY="${GPU_CHECK_DRY:-0}"
GPU=H100
STEPS=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) DRY=1 ;;
    --gpu) [ $# -ge 2 ] || usage; GPU="$(echo "$2" | tr a-z A-Z)"; shift ;;
    --gpu=*) GPU="$(echo "${1#--gpu=}" | tr a-z A-Z)" ;;
    --steps) [ $# -ge 2 ] || usage; STEPS="$2"; shift ;;
    -h|--help) usage ;;
    -*) echo "gpu_check.sh: unknown flag $1" >&2; usage ;;
    *) [ -z "$OUT" ] || usage; OUT="$1" ;;
  esac
  shift
done
case "$GPU" in
  H100|H200) ;;
  *) echo "gpu_check.sh: --gpu $GPU: this check is sized for one H100 or H200 (FP8 needs compute capability 8.9 or newer)" >&2; exit 2 ;;
esac
case "$DRY" in 0|1) ;; *) echo "gpu_check.sh: GPU_CHECK_DRY=$DRY: 0 or 1" >&2; exit 2 ;; esac
if [ -z "$STEPS" ]; then STEPS=$([ "$DRY" = 1 ] && echo 3 || echo 30); fi
case "$STEPS" in ''|*[!0-9]*|0) echo "gpu_check.sh: --steps $STEPS: a whole number above 0" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
export SEXPGPU_CACHE_DIR="${SEXPGPU_CACHE_DIR:-$OUT/cache}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SX=("$PY" -m sexpgpu.cli.main)
REPORT="$OUT/report.txt"
FAILED=0
T_ALL=$(date +%s)
say() { echo "$@" | tee -a "$REPORT"; }
fail() { say "FAIL $1"; FAILED=1; }
# the step's time limit on a GPU; none in the dry mode (a loaded CPU sets no pace)
lim() { if [ "$DRY" = 1 ]; then echo 3600; else echo "$1"; fi; }

if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  # the smallest models that still take every path of the report (attention, float8
  # products, plans, runs, a resume): the compile is the dry mode's cost, and one layer and
  # one microbatch (a quarter of the kernels) make it the least it can be
  TINY=(--variant smoke --set vocab=512 --set layers=1 --set microbatches=1 --set seq=16
        --set width=64 --set heads=2)
  GPT2=(configs/gpt2-small.sx "${TINY[@]}")
  LLAMA=(configs/tinyllama.sx "${TINY[@]}" --set kv-heads=1 --set hidden=128)
else
  DEVICE=cuda
  GPT2=(configs/gpt2-small.sx)
  LLAMA=(configs/tinyllama.sx --set seq=4096 --set context=4096 --set batch=2)
fi
: >"$REPORT"
say "# sexpgpu gpu_check report (format 1)"
say "mode: $([ "$DRY" = 1 ] && echo dry || echo gpu), target $GPU, device $DEVICE, $STEPS steps a run, $(date -u +%Y-%m-%dT%H:%M:%SZ)"

# 0. setup: sexpgpu and the CUDA plugin importable by $PY (the dry mode needs no plugin)
HAS_CUDA='import importlib.util as u, sys, sexpgpu, jax
def found(name):
  try:
    return u.find_spec(name) is not None
  except ImportError:  # its parent package (jax_plugins) is not there either
    return False
print("jax", jax.__version__)
sys.exit(0 if sys.argv[1] == "1" or found("jax_plugins.xla_cuda13") or found("jax_cuda13_plugin") else 3)'
JAXV=$(timeout "$(lim 30)" "$PY" -c "$HAS_CUDA" "$DRY" 2>"$OUT/setup.err"); rc=$?
if [ "$rc" = 3 ] && [ "${GPU_CHECK_INSTALL:-1}" = 1 ]; then
  timeout 120 "$PY" -m pip install -q -e "$ROOT[cuda]" >"$OUT/install.txt" 2>&1 ||
    say "WARN setup: pip install -e .[cuda] failed: $(tail -2 "$OUT/install.txt" | tr '\n' ' ')"
  JAXV=$(timeout 30 "$PY" -c "$HAS_CUDA" "$DRY" 2>"$OUT/setup.err"); rc=$?
fi
case $rc in
  0) say "PASS setup: $PY, $JAXV$([ "$DRY" = 1 ] && echo ' (dry: on the CPU)' || echo ' and its CUDA plugin')" ;;
  124) fail "setup: importing sexpgpu and jax with $PY took over 30 s — fix: run it again on a machine that is not loaded, or PYTHON=/path/to/python"; exit 1 ;;
  3) fail "setup: $PY has sexpgpu but not the CUDA plugin — fix: $PY -m pip install -e '.[cuda]' (GPU_CHECK_INSTALL=0 stopped the install)"; exit 1 ;;
  *) fail "setup: $PY cannot import sexpgpu and jax ($(tail -1 "$OUT/setup.err")) — fix: $PY -m pip install -e '.[cuda]', or PYTHON=/path/to/python"; exit 1 ;;
esac

# 1. doctor
if timeout "$(lim 30)" "${SX[@]}" doctor --device "$DEVICE" >"$OUT/doctor.txt" 2>&1; then
  say "PASS doctor: $(grep -c '^ok' "$OUT/doctor.txt") ok, $(grep -c '^warn' "$OUT/doctor.txt") warn (--device $DEVICE)"
else
  fail "doctor: $(grep '^fail' "$OUT/doctor.txt" | head -3 | tr '\n' ' ')"
fi

# 2. the lowering report of gpt2-small (bf16, fp8) and the four runs' paper plans, in one
#    process (each config compiled once)
NAMES=("gpt2-small bf16" "gpt2-small fp8" "llama-1b bf16" "llama-1b fp8")
ARGS=("${GPT2[*]} --set precision=bf16" "${GPT2[*]} --set precision=fp8"
      "${LLAMA[*]} --set precision=bf16" "${LLAMA[*]} --set precision=fp8")
timeout "$(lim 120)" "$PY" - "$GPU" "$OUT" "${ARGS[@]}" >"$OUT/lowering.txt" 2>"$OUT/lowering.err" <<'PY'
import sys
from sexpgpu.errors import SxError
from sexpgpu.run.check import CheckOptions, check

gpu, out, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
def parse(text):
  words = text.split()
  path, variant, sets = words[0], None, []
  for flag, value in zip(words[1::2], words[2::2]):
    if flag == "--variant":
      variant = value
    else:
      sets.append(tuple(value.split("=", 1)))
  return path, variant, sets
for i, config in enumerate(configs):
  path, variant, sets = parse(config)
  try:
    if i < 2:
      print(f"LOWERING {i}")
      print(check(path, variant, sets, opts=CheckOptions(target="cuda", gpu=gpu)), end="")
    print(f"PLAN {i}")
    print(check(path, variant, sets, opts=CheckOptions(target="cuda", gpu=gpu, devices=1)),
          end="")
  except SxError as e:
    print(f"ERROR {i} {e.code}: {e.message}")
PY
rc=$?
"$PY" - "$OUT/lowering.txt" "$rc" "${NAMES[@]}" <<'PY' | tee -a "$REPORT" || FAILED=1
import re, sys
text, rc, names = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3:]
blocks = re.split(r"^(LOWERING|PLAN|ERROR) (\d+)\n?", text, flags=re.M)[1:]
ok = rc == "0" and not any(k == "ERROR" for k in blocks[0::3])
plans = {}
for kind, i, body in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
  name = names[int(i)]
  if kind == "LOWERING":
    print(f"LOWERING {name}")
    print("\n".join("  " + ln for ln in body.rstrip().splitlines()))
  elif kind == "PLAN":
    est = re.search(r"estimate\s+step ([\d.]+) (µs|ms), ([\d,]+) tokens/s a GPU, MFU (\d+)%",
                    body)
    mem = re.search(r"memory\s+([\d.]+ [KMG]iB) a device", body)
    if est is None:
      ok = False
      print(f"FAIL plan {name}: no estimate in the plan")
      continue
    # in ms as the runs' lines read it (a dry stand-in's step is in µs)
    step = est[1] if est[2] == "ms" else f"{float(est[1]) / 1e3:g}"
    print(f"PLAN {name}: step {step} ms, {est[3]} tokens/s, MFU {est[4]}%, memory "
          f"{mem[1] if mem else '-'}")
  else:
    print(f"FAIL lowering {name}: {body.strip()}")
if rc != "0":
  print(f"FAIL lowering: exit {rc}")
sys.exit(0 if ok else 1)
PY
grep -q "→ cudnn\|→ xla\|→ pallas" "$OUT/lowering.txt" && say "PASS lowering: the attention kernel and the fp8 products reported" || fail "lowering: no attention line ($(tail -2 "$OUT/lowering.err" | tr '\n' ' '))"

# 3. the runs: 30 timed steps each, read from the run's own metrics
run_one() {  # name, time limit, config args...
  local name="$1" limit="$2"; shift 2
  local tag="${name// /-}"
  local t0; t0=$(date +%s)
  timeout "$(lim "$limit")" "${SX[@]}" run "$@" --device "$DEVICE" --steps "$STEPS" --eval-every 0 \
    --metrics "jsonl:$OUT/$tag.jsonl" >"$OUT/$tag.out" 2>"$OUT/$tag.err"
  local rc=$?
  "$PY" - "$OUT/$tag.jsonl" "$name" "$STEPS" "$rc" "$(( $(date +%s) - t0 ))" "$REPORT" <<'PY' | tee -a "$REPORT" || FAILED=1
import json, os, re, statistics, sys
path, name, want, rc, wall, report = sys.argv[1:]
ev = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
steps = [e for e in ev if e["kind"] == "step"]
late = [e for e in steps if e["step"] > min(5, int(want) - 1)] or steps
med = lambda key: statistics.median(v for e in late if (v := e.get(key))) if any(
    e.get(key) for e in late) else None
tps, mfu, secs = med("throughput/tokens-per-second"), med("throughput/mfu"), med("time/step")
ann = {e.get("name"): e for e in ev if e["kind"] == "annotation"}
low = ann.get("lowering", {}).get("text", "")
att = re.search(r"attention\s+\d+ regions? → (.+?)(?: \(|:|$)", low, re.M)
peak, plan = ann.get("memory peak", {}).get("peak"), ann.get("memory", {}).get("total")
planned = re.search(rf"^PLAN {re.escape(name)}: step ([\d.]+) ms", open(report).read(), re.M)
gib = lambda b: f"{b / 2**30:.2f} GiB" if b else "-"
ok = rc == "0" and len(steps) == int(want) and tps is not None
pred = float(planned[1]) if planned else None
ratio = f"{secs * 1e3 / pred:.2f}" if secs and pred else "-"
print(f"{'PASS' if ok else 'FAIL'} run {name}: {len(steps)} steps, "
      + (f"{tps:.0f} tokens/s" if tps else "- tokens/s") + ", "
      + (f"MFU {100 * mfu:.1f}%" if mfu else "MFU -") + ", "
      + (f"step {secs * 1e3:.1f} ms" if secs else "step -")
      + f" (plan {pred if pred is not None else '-'} ms, measured/plan {ratio}), "
      + f"peak {gib(peak)} of {gib(plan)} planned, attention {att[1] if att else '-'}, "
      + (f"loss {steps[-1]['train/loss']:.4f}" if steps else "loss -")
      + f", {wall} s wall" + ("" if rc == "0" else f" (exit {rc})"))
sys.exit(0 if ok else 1)
PY
}
run_one "gpt2-small bf16" 60 "${GPT2[@]}" --set precision=bf16
run_one "gpt2-small fp8" 60 "${GPT2[@]}" --set precision=fp8
run_one "llama-1b bf16" 90 "${LLAMA[@]}" --set precision=bf16
run_one "llama-1b fp8" 90 "${LLAMA[@]}" --set precision=fp8

# 4. kill and resume: SIGKILL once a checkpoint is saved, a resume from the latest one saved,
#    and the losses from there on bitwise equal to a straight run's (cuDNN in the step on a GPU)
export SEXPGPU_DETERMINISTIC=1
if [ "$DRY" = 1 ]; then R_STEPS=8; R_MODEL=("${GPT2[@]}")  # the runs' stand-in
else R_STEPS=40; R_MODEL=(configs/gpt2-small.sx --variant smoke); fi
SMALL=("${R_MODEL[@]}" --set precision=bf16 --set checkpoint-every=2
       --device "$DEVICE" --eval-every 0 --steps "$R_STEPS")
timeout "$(lim 30)" "${SX[@]}" run "${SMALL[@]}" --checkpoint-dir "$OUT/ck-straight" \
  --metrics "jsonl:$OUT/straight.jsonl" >"$OUT/straight.out" 2>"$OUT/straight.err"
ok=$?
saved() {  # the killed run's complete checkpoints (a save cut short has no MANIFEST.json)
  for d in "$OUT"/ck-killed/*/[0-9]*; do [ -f "$d/MANIFEST.json" ] && basename "$d"; done | sort -n
}
# no `timeout` around it: the SIGKILL must reach the run itself, not a wrapper
"${SX[@]}" run "${SMALL[@]}" --checkpoint-dir "$OUT/ck-killed" \
  --metrics "jsonl:$OUT/killed.jsonl" >"$OUT/killed.out" 2>"$OUT/killed.err" &
PID=$!
KILLED=0
T_KILL=$(date +%s)
while kill -0 "$PID" 2>/dev/null; do  # until its first checkpoint is saved, or its time is up
  if [ -n "$(saved)" ] || [ $(( $(date +%s) - T_KILL )) -ge "$(lim 30)" ]; then
    kill -9 "$PID" 2>/dev/null && KILLED=1
    break
  fi
  sleep 0.05
done
{ wait "$PID"; } 2>/dev/null
# a run that ended before the kill landed is resumed from its first checkpoint instead
grep -q '^done:' "$OUT/killed.out" 2>/dev/null && KILLED=0
AT=$(saved | { [ "$KILLED" = 1 ] && tail -1 || head -1; })
STEPDIR=$(ls -d "$OUT"/ck-killed/*/"${AT:-none}" 2>/dev/null | head -1)
if [ -n "$STEPDIR" ]; then
  timeout "$(lim 30)" "${SX[@]}" run "${SMALL[@]}" --checkpoint-dir "$OUT/ck-resumed" \
    --resume "$STEPDIR" --metrics "jsonl:$OUT/resumed.jsonl" >"$OUT/resumed.out" \
    2>"$OUT/resumed.err" || ok=1
else
  ok=1
fi
"$PY" - "$OUT/straight.jsonl" "$OUT/resumed.jsonl" "$ok" "$KILLED" "${AT:--}" "$R_STEPS" <<'PY' | tee -a "$REPORT" || FAILED=1
import json, os, sys
a_path, b_path, rc, killed, at, total = sys.argv[1:]
def losses(p):
  if not os.path.exists(p):
    return {}
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(p)) if e["kind"] == "step"}
a, b = losses(a_path), losses(b_path)
both = sorted(set(a) & set(b))
good = (rc == "0" and at.isdigit() and bool(both) and both[0] == int(at) + 1
        and both[-1] == int(total)
        and all(a[s] == b[s] for s in both))
how = f"killed (SIGKILL) at its step-{at} checkpoint" if killed == "1" else \
    f"finished before the kill landed (resumed from its step-{at} checkpoint)"
print(f"{'PASS' if good else 'FAIL'} resume: {how}; "
      f"steps {both[0] if both else '-'}..{both[-1] if both else '-'} "
      + ("bitwise equal to the straight run's" if good else "differ or are missing"))
sys.exit(0 if good else 1)
PY

say "total: $(( $(date +%s) - T_ALL )) s"
exit $FAILED
