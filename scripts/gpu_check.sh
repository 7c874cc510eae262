#!/usr/bin/env bash
# The GPU check: what CPU emulation cannot show, measured on one real GPU in one run of at most
# 9 minutes. Each step is its own process with its own time limit (scripts/gpu_checks/*.py); a
# failed step does not stop the others. Every log and summary.json go to OUT (at most 7 files),
# and a verdict table (step, status, seconds, key figure, reason) ends the output.
#
#   scripts/gpu_check.sh OUT          on a machine with CUDA (without one: says so, runs --dry)
#   scripts/gpu_check.sh --dry OUT    on a CPU (CI): every CUDA step skipped with its reason; the
#                                     CPU steps, the logs, summary.json and the table still run
#   GPU_CHECK_ONLY=oom,timing-dp scripts/gpu_check.sh OUT     those steps alone
#
# Runs with $PYTHON (default python3) on the installed torch; sets PYTHONPATH to this checkout's
# src/ itself. Exit: 0 when no step failed, 1 when one did, 2 on bad usage.
set -uo pipefail

usage() { echo "usage: scripts/gpu_check.sh [--dry] OUT   (OUT: the folder for the logs and summary.json)"; }
DRY=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option $arg; $(usage)" >&2; exit 2 ;;
    *) if [ -n "$OUT" ]; then echo "gpu_check: two output folders ($OUT, $arg); $(usage)" >&2; exit 2; fi
       OUT="$arg" ;;
  esac
done
if [ -z "$OUT" ]; then echo "gpu_check: no output folder given; $(usage)" >&2; exit 2; fi
if ! mkdir -p "$OUT" 2>/dev/null || [ ! -w "$OUT" ]; then
  echo "gpu_check: cannot write to $OUT; give a folder you can write" >&2; exit 2
fi
OUT="$(cd "$OUT" && pwd)"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: $PY not found; set PYTHON to the interpreter that has torch" >&2; exit 2
fi
CHECKS="$ROOT/scripts/gpu_checks"
SCRATCH="$(mktemp -d -t hetrain-gpu-check-XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
export GPU_CHECK_SCRATCH="$SCRATCH" HETRAIN_CACHE="$SCRATCH/cache" PYTHONUNBUFFERED=1
STARTED=$(date +%s)
NOTE=""

BUDGET=540     # 9 minutes for every step together, on the GPU machine
# step, module, limit on the GPU (s), limit under --dry (s), log. The GPU limits are sized for one
# H100 with 16 cores, each step's own work a fraction of its limit; --dry runs on whatever CPU CI
# has (a busy 2-core host takes a minute to start two ranks), where the device budget does not apply.
STEPS=(
  "versions facts 25 120 facts.log"
  "nccl facts 25 30 facts.log"
  "launch facts 40 30 runs.log"
  "timing-dp timing 50 30 timing.log"
  "timing-pipeline timing 30 30 timing.log"
  "memory memory 40 30 memory.log"
  "scaler memory 30 30 memory.log"
  "offload memory 30 30 memory.log"
  "oom ranks 45 30 ranks.log"
  "gloo-shares ranks 45 240 ranks.log"
  "cpu-gpu ranks 40 240 ranks.log"
  "hf-trainer hf 35 30 runs.log"
  "gpu-tests facts 95 240 pytest.log"
)
if [ -n "${GPU_CHECK_ONLY:-}" ]; then     # GPU_CHECK_ONLY=timing-dp,oom: those steps alone (a rerun)
  KEEP=()
  for s in "${STEPS[@]}"; do
    read -r name _ <<<"$s"
    [[ ",$GPU_CHECK_ONLY," == *",$name,"* ]] && KEEP+=("$s")
  done
  if [ ${#KEEP[@]} -eq 0 ]; then
    echo "gpu_check: GPU_CHECK_ONLY=$GPU_CHECK_ONLY names no step; name some of: $(for s in "${STEPS[@]}"; do read -r n _ <<<"$s"; printf '%s ' "$n"; done)" >&2
    exit 2
  fi
  STEPS=("${KEEP[@]}")
fi
PROBE="$("$PY" -c 'import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.__file__)' 2>/dev/null)"
if [ "$DRY" -eq 0 ] && [ "${PROBE%% *}" != 1 ]; then
  if [ -z "$PROBE" ]; then NOTE="$PY cannot import torch"; else NOTE="no CUDA device here (torch.cuda.is_available() is False)"; fi
  NOTE="$NOTE: ran the dry mode instead"
  echo "gpu_check: ${NOTE/ran/running}"
  DRY=1
fi
MODE=gpu
[ "$DRY" -eq 1 ] && MODE=dry && BUDGET=1200

SUM=0
PARTS=()
for s in "${STEPS[@]}"; do
  read -r name _ limit dry_limit _ <<<"$s"
  [ "$DRY" -eq 1 ] && limit=$dry_limit
  SUM=$((SUM + limit)); PARTS+=("$name $limit")
done
echo "gpu_check ($MODE): $PY, torch ${PROBE:+${PROBE#* }}${PROBE:-(does not import)}"
LIST="$(IFS=,; echo "${PARTS[*]}")"
echo "budget: ${LIST//,/ s + } s = $SUM s of $BUDGET s"
if [ "$SUM" -gt "$BUDGET" ]; then
  echo "gpu_check: the steps' limits add up to $SUM s, over the $BUDGET s budget; lower them" >&2; exit 2
fi
: >"$SCRATCH/steps.tsv"
i=0
for s in "${STEPS[@]}"; do
  read -r name module limit dry_limit log <<<"$s"
  [ "$DRY" -eq 1 ] && limit=$dry_limit
  i=$((i + 1))
  left=$((BUDGET - ($(date +%s) - STARTED) - 5))
  if [ "$left" -lt 5 ]; then
    printf '%s\t%s\t%s\t0\t-1\n' "$name" "$log" "$limit" >>"$SCRATCH/steps.tsv"
    echo "[$i/${#STEPS[@]}] $name: not run, the budget is spent"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  flags=()
  [ "$DRY" -eq 1 ] && flags+=(--dry)
  t0=$(date +%s.%N)
  (cd "$ROOT" && timeout -k 5 "$limit" "$PY" "$CHECKS/$module.py" "$name" --result "$SCRATCH/$name.json" \
     --limit "$limit" --scratch "$SCRATCH" "${flags[@]}") >>"$OUT/$log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$log" "$limit" "$secs" "$rc" >>"$SCRATCH/steps.tsv"
  status=$(sed -n 's/.*"status": "\([a-z]*\)".*/\1/p' "$SCRATCH/$name.json" 2>/dev/null)
  echo "[$i/${#STEPS[@]}] $name: ${status:-no result (exit $rc)} in ${secs} s (limit $limit s, log $log)"
done

"$PY" "$CHECKS/common.py" verdict --scratch "$SCRATCH" --out "$OUT" --mode "$MODE" --budget "$BUDGET" \
  --started "$STARTED" --note "$NOTE"
rc=$?
[ "$rc" -gt 1 ] && echo "gpu_check: the verdict could not be written (exit $rc); the logs are in $OUT" >&2
exit $rc
