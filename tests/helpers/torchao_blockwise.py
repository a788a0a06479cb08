"""torchao's pure-torch blockwise FP8 reference casts, loaded without Triton.

``torchao.prototype.blockwise_fp8_training.kernels`` imports Triton at its top, which a
CPU-only install lacks; its reference functions (``torch_blockwise_scale_act_quant_lhs``,
``torch_blockwise_scale_act_quant_rhs``, ``torch_blockwise_scale_weight_quant``) use
torch alone. This reads their source from torchao's own file and runs it unchanged, with
the two module constants they read (``EPS``, ``FP8_E4M3_DTYPES``) taken from that file
too, so the tests compare against torchao's code and not a copy of it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
from typing import Any

import torch

NAMES = (
    "torch_blockwise_scale_act_quant_lhs",
    "torch_blockwise_scale_act_quant_rhs",
    "torch_blockwise_scale_weight_quant",
)
CONSTANTS = ("EPS", "FP8_E4M3_DTYPES")


def kernels_path() -> pathlib.Path | None:
    """torchao's blockwise kernels file, or None where torchao is not installed."""
    spec = importlib.util.find_spec("torchao")
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "prototype/blockwise_fp8_training/kernels.py"
    return path if path.exists() else None


def _wanted(node: ast.stmt) -> bool:
    """A definition of one of :data:`NAMES` or an assignment of one of :data:`CONSTANTS`."""
    if isinstance(node, ast.FunctionDef):
        return node.name in NAMES
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id in CONSTANTS for t in node.targets)
    return False


@functools.cache
def load_reference() -> dict[str, Any]:
    """``{name: function}`` for :data:`NAMES`, compiled from torchao's source."""
    path = kernels_path()
    assert path is not None
    tree = ast.parse(path.read_text())
    keep = [node for node in tree.body if _wanted(node)]
    module = ast.Module(body=keep, type_ignores=[])
    namespace: dict[str, Any] = {
        "torch": torch,
        "Tuple": tuple,
        "e4m3_dtype": torch.float8_e4m3fn,
    }
    exec(compile(module, str(path), "exec"), namespace)
    missing = [n for n in NAMES if n not in namespace]
    assert not missing, f"torchao's {path} no longer defines {missing}"
    return {n: namespace[n] for n in NAMES}
