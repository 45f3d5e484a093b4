#!/usr/bin/env bash
# The GPU checks (bench/gpu_check.py): at most 8 minutes on one GPU; fails loudly.
#   bash bench/gpu_check.sh          # on a CUDA machine
#   bash bench/gpu_check.sh --cpu    # the CPU-compatible parts, here
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec timeout 480 "$PY" bench/gpu_check.py "$@"
