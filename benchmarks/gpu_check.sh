#!/usr/bin/env bash
# The GPU machine's check, under 8 minutes on one H100/H200-class card:
#   1. sexpgpu doctor --device cuda
#   2. sexpgpu check configs/gpt2-small.sx
#   3. 30 steps of gpt2-small on cuda: tokens/s (median of steps 6..30), the
#      lowering report, and the `memory: peak X of Y planned` line
#   4. SEXPGPU_DETERMINISTIC=1: 6 steps straight vs 3 steps + --resume of step 3,
#      the losses of steps 4..6 bitwise equal; the checkpoint keeps XLA's autotuning
#      results (read back by the resume)
#   5. :sharding fsdp against replicate over two devices (when there are two)
# Usage: benchmarks/gpu_check.sh [OUT_DIR]   (DEVICE=cpu rehearses 3-4 on the cpu
# with the smoke variant; doctor then runs without --device cuda)
# Exit 0 when every step passed; each step prints `PASS|FAIL|WARN <step>: ...`.
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-${OUT:-$(mktemp -d)}}"
DEVICE="${DEVICE:-cuda}"
CONFIG="$ROOT/configs/gpt2-small.sx"
mkdir -p "$OUT"
cd "$ROOT"
export SEXPGPU_CACHE_DIR="${SEXPGPU_CACHE_DIR:-$OUT/cache}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SX=(python -m sexpgpu.cli.main)
FAILED=0
say() { echo "$@" | tee -a "$OUT/summary.txt"; }
fail() { say "FAIL $1"; FAILED=1; }

# 1. doctor
if [ "$DEVICE" = cuda ]; then DOC=(--device cuda); else DOC=(); fi
if timeout 120 "${SX[@]}" doctor "${DOC[@]}" >"$OUT/doctor.txt" 2>&1; then
  say "PASS doctor: $(grep -c '^ok' "$OUT/doctor.txt") ok, $(grep -c '^warn' "$OUT/doctor.txt") warn"
else
  fail "doctor: $(grep '^fail' "$OUT/doctor.txt" | head -3 | tr '\n' ' ')"
fi
cat "$OUT/doctor.txt"

# 2. check
if timeout 120 "${SX[@]}" check "$CONFIG" >"$OUT/check.txt" 2>&1; then
  say "PASS check: gpt2-small compiles"
else
  fail "check: $(tail -5 "$OUT/check.txt" | tr '\n' ' ')"
fi

# 3. 30 steps on the device
if [ "$DEVICE" = cuda ]; then RUN=(--device cuda); else RUN=(--device cpu --variant smoke); fi
T0=$(date +%s)
if timeout 330 "${SX[@]}" run "$CONFIG" "${RUN[@]}" --steps 30 --eval-every 0 \
    --metrics "jsonl:$OUT/run30.jsonl" --status "$OUT/run30.status.json" \
    >"$OUT/run30.out" 2>"$OUT/run30.err"; then
  TPS=$(python - "$OUT/run30.jsonl" <<'PY'
import json, statistics, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
tps = [e["throughput/tokens-per-second"] for e in ev
       if e["kind"] == "step" and e["step"] > 5 and e.get("throughput/tokens-per-second")]
last = [e["train/loss"] for e in ev if e["kind"] == "step"][-1]
print(f"{statistics.median(tps):.0f} tokens/s (median of steps 6..30), loss at 30 {last:.4f}"
      if tps else "no tokens/s in the step events")
PY
)
  say "PASS run30: $TPS, $(( $(date +%s) - T0 )) s wall"
  grep -E '^(lowering:|  [a-z-]+ {2,})' "$OUT/run30.err" "$OUT/run30.out" -h | tee -a "$OUT/summary.txt"
  PEAK=$(grep -h '^memory: peak' "$OUT/run30.err" "$OUT/run30.out" | tail -1)
  if [ -n "$PEAK" ]; then
    say "PASS memory: $PEAK"
    python - "$PEAK" <<'PY' || fail "memory: the plan is more than 10% from the peak"
import re, sys
m = re.search(r"\(([+-][\d.]+)%\)", sys.argv[1])
sys.exit(0 if m and abs(float(m.group(1))) <= 10 else 1)
PY
  else
    say "WARN memory: no 'memory: peak' line (the run loop does not print it yet)"
  fi
else
  fail "run30 (exit $?): $(tail -8 "$OUT/run30.err" | tr '\n' ' ')"
fi

# 4. deterministic resume: steps 4..6 after a resume of step 3 equal the straight run's
export SEXPGPU_DETERMINISTIC=1
SMALL=(--variant smoke --set checkpoint-every=3 --eval-every 0 --steps 6)
[ "$DEVICE" = cuda ] && SMALL+=(--device cuda) || SMALL+=(--device cpu)
ok=1
timeout 150 "${SX[@]}" run "$CONFIG" "${SMALL[@]}" --checkpoint-dir "$OUT/ck-a" \
  --metrics "jsonl:$OUT/det-a.jsonl" >"$OUT/det-a.out" 2>"$OUT/det-a.err" || ok=0
STEP3=$(ls -d "$OUT"/ck-a/*/3 2>/dev/null | head -1)
if [ "$ok" = 1 ] && [ -n "$STEP3" ]; then
  timeout 150 "${SX[@]}" run "$CONFIG" "${SMALL[@]}" --checkpoint-dir "$OUT/ck-b" \
    --resume "$STEP3" --metrics "jsonl:$OUT/det-b.jsonl" >"$OUT/det-b.out" 2>"$OUT/det-b.err" \
    || ok=0
fi
if [ "$ok" = 1 ] && [ -n "$STEP3" ]; then
  python - "$OUT/det-a.jsonl" "$OUT/det-b.jsonl" <<'PY' && say "PASS resume: steps 4..6 bitwise equal under SEXPGPU_DETERMINISTIC=1" || fail "resume: losses differ after the resume"
import json, sys
def losses(p):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(p)) if e["kind"] == "step"}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
both = sorted(set(a) & set(b))
print("straight", [a[s] for s in both], "resumed", [b[s] for s in both])
sys.exit(0 if both == [4, 5, 6] and all(a[s] == b[s] for s in both) else 1)
PY
  python - "$STEP3/meta/metadata" <<'PY' && say "PASS autotune: the step-3 checkpoint keeps XLA's autotuning results" || say "WARN autotune: the step-3 checkpoint holds no autotuning results (nothing autotuned?)"
import json, sys
tuned = json.load(open(sys.argv[1])).get("xla_autotune")
print("autotune results:", len(tuned["results"]) if tuned else 0, "characters")
sys.exit(0 if tuned and tuned["results"] else 1)
PY
else
  fail "resume: a run failed or no step-3 checkpoint: $(tail -5 "$OUT"/det-*.err | tr '\n' ' ')"
fi
unset SEXPGPU_DETERMINISTIC

# 5. :sharding fsdp against replicate over two devices: 10 steps, losses within 1e-5
if [ "$DEVICE" = cuda ]; then
  NDEV=$(nvidia-smi -L 2>/dev/null | wc -l)
  SHARD_ENV=(SEXPGPU_DEVICES=0,1)
  SHARD=(--device cuda --variant smoke)
else
  NDEV=2
  SHARD_ENV=(SEXPGPU_DEVICES=0,1 XLA_FLAGS=--xla_force_host_platform_device_count=2)
  SHARD=(--device cpu --variant smoke)
fi
if [ "$NDEV" -ge 2 ]; then
  ok=1
  for S in replicate fsdp; do
    env "${SHARD_ENV[@]}" timeout 200 "${SX[@]}" run "$CONFIG" "${SHARD[@]}" --steps 10 \
      --eval-every 0 --set microbatches=2 --set sharding=$S --metrics "jsonl:$OUT/shard-$S.jsonl" \
      >"$OUT/shard-$S.out" 2>"$OUT/shard-$S.err" || ok=0
  done
  if [ "$ok" = 1 ]; then
    python - "$OUT/shard-replicate.jsonl" "$OUT/shard-fsdp.jsonl" <<'PY' && say "PASS fsdp: 10 steps over 2 devices, losses within 1e-5 of replicate" || fail "fsdp: losses differ from replicate"
import json, sys
def steps(p):
  return [e for e in map(json.loads, open(p)) if e["kind"] == "step"]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
d = max(abs(x["train/loss"] - y["train/loss"]) for x, y in zip(a, b))
ta = sorted(e["time/step"] for e in a[3:])[len(a[3:]) // 2]
tb = sorted(e["time/step"] for e in b[3:])[len(b[3:]) // 2]
print(f"max |loss difference| {d:.2e}; median step fsdp/replicate {tb / ta:.3f}")
sys.exit(0 if len(a) == len(b) == 10 and d <= 1e-5 else 1)
PY
    grep -h '  memory ' "$OUT/shard-fsdp.err" | tee -a "$OUT/summary.txt"
  else
    fail "fsdp: a run failed: $(tail -5 "$OUT"/shard-*.err | tr '\n' ' ')"
  fi
else
  say "WARN fsdp: one GPU here; sharding needs two (nothing to split)"
fi

echo "--- summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit $FAILED
