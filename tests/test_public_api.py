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
    "ScaleRecord",
    "TrainSetup",
    "__version__",
    "autocast",
    "autocast_op",
    "current_policy",
    "custom_bwd",
    "custom_fwd",
    "doctor",
    "get_autocast_dtype",
    "is_autocast_enabled",
    "memory_report",
    "prepare",
}


# Each subpackage's deliberate exports. A change here is an API change: say so in the
# changelog of the release.
SUBPACKAGE_EXPECTED = {
    "policy": {
        "Cast",
        "ModuleRule",
        "Policy",
    },
    "autocast_mode": {
        "autocast",
        "autocast_op",
        "current_policy",
        "custom_bwd",
        "custom_fwd",
        "engine_always",
        "get_autocast_dtype",
        "is_autocast_enabled",
    },
    "scaling": {
        "Bounded",
        "CheckpointError",
        "DynamicScale",
        "GradScaler",
        "GrowthFactors",
        "Hysteresis",
        "ScaleRecord",
        "ScaleState",
        "ScaleStrategy",
        "StaticScale",
        "load_checkpoint",
        "save_checkpoint",
    },
    "fp8": {
        "CastRule",
        "DelayedScaling",
        "FP8_CONFIGS",
        "Float8Linear",
        "Fp8Config",
        "Fp8Layers",
        "Fp8Tensor",
        "ModuleFilter",
        "convert_to_fp8",
        "default_module_filter",
        "plan_fp8",
        "quantize",
        "scaled_mm",
        "sqnr",
    },
    "recipes": {
        "CompensatedAdamW",
        "CompensatedAdamW8bit",
        "CompensatedSGD",
        "InBackward",
        "MasterWeightOptimizer",
        "MemoryReport",
        "OPT_IN_RECIPES",
        "RECIPES",
        "Recipe",
        "TrainSetup",
        "memory_report",
        "prepare",
        "recipe_names",
        "register",
        "resolve_recipe",
        "step_in_backward",
    },
    "doctor": {
        "Fp8Report",
        "Fp8Suggestion",
        "Report",
        "Suggestion",
        "diagnose",
        "diagnose_fp8",
    },
    # Each framework adapter is a module of its own (amped.integrations.lightning, ...),
    # imported only when used; the package itself exports nothing.
    "integrations": set(),
    "cli": {
        "Task",
        "save_doctor_html",
        "save_doctor_plot",
    },
}


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


def test_import_does_not_load_cli_dependencies():
    code = "import sys, amped; print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
