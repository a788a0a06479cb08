"""SIGKILL in the middle of save_checkpoint, many times, for test_checkpoint_faults.

Usage: python checkpoint_kill_worker.py FOLDER TRIALS SEED

Imports torch once, then per trial forks a child that saves a ~1 MiB checkpoint over
and over (``weight`` filled with the step, so a mix of two saves is visible), writing
each step to a pipe once its save has returned. The parent kills the child with
SIGKILL after a random delay, then checks: the checkpoint loads, holds a step at least
the last one the child reported, and its weight is all that step; at most one
temporary (the killed save's) is left. Prints one JSON line with the tallies.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

from amped.checkpoint import load_checkpoint, save_checkpoint

SIZE = 1 << 18  # float32 elements: 1 MiB, so a kill often lands inside a save


def child(path: str, write_end: int, start: int) -> None:
    step = start
    while True:
        step += 1
        save_checkpoint(path, weight=torch.full((SIZE,), float(step)), step=step)
        os.write(write_end, f"{step}\n".encode())


def trial(folder: str, path: str, rng: random.Random, start: int) -> dict[str, int]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns
        os.close(read_end)
        try:
            child(path, write_end, start)
        finally:
            os._exit(1)
    os.close(write_end)
    time.sleep(rng.uniform(0.0, 0.08))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    reported = os.read(read_end, 1 << 20).decode().split()
    os.close(read_end)
    last = int(reported[-1]) if reported else start
    temporaries = [n for n in os.listdir(folder) if n.endswith(".tmp")]
    result = {"last_reported": last, "temporaries": len(temporaries), "loaded_step": -1}
    if os.path.exists(path):
        state = load_checkpoint(path)
        weight, step = state["weight"], state["step"]
        if not torch.equal(weight, torch.full((SIZE,), float(step))):
            raise SystemExit(f"torn checkpoint: step {step} with other weights")
        result["loaded_step"] = step
    return result


def main() -> None:
    folder, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    path = os.path.join(folder, "run.pt")
    rng = random.Random(seed)
    results, start = [], 0
    for _ in range(trials):
        result = trial(folder, path, rng, start)
        results.append(result)
        start = max(start, result["loaded_step"], result["last_reported"])
    # One more save by another process: it must clear the last killed save's temporary.
    save_checkpoint(path, weight=torch.full((SIZE,), float(start + 1)), step=start + 1)
    left = [n for n in os.listdir(folder) if n.endswith(".tmp")]
    print(json.dumps({"trials": results, "left_after_clean_save": left}), flush=True)


if __name__ == "__main__":
    main()
