"""The seed tutorial's autocast examples, rewritten with amped, print what the seed shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_seed_autocast_example_prints_what_the_seed_shows():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "seed_autocast.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    low = "torch.float16" if torch.cuda.is_available() else "torch.bfloat16"
    assert out.splitlines() == [
        "默认张量类型: torch.float32",
        "新创建张量类型: torch.float32",
        "新创建张量类型: torch.float16",
        "-" * 50,
        "torch.float32 torch.float32",
        "torch.mm(a, b): torch.float32",
        f"autocast torch.mm(a, b): {low}",
        "autocast torch.add(a, b): torch.float32",
    ]
