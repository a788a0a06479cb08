"""Every example runs as a user runs it; the tutorial's autocast example, rewritten with
amped, prints what the tutorial shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT

EXAMPLES = ROOT / "examples"


def tutorial_lines() -> list[str]:
    """What examples/tutorial_autocast.py prints: the lines the tutorial shows."""
    low = "torch.float16" if torch.cuda.is_available() else "torch.bfloat16"
    return [
        "默认张量类型: torch.float32",
        "新创建张量类型: torch.float32",
        "新创建张量类型: torch.float16",
        "-" * 50,
        "torch.float32 torch.float32",
        "torch.mm(a, b): torch.float32",
        f"autocast torch.mm(a, b): {low}",
        "autocast torch.add(a, b): torch.float32",
    ]


# --- every example, as a user runs it after the README's first set-up ----------------


# What `pip install -e ".[cli]"` does not install: the test and dev extras, and what
# transformers brings. The examples run with these imports blocked, as in a fresh
# `[cli]` virtual environment (numpy stays: matplotlib needs it).
NOT_IN_CLI = ("transformers", "tokenizers", "safetensors", "huggingface_hub", "pytest",
              "_pytest", "pytest_timeout", "hypothesis", "expecttest", "ruff", "mypy")  # fmt: skip


def _cli_only_venv(root: Path) -> Path:
    """A fresh virtual environment that sees this one's packages except :data:`NOT_IN_CLI`.

    Installing `.[cli]` from scratch would download torch; linking the installed
    packages gives the same set of importable modules in a second, without it.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)  # fmt: skip
    shelf = root / "packages"
    shelf.mkdir()
    site = Path(torch.__file__).resolve().parent.parent
    for entry in site.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if top in NOT_IN_CLI or "amped" in entry.name.lower() or entry.suffix == ".pth":
            continue
        (shelf / entry.name).symlink_to(entry)
    python = root / "venv" / "bin" / "python"
    venv_site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    (venv_site / "cli-only.pth").write_text(f"{ROOT / 'src'}\n{shelf}\n")
    return python


COMMANDS = {
    "tutorial_autocast.py": [],
    "tutorial_gradscaler.py": [],
    "compare_factory.py": ["--recipes", "fp32,bf16", "--steps", "3", "--max-time", "0",
                           "--peak-memory", "in-process", "--no-progress", "--out", "{out}"],
    "doctor_reports.py": [],
    "ddp_train.py": ["--recipes", "fp32,bf16-mixed", "--steps", "2"],
}  # fmt: skip
"""Each example's arguments (short runs of its documented command); ``{out}``: a temp folder."""


def _git_status() -> str | None:
    try:
        done = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def test_every_example_is_listed():
    assert sorted(COMMANDS) == sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_examples_import_nothing_from_tests():
    for example in EXAMPLES.glob("*.py"):
        text = example.read_text()
        assert "tests" not in {line.split()[1] for line in text.splitlines()
                               if line.startswith(("import ", "from "))}, example  # fmt: skip
        assert "sys.path" not in text, f"{example.name} changes sys.path"


@pytest.mark.slow
def test_every_example_runs_with_only_the_cli_extra_and_leaves_git_clean(tmp_path):
    python = _cli_only_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    missing = subprocess.run([str(python), "-c", "import transformers"], env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert "No module named 'transformers'" in missing.stderr  # the control
    before = _git_status()
    for name, args in COMMANDS.items():
        out = tmp_path / name.removesuffix(".py")
        command = [str(python), f"examples/{name}", *(a.format(out=out) for a in args)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        if name == "doctor_reports.py":
            assert "gpt2-healthy-bf16: skipped: needs transformers" in done.stdout
        if name == "tutorial_autocast.py":  # the tutorial's autocast example, with amped
            assert done.stdout.splitlines() == tutorial_lines()
    assert _git_status() == before  # nothing written into the checkout
