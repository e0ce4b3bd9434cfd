#!/usr/bin/env bash
# The GPU machine's check: one command, under 10 minutes on one H100/H200 card (the
# timeouts of a one-card machine sum to 40+30+240+120+2*50+40 = 570 s; a second card adds
# the fsdp step's 2*90 s). Each step prints `PASS|FAIL|WARN <step>: ...`:
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
set -u -o pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-${OUT:-$(mktemp -d)}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
export SEXPGPU_CACHE_DIR="${SEXPGPU_CACHE_DIR:-$OUT/cache}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
GPT2="$ROOT/configs/gpt2-small.sx"
PACKED="$ROOT/benchmarks/packed-docs.sx"
SX=(python -m sexpgpu.cli.main)
FAILED=0
T_ALL=$(date +%s)
say() { echo "$@" | tee -a "$OUT/summary.txt"; }
fail() { say "FAIL $1"; FAILED=1; }

# 1. doctor
if timeout 40 "${SX[@]}" doctor --device cuda >"$OUT/doctor.txt" 2>&1; then
  say "PASS doctor: $(grep -c '^ok' "$OUT/doctor.txt") ok, $(grep -c '^warn' "$OUT/doctor.txt") warn"
else
  fail "doctor: $(grep '^fail' "$OUT/doctor.txt" | head -3 | tr '\n' ' ')"
fi
head -20 "$OUT/doctor.txt"

# packed documents need a token cache: the repository's texts, tokenized here
if ! timeout 30 "${SX[@]}" tokenize configs/data/*.txt -o "$OUT/tok/" --train-bpe 2048 \
    >"$OUT/tokenize.txt" 2>&1; then
  fail "tokenize: $(tail -3 "$OUT/tokenize.txt" | tr '\n' ' ')"
fi

# 2. served = predicted, per configuration
timeout 240 python benchmarks/gpu_served.py "$GPT2" "$GPT2 - precision=f32" \
  "$PACKED - cache=$OUT/tok" >"$OUT/served.txt" 2>"$OUT/served.err"
rc=$?
grep -E '^(PASS|FAIL|  )' "$OUT/served.txt" | tee -a "$OUT/summary.txt"
[ "$rc" = 0 ] || fail "served (exit $rc): $(tail -3 "$OUT/served.err" | tr '\n' ' ')"

# 3. 20 steps of gpt2-small bf16
T0=$(date +%s)
if timeout 120 "${SX[@]}" run "$GPT2" --device cuda --steps 20 --eval-every 0 \
    --metrics "jsonl:$OUT/run20.jsonl" --status "$OUT/run20.status.json" \
    >"$OUT/run20.out" 2>"$OUT/run20.err"; then
  TPS=$(python - "$OUT/run20.jsonl" <<'PY'
import json, statistics, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
st = [e for e in ev if e["kind"] == "step" and e["step"] > 5]
tps = [e["throughput/tokens-per-second"] for e in st if e.get("throughput/tokens-per-second")]
mfu = [e["throughput/mfu"] for e in st if e.get("throughput/mfu")]
last = [e["train/loss"] for e in ev if e["kind"] == "step"][-1]
print((f"{statistics.median(tps):.0f} tokens/s" if tps else "no tokens/s") + ", "
      + (f"MFU {100 * statistics.median(mfu):.1f}%" if mfu else "no MFU")
      + f" (medians of steps 6..20), loss at 20 {last:.4f}")
PY
)
  say "PASS run20: $TPS, $(( $(date +%s) - T0 )) s wall"
  grep -hE '^(lowering:|  [a-z-]+ {2,})' "$OUT/run20.err" "$OUT/run20.out" | tee -a "$OUT/summary.txt"
  PEAK=$(grep -h '^memory: peak' "$OUT/run20.err" "$OUT/run20.out" | tail -1)
  if [ -n "$PEAK" ]; then
    python - "$PEAK" <<'PY' && say "PASS memory: $PEAK" || fail "memory: $PEAK (more than 10% from the plan)"
import re, sys
m = re.search(r"\(([+-][\d.]+)%\)", sys.argv[1])
sys.exit(0 if m and abs(float(m.group(1))) <= 10 else 1)
PY
  else
    say "WARN memory: no 'memory: peak' line"
  fi
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
  python - "$OUT/det-a.jsonl" "$OUT/det-b.jsonl" "$OUT/det-a.err" <<'PY' && say "PASS resume: steps 4..6 bitwise equal under SEXPGPU_DETERMINISTIC=1 with cuDNN attention" || fail "resume: losses differ after the resume, or cuDNN did not serve"
import json, sys
def losses(p):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(p)) if e["kind"] == "step"}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
both = sorted(set(a) & set(b))
cudnn = "cudnn" in open(sys.argv[3]).read()
print("straight", [a[s] for s in both], "resumed", [b[s] for s in both], "cudnn", cudnn)
sys.exit(0 if both == [4, 5, 6] and all(a[s] == b[s] for s in both) and cudnn else 1)
PY
else
  fail "resume: a run failed or no step-3 checkpoint: $(tail -4 "$OUT"/det-*.err | tr '\n' ' ')"
fi

# 5. a --device cpu run with a pass, on this GPU host: the CPU's rules in the step and pass
if timeout 40 "${SX[@]}" run "$GPT2" --device cpu --variant smoke --steps 2 --eval-every 2 \
    --metrics "jsonl:$OUT/cpu.jsonl" >"$OUT/cpu.out" 2>"$OUT/cpu.err"; then
  python - "$OUT/cpu.jsonl" <<'PY' && say "PASS cpu-on-gpu: a --device cpu run and its pass on the GPU host" || fail "cpu-on-gpu: no pass result"
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
sys.exit(0 if any(e["kind"] == "pass" for e in ev) else 1)
PY
else
  fail "cpu-on-gpu (exit $?): $(tail -4 "$OUT/cpu.err" | tr '\n' ' ')"
fi

# 6. :sharding fsdp against replicate over two cards: 10 steps, losses within 1e-5
NDEV=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$NDEV" -ge 2 ]; then
  ok=1
  for S in replicate fsdp; do
    SEXPGPU_DEVICES=0,1 timeout 90 "${SX[@]}" run "$GPT2" --device cuda --variant smoke \
      --steps 10 --eval-every 0 --set microbatches=2 --set sharding=$S \
      --metrics "jsonl:$OUT/shard-$S.jsonl" >"$OUT/shard-$S.out" 2>"$OUT/shard-$S.err" || ok=0
  done
  if [ "$ok" = 1 ]; then
    python - "$OUT/shard-replicate.jsonl" "$OUT/shard-fsdp.jsonl" <<'PY' && say "PASS fsdp: 10 steps over 2 cards, losses within 1e-5 of replicate" || fail "fsdp: losses differ from replicate"
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
