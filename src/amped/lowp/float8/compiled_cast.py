"""The block casts run as compiled kernels: one pass over memory instead of ten.

A block cast (amax, scale, saturate, round, and for the emulated GEMM the product with
the block scale) is some ten elementwise torch ops; run eagerly on a CPU each is a
separate memory-bound loop. :func:`run` calls the same Python function compiled by
``torch.compile`` (Inductor's C++), which fuses them into one or two loops. The
function is the cast's only definition: run compiled or eagerly it computes the same
values, bit for bit (tests/lowp/mx/test_fp8_compiled_cast.py), because it is written so that a
compiler has nothing to reassociate or contract, and compiled with reassociation and
FMA contraction off (:data:`EXACT_FLOATING_POINT`): float32 arithmetic throughout, each
step one rounding of exact operands, random draws an integer hash of a key passed in
(:func:`amped.lowp.mx.element_round.hashed_uniform`). Other one-pass functions run here
too: the FP8 recipes' casts and scaled GEMM results (:mod:`amped.lowp.float8.gemm`).

**Shapes.** Each kernel is compiled for one static shape (and stride), input dtype,
cast setting and thread count: static kernels run about five times faster than
dynamic-size ones on a CPU (37 against 7 ms for a 2048 x 2048 cast), and a model's
layers have few shapes. Each compiles in a few seconds, once per process (see
docs/fp8.md for the figures). Past :data:`STATIC_SHAPES` shapes of one setting (a
varying sequence length, say), further shapes share one dynamic-size kernel.

**Never traced inside an autocast region.** The casts are called inside autocast
regions (a layer's forward), where a compile would otherwise move the region to amped's
mode (docs/engine.md, "torch.compile") and its graph would be guarded on the region's
autocast state. So every compiled call runs on the calling thread under
:func:`amped.autocast_mode.compiling.outside_regions`: ``no_grad``, autocast off on
every device type, and a compile that leaves the thread's regions as they are; its
compiles and Dynamo's guards only ever see that state, and no thread is started.

**Where eager.** For tensors under :data:`MIN_ELEMENTS`, off CPU, inside a user's
``torch.compile`` (Dynamo then traces the function itself), and under any Python
dispatch or function mode (a mode would not see the compiled kernel's ops, and
``torch.compile`` skips frames under one), the function runs eagerly.
A compile that fails (no C++ compiler, an Inductor error) is reported once, as a
warning, and the process keeps the eager casts: the same values, more slowly.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from amped._internal import testing, torch_compat
from amped.autocast_mode import compiling

__all__ = [
    "EXACT_FLOATING_POINT",
    "MIN_ELEMENTS",
    "STATIC_SHAPES",
    "compiled_kernels",
    "compiles",
    "run",
]

STATIC_SHAPES = 16
"""Shapes compiled statically per kernel setting; more share one dynamic-size kernel."""

EXACT_FLOATING_POINT: dict[str, str | int | bool | Callable[..., Any]] = {
    "cpp.enable_unsafe_math_opt_flag": False,
    "cpp.enable_floating_point_contract_flag": "off",
}
"""Inductor options every kernel is compiled with, whatever the process's environment
says (``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG`` and
``..._FLOATING_POINT_CONTRACT_FLAG``): the casts' rounding arithmetic (e.g.
:func:`amped.lowp.float8.cast.fp8_grid`) is exact only if no operation is reassociated or
fused into an FMA, and either flag gives other bits
(tests/lowp/float8/test_fp8_cast_compiled.py)."""

MIN_ELEMENTS = 1 << 18
"""Tensors with fewer elements (a 512 x 512 operand) cast eagerly: a kernel takes
seconds to compile, which a small tensor's casts (microseconds to a millisecond each)
earn back only over thousands of steps, and a small model's short run (``amped
compare``'s built-in task, ``amped tune``'s verification runs) never does."""

_compiled: dict[tuple[Hashable, ...], Callable[..., Any]] = {}
_shapes: dict[tuple[Hashable, ...], int] = {}  # setting -> static shapes compiled
_broken: dict[str, str] = {}  # device type -> why compiling failed there


def _kernel(function: Callable[..., Any], spec: Hashable, x: torch.Tensor) -> Callable[..., Any]:
    """``function`` compiled for ``spec`` and ``x``'s dtype, shape, strides and threads.

    Each key gets a code object of its own: Dynamo keeps its graphs, and counts
    recompilations against its limit, per code object.
    """
    threads = torch.get_num_threads()  # Inductor's C++ fixes its thread count at compile
    setting = (function.__name__, spec, x.dtype, x.dim(), threads)
    key: tuple[Hashable, ...] = (*setting, tuple(x.shape), x.stride())
    compiled = _compiled.get(key) or _compiled.get((*setting, "dynamic"))
    if compiled is not None:
        return compiled
    dynamic = _shapes.get(setting, 0) >= STATIC_SHAPES
    if dynamic:
        key = (*setting, "dynamic")
    else:
        _shapes[setting] = _shapes.get(setting, 0) + 1
    name = f"{function.__name__}_{len(_compiled)}"
    code = function.__code__.replace(co_name=name)
    variant = types.FunctionType(code, function.__globals__, name, function.__defaults__)
    compiled = torch.compile(variant, dynamic=dynamic, fullgraph=True, options=EXACT_FLOATING_POINT)
    _compiled[key] = compiled
    return compiled


def compiled_kernels() -> int:
    """How many kernels this process has compiled (one per setting and static shape)."""
    return len(_compiled)


def compiles(x: torch.Tensor) -> bool:
    """Whether :func:`run` would call the compiled kernel for ``x`` (see the module; the
    tests choose with :data:`amped._internal.testing.CASTS`)."""
    how = testing.CASTS
    return (
        how != "eager"
        and x.device.type == "cpu"
        and (how == "compiled" or x.numel() >= MIN_ELEMENTS)
        and "cpu" not in _broken
        and not torch.compiler.is_compiling()
        and not torch_compat.python_mode_active()
    )


def run(function: Callable[..., Any], spec: Hashable, x: torch.Tensor, *args: Any) -> Any:
    """``function(spec, x, *args)``, compiled where it can be (see the module doc).

    ``function`` is a pure function of tensors; ``spec`` a hashable value of its static
    settings (Python numbers, strings, dtypes), fixed per compiled kernel.
    """
    if not compiles(x):
        with torch.no_grad():
            return function(spec, x, *args)
    try:
        return compiling.outside_regions(_kernel(function, spec, x), spec, x, *args)
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        _broken["cpu"] = reason
        warnings.warn(
            f"amped could not compile its FP8 and block cast kernels on cpu ({reason}); the "
            "casts run eagerly, which gives the same values more slowly",
            RuntimeWarning,
            stacklevel=3,
        )
        with torch.no_grad():
            return function(spec, x, *args)
