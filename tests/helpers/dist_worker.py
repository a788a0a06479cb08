"""One rank of a distributed test. Usage (under torchrun's environment variables)::

    python dist_worker.py OUT_DIR [--slow] [--resume DIR] SCENARIO [SCENARIO ...]

Joins the gloo process group that ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` describe (with a bounded time-out on every collective), runs the
scenarios of :mod:`dist_scenarios` in order and saves each one's results as
``OUT_DIR/SCENARIO.rankR.pt``. On an error (a collective fails when another rank
dies) it says so on stderr and exits with code 3, without waiting on the process
group again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from dist_scenarios import SCENARIOS, Options

from amped.checkpoint import save_checkpoint

FAILED_EXIT = 3


def parse() -> tuple[Options, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    return Options(args.out, args.slow, args.resume), args.scenarios


def run(options: Options, scenarios: list[str], rank: int) -> None:
    for name in scenarios:
        result = SCENARIOS[name](rank, options)
        save_checkpoint(options.out / f"{name}.rank{rank}.pt", **result)
        print(f"done {name}", flush=True)


def main() -> None:
    options, scenarios = parse()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=float(os.environ["AMPED_COLLECTIVE_TIMEOUT_S"]))
    dist.init_process_group("gloo", timeout=timeout)
    try:
        run(options, scenarios, rank)
    except Exception as error:  # gloo raises RuntimeError when a peer's socket closes
        traceback.print_exc()
        print(
            f"dist_worker rank {rank}: stopped by {type(error).__name__}. If another rank "
            "died, restart every rank: they resume from the last checkpoint.",
            file=sys.stderr,
            flush=True,
        )
        # Skip destroy_process_group and interpreter teardown: both may wait on the
        # dead peer. The results of finished scenarios are already on disk.
        os._exit(FAILED_EXIT)
    dist.barrier()  # no rank tears its group down while a peer's collective is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
