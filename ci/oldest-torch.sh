#!/usr/bin/env bash
# The core of the suite against the oldest torch amped supports: the floor in
# pyproject.toml ("torch>=X.Y"), latest patch release. The pinned torch runs the whole
# suite; this catches a torch API that the floor lacks.
#
# Core subset: policy, autocast, GradScaler, recipes, FP8 casts and the public API,
# without the slow tests. The oracles that need transformers, torchao or the
# frameworks stay with the pinned torch. Features that need a newer torch than the floor
# (torch.compile of the engine, FP8) skip with their reason.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(python3 -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(re.fullmatch(r"torch>=(\d+\.\d+)", d).group(1) for d in deps if d.startswith("torch")))')
venv=${AMPED_OLDEST_TORCH_VENV:-${TMPDIR:-/tmp}/amped-oldest-torch-$floor}
if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
# The test tools at the versions constraints.txt pins; torch at the floor (on x86_64
# PyPI has only the CUDA build, a few GB; it runs on the CPU here).
tools=(numpy pytest pytest-timeout hypothesis expecttest)
pins=$(grep -E '^(numpy|pytest|pytest-timeout|hypothesis|expecttest)==' constraints.txt)
"$venv/bin/pip" install -q -c <(echo "$pins") "torch==$floor.*" "${tools[@]}"
# `install` stops here: amped itself (an editable install, which writes
# src/amped.egg-info) is added only when the subset runs, never beside another pip.
if [ "${1:-}" = install ]; then exit 0; fi
"$venv/bin/pip" install -q -c <(echo "$pins") --no-deps -e .
"$venv/bin/python" -c 'import torch; print("ci: oldest supported torch", torch.__version__)'
# Files by package, as the suite lays them out. PyPI's build is the CUDA one, so the
# CUDA op table is also checked against a build with cuDNN (its _cudnn_rnn kernel).
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/autocast_mode/test_autocast_*.py tests/lowp/float8/test_fp8_cast.py \
    tests/lowp/float8/test_fp8_numerics.py tests/optim/test_recipes_*.py tests/policy/test_policy.py \
    tests/recipes/test_recipes_*.py tests/scaling/test_grad_scaler_*.py tests/test_public_api.py
