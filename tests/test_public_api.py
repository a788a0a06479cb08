"""The public surface is exactly what amped/__init__.py and each subpackage's
``__init__.py`` export (docs/architecture.md: anything else is private), and importing
amped never pulls in the optional CLI dependencies."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import amped

EXPECTED = {
    "Cast",
    "GradScaler",
    "ModuleRule",
    "Policy",
    "Recipe",
    "__version__",
    "autocast",
    "autocast_op",
    "compare",
    "current_policy",
    "custom_bwd",
    "custom_fwd",
    "doctor",
    "export",
    "memory_report",
    "monitor",
    "prepare",
    "scaled_dot_product_attention",
    "tune",
    "verify",
}


# Each subpackage's deliberate exports. A change here is an API change: say so in the
# changelog of the release, and in docs/api.md.
SUBPACKAGE_EXPECTED = {
    "policy": {"Cast", "ModuleRule", "Policy"},
    "autocast_mode": {
        "autocast",
        "autocast_op",
        "current_path",
        "current_policy",
        "custom_bwd",
        "custom_fwd",
    },
    "scaling": {"GradScaler", "ScaleStallError", "ScaleStrategy"},
    "checkpoint": {"CheckpointError", "load_checkpoint", "save_checkpoint"},
    "lowp": {
        "CONFIGS",
        "AttentionConfig",
        "BlockConfig",
        "BlockLinear",
        "Float8Config",
        "Float8Linear",
        "convert_to_low_precision",
        "scaled_dot_product_attention",
    },
    # Deprecated for one release: its old names warn and resolve in amped.lowp.
    "fp8": set(),
    "optim": {
        "CompensatedAdamW",
        "CompensatedAdamW8bit",
        "CompensatedSGD",
        "MasterWeightOptimizer",
        "step_in_backward",
    },
    "recipes": {
        "NonFiniteError",
        "PrecisionPlan",
        "Recipe",
        "memory_report",
        "monitor",
        "prepare",
    },
    "doctor": {"diagnose", "diagnose_low_precision", "replay"},
    "tasks": {"Task"},
    "tuning": {"tune"},
    "comparison": {"compare"},
    "verification": {"verify"},
    "exporting": {"export"},
    # Each framework adapter is a module of its own (amped.integrations.lightning, ...),
    # imported only when used; the package itself exports nothing.
    "integrations": set(),
    "cli": set(),
}

PUBLIC_NAMES_AT_MOST = 45
"""What a user needs, each documented in docs/api.md: the library's entry points, the
optimizers, the low-precision configs and layers, and their one conversion, the
checks of a run (``verify``, ``doctor.replay``) and ``export``. What amped hands back
(a setup, a result, ``GradScaler.strategy``'s built-in strategies) is not counted."""


def _public_names() -> set[str]:
    names = set(EXPECTED)
    for package in SUBPACKAGE_EXPECTED:
        names |= set(importlib.import_module(f"amped.{package}").__all__)
    return names


def test_the_public_surface_is_small():
    assert len(_public_names()) <= PUBLIC_NAMES_AT_MOST


def test_every_public_name_is_in_docs_api():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = sorted(
        name
        for name in _public_names()
        if not re.search(rf"`amped(\.[a-z_0-9]+)*\.{re.escape(name)}`", text)
    )
    assert not missing, f"public names not documented in docs/api.md: {missing}"


@pytest.mark.parametrize("package", sorted(SUBPACKAGE_EXPECTED))
def test_each_subpackage_exports_exactly_its_deliberate_names(package):
    module = importlib.import_module(f"amped.{package}")
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"amped.{package}.__all__ repeats a name"
    assert set(exported) == SUBPACKAGE_EXPECTED[package]
    for name in exported:
        assert hasattr(module, name), f"amped.{package}.__all__ names missing {name!r}"


def test_every_subpackage_is_pinned():
    # A new subpackage states its exports here; amped._internal is private as a whole.
    found = {info.name for info in pkgutil.iter_modules(amped.__path__)}
    packages = {name for name in found if name not in {"__main__", "_internal"}}
    assert packages == set(SUBPACKAGE_EXPECTED)


def test_all_is_exactly_the_public_api():
    assert set(amped.__all__) == EXPECTED
    for name in amped.__all__:
        assert hasattr(amped, name), name


def test_public_callables_have_docstrings():
    for name in amped.__all__:
        obj = getattr(amped, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"


@pytest.mark.slow
def test_import_does_not_load_cli_dependencies():
    code = "import sys, amped; print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
