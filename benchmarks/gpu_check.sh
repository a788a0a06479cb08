#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): conformance, -m gpu tests and the
# benchmarks on CUDA, one JSON file. All logic is in benchmarks/support/gpu_check.py.
#   bash benchmarks/gpu_check.sh [--out gpu_check.json] [--dry-run] [...]
# PYTHON picks the interpreter (default: python3, the one that holds torch).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/support/gpu_check.py" "$@"
