#!/usr/bin/env bash
# GPU check for a machine with NVIDIA GPUs (under 5 minutes): runs `hetrain doctor`, `hetrain env`,
# a real CUDA training run of the demo (no --emulate) and the GPU tests, then prints one verdict.
# Usage: scripts/gpu_check.sh [output-dir]    (exit code: number of failed steps, 0 = all passed)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$(mktemp -d -t hetrain-gpu-check-XXXX)}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
FAILED=()

step() {   # step NAME TIMEOUT_S CMD...: run it, keep its log, record a failure
  local name="$1" limit="$2"; shift 2
  echo; echo "=== $name ==="
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "--- $name: exit $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc)")
}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch cannot use CUDA here; nothing to check on a GPU" >&2
  "$PY" -m hetrain doctor
  exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'

# doctor: the table (exit 1 means it found an error on this machine: a failed step, read it)
step doctor 120 "$PY" -m hetrain doctor --measure
step doctor-json 120 "$PY" -m hetrain doctor --json
step doctor-json-shape 30 "$PY" -c '
import json, sys
text = open(sys.argv[1]).read()
d = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]   # the log may hold warnings too
assert {"devices", "findings"} <= set(d), sorted(d)
cuda = [x for x in d["devices"] if x["kind"] == "cuda"]
assert cuda, "no CUDA device in doctor --json"
assert all({"level", "check", "message", "fix"} <= set(f) for f in d["findings"])
print(len(cuda), "CUDA device(s):", ", ".join(x["name"] for x in cuda), "|", len(d["findings"]), "findings")
' "$OUT/doctor-json.log"
step env 120 "$PY" -m hetrain env --measure

# A real CUDA training run: one process per visible GPU through `hetrain run` (which applies the
# doctor's environment fixes), bf16 where every GPU has it in hardware, else fp16.
PREC=$("$PY" -c 'import torch; n = torch.cuda.device_count(); print("bf16" if all(torch.cuda.get_device_capability(i) >= (8, 0) for i in range(n)) else "fp16")')
step train 240 "$PY" -m hetrain run --run-dir "$OUT/run" -m hetrain.demo.train_gpt \
  --steps 30 --global-batch 32 --precision "$PREC" --json "$OUT/train.json"
step train-result 30 "$PY" -c '
import json, math, sys
r = json.load(open(sys.argv[1]))
print("steps", r["steps"], "loss", r["first_loss"], "->", r["last_loss"], "samples/s", r["samples_per_s"])
assert r["steps"] == 30 and math.isfinite(r["last_loss"]) and r["last_loss"] < r["first_loss"], "did not train"
' "$OUT/train.json"

step gpu-tests 180 "$PY" -m pytest "$ROOT/tests/gpu" -q -x -p no:cacheprovider

echo
echo "logs in $OUT"
if [ ${#FAILED[@]} -eq 0 ]; then
  echo "GPU CHECK PASSED"
else
  echo "GPU CHECK FAILED: ${FAILED[*]}"
fi
exit ${#FAILED[@]}
