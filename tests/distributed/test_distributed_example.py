"""examples/ddp_train.py runs under the documented torchrun command, on 2 CPU processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_launch import LOOPBACK, free_port
from repo_paths import ROOT

EXAMPLE = ROOT / "examples" / "ddp_train.py"


@pytest.mark.slow
def test_ddp_example_trains_on_two_ranks_and_saves_a_checkpoint(tmp_path: Path):
    checkpoint = tmp_path / "ckpt.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # torchrun
        "--nproc_per_node=2",
        f"--master_addr={LOOPBACK}",
        f"--master_port={free_port()}",
        str(EXAMPLE),
        "--recipes=bf16-mixed,fp16-master",
        "--steps=4",
        "--print-every=1",
        f"--checkpoint={checkpoint}",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        for recipe in ("bf16-mixed", "fp16-master"):
            losses = re.findall(rf"rank {rank} {recipe} +step +\d+ loss (\d+\.\d+)", out.stdout)
            assert len(losses) == 4, out.stdout
    assert checkpoint.exists()
