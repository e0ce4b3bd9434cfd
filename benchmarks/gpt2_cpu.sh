#!/usr/bin/env bash
# configs/gpt2-small.sx at its full shape (no smoke variant), 2 steps on the CPU:
# wall time and the process's peak resident memory (GNU time's "Maximum resident set size").
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp)
/usr/bin/time -v sexpgpu run configs/gpt2-small.sx --steps 2 --eval-every 0 "$@" 2> "$out" || {
  cat "$out"; exit 1; }
grep -E '^(run:|step|timing|done:|  )' "$out"
grep -E 'Maximum resident set size|Elapsed \(wall clock\)' "$out"
