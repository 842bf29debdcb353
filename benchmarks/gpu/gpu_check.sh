#!/usr/bin/env bash
# The GPU proof run: prints one table (see benchmarks/gpu/gpu_check.py for the rows).
#   benchmarks/gpu/gpu_check.sh              # on a CUDA machine, all GPUs of the node
#   benchmarks/gpu/gpu_check.sh --dry-run    # on a CPU: tiny models, 2 gloo ranks (part of make test)
#   benchmarks/gpu/gpu_check.sh --float8     # one GPU: row 0's bench with train.float8 off, on, auto
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" benchmarks/gpu/gpu_check.py "$@"
