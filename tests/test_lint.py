"""The code base passes its own linters: ruff (lint and format) and mypy on src/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _ruff() -> str | None:
    beside = Path(sys.executable).parent / "ruff"
    return str(beside) if beside.exists() else shutil.which("ruff")


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed")
def test_ruff_lint_and_format():
    ruff = _ruff()
    assert ruff is not None
    lint = _run(ruff, "check", "src", "tests", "benchmarks", "examples")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run(ruff, "format", "--check", "src", "tests", "benchmarks", "examples")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.slow
def test_mypy_on_the_package():
    pytest.importorskip("mypy")
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr
