"""Shared fixtures: every test must leave autocast state as it found it; the FP8 and
block casts run eagerly unless a test is marked ``compiled_casts``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The tests live in tests/<package>/, their shared helpers and subprocess workers in
# tests/helpers/, imported by module name (``from fp8_helpers import ...``).
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from amped._internal import testing
from amped.autocast_mode import current_path
from amped.lowp.float8.emulated_gemm import set_emulated_gemm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config):
    # Under pytest-xdist each worker takes its share of the cores for torch's own threads:
    # two workers of two threads each on two cores oversubscribe them, and OpenMP's
    # spinning threads then wait on each other. (Subprocesses a test starts choose their
    # own threads; a test that sets torch's threads puts them back.)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _snapshot() -> tuple[object, ...]:
    per_device = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), current_path(d))
        for d in ("cpu", "cuda", "ipu")  # (ipu: amped's mark for Dynamo's guards)
    )
    return (
        per_device,
        torch.is_autocast_cache_enabled(),
        torch._C._len_torch_function_stack(),
        torch.get_default_dtype(),
    )


@pytest.fixture(autouse=True)
def _no_leaked_autocast_state():
    before = _snapshot()
    yield
    after = _snapshot()
    assert after == before, f"test leaked autocast state: before={before}, after={after}"


@pytest.fixture(autouse=True)
def _eager_casts(request, monkeypatch):
    """The casts' compiled kernels give the eager bits (tests/lowp/mx/test_fp8_compiled_cast.py)
    but take seconds to compile per shape: other tests run them eagerly; the tests
    marked ``compiled_casts`` compile whatever their tensors' size."""
    compiled = request.node.get_closest_marker("compiled_casts") is not None
    monkeypatch.setattr(testing, "CASTS", "compiled" if compiled else "eager")


GEMM_DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(params=list(GEMM_DTYPES), ids=[f"gemm-{name}" for name in GEMM_DTYPES])
def emulated_gemm(request):
    """The test runs on each path of the emulated FP8 and block GEMMs, whatever this
    machine would choose (amped.lowp.float8.emulated_gemm): bfloat16 operands and GEMMs (a
    machine with native bf16 matmul) and float32 ones (a machine without). Yields the
    GEMMs' dtype for a bfloat16 result."""
    previous = set_emulated_gemm(request.param)
    try:
        yield GEMM_DTYPES[request.param]
    finally:
        set_emulated_gemm(previous)


@pytest.fixture
def bf16_gemm():
    """The emulated GEMMs forced to bfloat16 (for a test whose oracle is that path's
    bits, e.g. torchao's emulated MXFP8), whatever this machine would choose."""
    previous = set_emulated_gemm("bf16")
    try:
        yield torch.bfloat16
    finally:
        set_emulated_gemm(previous)
