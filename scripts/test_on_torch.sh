#!/usr/bin/env bash
# Run the test suite on another torch release, in a virtual environment of its own (CI stays on the
# torch 2.13.0 CPU wheel the README installs).
#
# Usage: scripts/test_on_torch.sh VERSION [VENV_DIR] [-- PYTEST_ARGS...]
#   VERSION     a torch release on the package index, e.g. 2.11.0 or 2.14.1
#   VENV_DIR    where the environment goes (default: $TMPDIR or /tmp, hetrain-torch-VERSION); an
#               existing one with that torch is reused, so a second run only runs the tests
#   PYTEST_ARGS replace the README's test command's arguments (default: -q -n 2 --dist loadfile),
#               e.g. -- -q tests/unit tests/cli
# A release without a CPU wheel on the index installs its CUDA build (about 5.5 GB with its NVIDIA
# libraries); the tests run on the CPU either way. Exit code: pytest's.
set -euo pipefail

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
VERSION="$1"; shift
VENV="${TMPDIR:-/tmp}/hetrain-torch-$VERSION"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then VENV="$1"; shift; fi
[ $# -gt 0 ] && [ "$1" == "--" ] && shift
PYTEST_ARGS=("$@")
[ ${#PYTEST_ARGS[@]} -gt 0 ] || PYTEST_ARGS=(-q -n 2 --dist loadfile)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY_BASE="${PYTHON:-python3}"
PY="$VENV/bin/python"

have_torch() { [ -x "$PY" ] && "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; }

if ! have_torch; then
  echo "test_on_torch: making $VENV with torch==$VERSION" >&2
  "$PY_BASE" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  if ! "$PY" -m pip install -q "torch==$VERSION"; then
    echo "test_on_torch: torch==$VERSION does not install here (see pip's message above); " \
         "'$PY -m pip index versions torch' lists what the index has" >&2
    exit 3
  fi
fi
# The project from this checkout (editable) with the README's extras; torch is already the one asked for.
"$PY" -m pip install -q -e "$ROOT[test,hf,lightning,sweep]" "torch==$VERSION"
"$PY" -c 'import torch, hetrain; print("test_on_torch: torch", torch.__version__, "hetrain", hetrain.__version__, "from", hetrain.__file__)'

cd "$ROOT"
# Only this checkout's code and tests: a PYTHONPATH from the caller could bring another copy in.
unset PYTHONPATH
exec "$PY" -m pytest "${PYTEST_ARGS[@]}"
