"""The public surface is exactly what amped/__init__.py exports, and importing amped
never pulls in the optional CLI dependencies."""

from __future__ import annotations

import subprocess
import sys

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
