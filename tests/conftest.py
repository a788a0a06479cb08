"""Shared fixtures: every test must leave autocast state as it found it; the FP8 and
block casts run eagerly unless a test is marked ``compiled_casts``."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup``: send each ``xdist_group`` to one worker.

    pytest-xdist (3.8) names a test's group by appending ``@group`` to ``item._nodeid``,
    which pytest 9 no longer reads (the id is ``item._id``): every group was silently
    split over the workers, and a module fixture ran once per worker. This appends it
    where pytest 9 reads it (the workers and the scheduler then see the same ids)."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = {m.args[0] if m.args else m.kwargs.get("name", "default")
                 for m in item.iter_markers("xdist_group")}  # fmt: skip
        suffix = "@" + "_".join(sorted(map(str, names)))
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


# Under pytest-xdist (`pytest -n 2`), a test marked ``alone`` runs while no other test
# does: it takes an exclusive lock that every other test takes shared, so it waits for
# the other worker's current test and holds the next one back. For the tests that time
# training under a load they start themselves (another worker's test would add to it).
_LOCK = (
    Path(tempfile.gettempdir())
    / f"amped-tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'serial')}.lock"
)


@pytest.fixture(autouse=True)
def _alone_or_shared(request):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
