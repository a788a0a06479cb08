"""Every entry of torch's own autocast test lists, under amped.autocast vs torch.autocast.

torch ships the ops and arguments it tests autocast with in
``torch.testing._internal.autocast_test_lists``. Each op is called through every Python
variant that exists (``torch.*``, ``torch._C._nn.*`` / ``torch.nn.functional.*``, and the
``Tensor`` method), once under ``torch.autocast`` and once under ``amped.autocast``: the
output dtype must match and the values must be bitwise identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import BITWISE

import amped
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

autocast_test_lists = pytest.importorskip("torch.testing._internal.autocast_test_lists")

LOW_DTYPES = [torch.bfloat16, torch.float16]


CPU_LISTS = (
    "torch_expect_builtin_promote",
    "methods_expect_builtin_promote",
    "torch_16",
    "torch_fp32",
    "nn_16",
    "nn_fp32",
    "torch_need_autocast_promote",
)
CUDA_LISTS = (
    "torch_fp16",
    "torch_fp32",
    "torch_need_autocast_promote",
    "nn_fp16",
    "nn_fp32",
    "linalg_fp16",
    "methods_fp16",
    "methods_fp32",
    "torch_expect_builtin_promote",
    "methods_expect_builtin_promote",
)


def _cases(lists: object, names: tuple[str, ...]) -> list[tuple[str, str, tuple, dict]]:
    """(list name, op, args, kwargs) for every entry of torch's named test lists."""
    cases = []
    for list_name in names:
        for entry in getattr(lists, list_name):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            cases.append((list_name, op, args, kwargs))
    return cases


def _cpu_cases() -> list[tuple[str, str, tuple, dict]]:
    return _cases(autocast_test_lists.AutocastCPUTestLists(torch.device("cpu")), CPU_LISTS)


def _cuda_cases() -> list[tuple[str, str, tuple, dict]]:
    return _cases(autocast_test_lists.AutocastTestLists(torch.device("cuda")), CUDA_LISTS)


def _variants(list_name: str, op: str, args: tuple) -> list[tuple[str, object, tuple]]:
    """(label, callable, args) for each Python spelling of ``op`` that exists."""
    found = []
    if list_name.startswith("methods"):
        return [(f"Tensor.{op}", getattr(torch.Tensor, op), args)]
    namespaces = [("torch", torch), ("torch._C._nn", torch._C._nn), ("F", F)]
    if list_name.startswith("linalg"):
        namespaces = [("torch.linalg", torch.linalg)]
    for label, ns in namespaces:
        fn = getattr(ns, op, None)
        if callable(fn):
            found.append((f"{label}.{op}", fn, args))
    if isinstance(args[0], torch.Tensor) and hasattr(torch.Tensor, op):
        found.append((f"Tensor.{op}", getattr(torch.Tensor, op), args))
    return found


def _run(fn, args, kwargs, region):
    with region:
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # both sides must fail the same way
            return error


def _assert_same(expected, actual, label):
    if isinstance(expected, Exception):
        assert type(actual) is type(expected), (
            f"{label}: torch raised {expected!r}, amped {actual!r}"
        )
        return
    assert not isinstance(actual, Exception), f"{label}: amped raised {actual!r}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{label}: dtype {actual.dtype} != {expected.dtype}"
        torch.testing.assert_close(actual, expected, **BITWISE, msg=label)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_same(e, a, f"{label}[{i}]")


def _check(device, list_name, op, args, kwargs, dtype):
    variants = _variants(list_name, op, args)
    assert variants, f"no Python variant of {op}"
    for label, fn, call_args in variants:
        expected = _run(fn, call_args, kwargs, torch.autocast(device, dtype=dtype))
        actual = _run(fn, call_args, kwargs, amped.autocast(device, dtype=dtype))
        _assert_same(expected, actual, f"{label} under {dtype}")


@pytest.fixture(params=[False, True], ids=["default-policy-passthrough", "engine=forced"])
def amped_only(request):
    """Each case runs twice, and the id says which check it is.

    ``engine=forced``: torch's C++ autocast never runs inside amped's region, so every
    cast comes from amped's engine; a pass shows the engine reproduced torch.
    ``default-policy-passthrough``: the default policy needs no engine, so the region
    only switches torch's autocast on; a pass shows that hand-off is exact, nothing more.
    """
    if request.param:
        with forced_path(Path.MODE, torch_alongside=False):
            yield request.param
    else:
        yield request.param


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("list_name", "op", "args", "kwargs"),
    _cpu_cases(),
    ids=[f"{c[0]}-{c[1]}" for c in _cpu_cases()],
)
def test_cpu_list_entry_matches_torch(list_name, op, args, kwargs, dtype, amped_only):
    _check("cpu", list_name, op, args, kwargs, dtype)


def test_engine_does_the_casting_not_torch():
    # Control for the test above: with torch's C++ autocast kept out, an op the policy
    # no longer lists is not cast at all, so the casts seen above are amped's.
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    policy = amped.Policy.preset("torch", "cpu").with_ops(keep=["mm"])
    with forced_path(Path.MODE, torch_alongside=False), amped.autocast("cpu", policy=policy):
        assert torch.mm(a, b).dtype == torch.float32
        assert torch.matmul(a, b).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lists_match_torch():
    for dtype in LOW_DTYPES[::-1]:
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        for list_name, op, args, kwargs in _cuda_cases():
            _check("cuda", list_name, op, args, kwargs, dtype)
