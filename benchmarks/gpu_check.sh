#!/usr/bin/env bash
# The GPU machine's check: one command, under 10 minutes on one H100/H200 card (the
# timeouts of a one-card machine sum to 15+30+20+240+120+2*50+40+15 = 580 s; a second
# card adds the fsdp step's 2*90 s). Each step prints `PASS|FAIL|WARN <step>: ...`:
#   0. setup         sexpgpu and the CUDA plugin importable (else it stops at once)
#   1. doctor        sexpgpu doctor --device cuda
#   2. served        for gpt2-small bf16, gpt2-small f32 and packed documents bf16: what
#                    serves each attention once the train step compiles on this GPU equals
#                    what `check --target cuda` predicts with the GPU hidden
#                    (benchmarks/gpu_served.py)
#   3. run20         20 steps of gpt2-small bf16: tokens/s and MFU (median of steps 6..20),
#                    the lowering report, `memory: peak X of Y planned` within 10%
#   4. resume        SEXPGPU_DETERMINISTIC=1 with cuDNN in the step (smoke, bf16): 6 steps
#                    straight against 3 + a resume, steps 4..6 bitwise equal
#   5. cpu-on-gpu    a --device cpu run with a pass on this GPU host (CPU rules throughout)
#   6. fsdp          :sharding fsdp against replicate over two cards (when there are two)
# Usage: benchmarks/gpu_check.sh [OUT_DIR]. Exit 0 when nothing FAILed.
# The interpreter: $PYTHON, else the checkout's .venv/bin/python, else python3. It needs
# sexpgpu and the CUDA plugin (pip install -e ".[cuda]"); without them the check stops at
# once with a FAIL setup line, so no device time is spent on runs that cannot start.
# GPU_CHECK_INSTALL=1 installs them first (outside the 580 s: pip's own time, up to 300 s).
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-${OUT:-$(mktemp -d)}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
export SEXPGPU_CACHE_DIR="${SEXPGPU_CACHE_DIR:-$OUT/cache}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
GPT2="$ROOT/configs/gpt2-small.sx"
PACKED="$ROOT/benchmarks/packed-docs.sx"
SX=("$PY" -m sexpgpu.cli.main)
FAILED=0
T_ALL=$(date +%s)
say() { echo "$@" | tee -a "$OUT/summary.txt"; }
fail() { say "FAIL $1"; FAILED=1; }

# 0. setup: sexpgpu and the CUDA plugin importable by $PY
HAS_CUDA='import importlib.util as u, sys, sexpgpu, jax
def found(name):
  try:
    return u.find_spec(name) is not None
  except ImportError:  # its parent package (jax_plugins) is not there either
    return False
print("jax", jax.__version__)
sys.exit(0 if found("jax_plugins.xla_cuda13") or found("jax_cuda13_plugin") else 3)'
JAXV=$(timeout 15 "$PY" -c "$HAS_CUDA" 2>"$OUT/setup.err"); rc=$?
if [ "$rc" != 0 ] && [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  timeout 300 "$PY" -m pip install -q -e "$ROOT[cuda]" >"$OUT/install.txt" 2>&1 ||
    say "WARN setup: pip install -e .[cuda] failed: $(tail -2 "$OUT/install.txt" | tr '\n' ' ')"
  JAXV=$(timeout 15 "$PY" -c "$HAS_CUDA" 2>"$OUT/setup.err"); rc=$?
fi
case $rc in
  0) say "PASS setup: $PY, $JAXV and its CUDA plugin" ;;
  3) fail "setup: $PY has sexpgpu but not the CUDA plugin — fix: $PY -m pip install -e '.[cuda]' (or GPU_CHECK_INSTALL=1)"; exit 1 ;;
  *) fail "setup: $PY cannot import sexpgpu and jax ($(tail -1 "$OUT/setup.err")) — fix: $PY -m pip install -e '.[cuda]', or PYTHON=/path/to/python"; exit 1 ;;
esac

# 1. doctor
if timeout 30 "${SX[@]}" doctor --device cuda >"$OUT/doctor.txt" 2>&1; then
  say "PASS doctor: $(grep -c '^ok' "$OUT/doctor.txt") ok, $(grep -c '^warn' "$OUT/doctor.txt") warn"
else
  fail "doctor: $(grep '^fail' "$OUT/doctor.txt" | head -3 | tr '\n' ' ')"
fi
head -20 "$OUT/doctor.txt"

# packed documents need a token cache: the repository's texts, tokenized here
if ! timeout 20 "${SX[@]}" tokenize configs/data/*.txt -o "$OUT/tok/" --train-bpe 2048 \
    >"$OUT/tokenize.txt" 2>&1; then
  fail "tokenize: $(tail -3 "$OUT/tokenize.txt" | tr '\n' ' ')"
fi

# 2. served = predicted, per configuration
timeout 240 "$PY" benchmarks/gpu_served.py "$GPT2" "$GPT2 - precision=f32" \
  "$PACKED - cache=$OUT/tok" >"$OUT/served.txt" 2>"$OUT/served.err"
rc=$?
grep -E '^(PASS|FAIL|  )' "$OUT/served.txt" | tee -a "$OUT/summary.txt"
[ "$rc" = 0 ] || fail "served (exit $rc): $(tail -3 "$OUT/served.err" | tr '\n' ' ')"

# 3. 20 steps of gpt2-small bf16: read from the run's own metrics (its steps, the lowering
#    annotation and the allocator's peak against the plan)
T0=$(date +%s)
if timeout 120 "${SX[@]}" run "$GPT2" --device cuda --steps 20 --eval-every 0 \
    --metrics "jsonl:$OUT/run20.jsonl" --status "$OUT/run20.status.json" \
    >"$OUT/run20.out" 2>"$OUT/run20.err"; then
  "$PY" - "$OUT/run20.jsonl" "$(( $(date +%s) - T0 ))" <<'PY' | tee -a "$OUT/summary.txt" || FAILED=1
import json, statistics, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
steps = [e for e in ev if e["kind"] == "step"]
late = [e for e in steps if e["step"] > 5]
tps = [e["throughput/tokens-per-second"] for e in late if e.get("throughput/tokens-per-second")]
mfu = [e["throughput/mfu"] for e in late if e.get("throughput/mfu")]
ok = len(steps) == 20 and bool(tps) and bool(mfu)
print(f"{'PASS' if ok else 'FAIL'} run20: {len(steps)} steps, "
      + (f"{statistics.median(tps):.0f} tokens/s" if tps else "no tokens/s") + ", "
      + (f"MFU {100 * statistics.median(mfu):.1f}%" if mfu else "no MFU")
      + f" (medians of steps 6..20), loss at {len(steps)} "
      + (f"{steps[-1]['train/loss']:.4f}" if steps else "-") + f", {sys.argv[2]} s wall")
ann = {e.get("name"): e for e in ev if e["kind"] == "annotation"}
for line in ann.get("lowering", {}).get("text", "no lowering annotation").splitlines():
  print("  " + line)
peak = ann.get("memory peak")
if peak:
  pct = (peak["peak"] - peak["planned"]) / max(peak["planned"], 1) * 100
  ok &= abs(pct) <= 10
  print(f"{'PASS' if abs(pct) <= 10 else 'FAIL'} memory: {peak['text']} (within 10% passes)")
else:
  print("WARN memory: the device reported no peak")
sys.exit(0 if ok else 1)
PY
else
  fail "run20 (exit $?): $(tail -6 "$OUT/run20.err" | tr '\n' ' ')"
fi

# 4. deterministic resume with cuDNN in the step: steps 4..6 after a resume of step 3
SMALL=(--device cuda --variant smoke --set precision=bf16 --set checkpoint-every=3
       --eval-every 0 --steps 6)
ok=1
SEXPGPU_DETERMINISTIC=1 timeout 50 "${SX[@]}" run "$GPT2" "${SMALL[@]}" \
  --checkpoint-dir "$OUT/ck-a" --metrics "jsonl:$OUT/det-a.jsonl" \
  >"$OUT/det-a.out" 2>"$OUT/det-a.err" || ok=0
STEP3=$(ls -d "$OUT"/ck-a/*/3 2>/dev/null | head -1)
if [ "$ok" = 1 ] && [ -n "$STEP3" ]; then
  SEXPGPU_DETERMINISTIC=1 timeout 50 "${SX[@]}" run "$GPT2" "${SMALL[@]}" \
    --checkpoint-dir "$OUT/ck-b" --resume "$STEP3" --metrics "jsonl:$OUT/det-b.jsonl" \
    >"$OUT/det-b.out" 2>"$OUT/det-b.err" || ok=0
fi
if [ "$ok" = 1 ] && [ -n "$STEP3" ]; then
  "$PY" - "$OUT/det-a.jsonl" "$OUT/det-b.jsonl" <<'PY' && say "PASS resume: steps 4..6 bitwise equal under SEXPGPU_DETERMINISTIC=1 with cuDNN attention" || fail "resume: losses differ after the resume, or cuDNN did not serve"
import json, sys
def losses(p):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(p)) if e["kind"] == "step"}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
both = sorted(set(a) & set(b))
cudnn = any(e["kind"] == "annotation" and e.get("name") == "lowering"  # what served, as
            and "→ cudnn" in e.get("regions", {}).get("attention", "")  # the run reported it
            for e in map(json.loads, open(sys.argv[1])))
print("straight", [a[s] for s in both], "resumed", [b[s] for s in both], "cudnn", cudnn)
sys.exit(0 if both == [4, 5, 6] and all(a[s] == b[s] for s in both) and cudnn else 1)
PY
else
  fail "resume: a run failed or no step-3 checkpoint: $(tail -4 "$OUT"/det-*.err | tr '\n' ' ')"
fi

# 5. a --device cpu run with a pass, on this GPU host: the CPU's rules in the step and pass
if timeout 40 "${SX[@]}" run "$GPT2" --device cpu --variant smoke --steps 2 --eval-every 2 \
    --metrics "jsonl:$OUT/cpu.jsonl" >"$OUT/cpu.out" 2>"$OUT/cpu.err"; then
  "$PY" - "$OUT/cpu.jsonl" <<'PY' && say "PASS cpu-on-gpu: a --device cpu run and its pass on the GPU host" || fail "cpu-on-gpu: no pass result"
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
sys.exit(0 if any(e["kind"] == "pass" for e in ev) else 1)
PY
else
  fail "cpu-on-gpu (exit $?): $(tail -4 "$OUT/cpu.err" | tr '\n' ' ')"
fi

# 6. :sharding fsdp against replicate over two cards: 10 steps, losses within 1e-5
# the GPUs CUDA sees: nvidia-smi's through CUDA_VISIBLE_DEVICES (a MIG slice counts once)
NDEV=$(timeout 15 "$PY" -c "from sexpgpu.devices.doctor import gpu_count; print(gpu_count())" 2>/dev/null || echo 0)
if [ "$NDEV" -ge 2 ]; then
  ok=1
  for S in replicate fsdp; do
    SEXPGPU_DEVICES=0,1 timeout 90 "${SX[@]}" run "$GPT2" --device cuda --variant smoke \
      --steps 10 --eval-every 0 --set microbatches=2 --set sharding=$S \
      --metrics "jsonl:$OUT/shard-$S.jsonl" >"$OUT/shard-$S.out" 2>"$OUT/shard-$S.err" || ok=0
  done
  if [ "$ok" = 1 ]; then
    "$PY" - "$OUT/shard-replicate.jsonl" "$OUT/shard-fsdp.jsonl" <<'PY' && say "PASS fsdp: 10 steps over 2 cards, losses within 1e-5 of replicate" || fail "fsdp: losses differ from replicate"
import json, sys
def steps(p):
  return [e for e in map(json.loads, open(p)) if e["kind"] == "step"]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
d = max(abs(x["train/loss"] - y["train/loss"]) for x, y in zip(a, b))
print(f"max |loss difference| {d:.2e}")
sys.exit(0 if len(a) == len(b) == 10 and d <= 1e-5 else 1)
PY
  else
    fail "fsdp: a run failed: $(tail -4 "$OUT"/shard-*.err | tr '\n' ' ')"
  fi
else
  say "WARN fsdp: $NDEV GPU here; sharding needs two"
fi

say "total: $(( $(date +%s) - T_ALL )) s"
echo "--- summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit $FAILED
