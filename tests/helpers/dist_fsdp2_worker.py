"""One rank of the FSDP2 tests, every scenario in one process launch (run by
tests/distributed/test_fsdp2_pure.py and tests/distributed/test_fp8_distributed.py through
``dist_launch.ranks_results``, with torchrun's environment): the bf16-pure recipes
(:mod:`dist_fsdp_worker`), FP8 and FP4 weights on the wire
(:mod:`dist_fp8_wire_worker`) and fp8-delayed's amax agreement under DDP and FSDP2
(:mod:`dist_fp8_worker`). Saves ``OUT_DIR/rankR.pt``:
``{"fp8": ..., "pure": ..., "wire": ...}``; each scenario's CPU and wall seconds go to
the rank's stdout (``rankR.out``).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import dist_fp8_wire_worker
import dist_fp8_worker
import dist_fsdp_worker
import torch
import torch.distributed as dist
from dist_models import clock


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ["AMPED_COLLECTIVE_TIMEOUT_S"]))
    dist.init_process_group("gloo", timeout=timeout)
    try:
        with clock("fp8/ddp, fp8/fsdp"):
            fp8 = {"ddp": dist_fp8_worker.ddp(rank), "fsdp": dist_fp8_worker.fsdp(rank)}
        results = {
            "fp8": fp8,
            "pure": dist_fsdp_worker.scenarios(rank, world, out),
            "wire": dist_fp8_wire_worker.scenarios(rank, world, out),
        }
        torch.save(results, out / f"rank{rank}.pt")
        # Every rank reaches this point before any tears its group down: a rank that
        # destroys its group while a peer's last collective is still in flight can
        # abort in gloo's teardown ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
