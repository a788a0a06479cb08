"""The tutorial's GradScaler examples, run with amped, print what the tutorial shows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from repo_paths import ROOT

EXAMPLE = ROOT / "examples" / "tutorial_gradscaler.py"

# The tutorial's output on CUDA, without the device suffix the CPU does not print.
TUTORIAL_OUTPUT = """\
tensor(7., grad_fn=<AddBackward0>)
tensor(4.)
tensor(1.6000, requires_grad=True)
--------------------------------------------------
tensor(7., grad_fn=<AddBackward0>)
缩放因子: 65536.0 梯度值: tensor(262144.)
tensor(1.6000, requires_grad=True)
65536.0
"""


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("tutorial_gradscaler", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tutorial_gradscaler_examples_print_the_tutorial_output(example, capsys) -> None:
    example.test03("cpu")
    print("-" * 50)
    example.test04("cpu")
    assert capsys.readouterr().out == TUTORIAL_OUTPUT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the tensors print their device")
def test_tutorial_gradscaler_script_runs_as_the_readme_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout == TUTORIAL_OUTPUT
