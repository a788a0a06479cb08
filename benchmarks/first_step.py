"""First-step cost of every compiled path: cold (an empty Inductor cache) and warm.

Each case trains 3 steps of a 4-layer MLP (512 wide: each weight 2**18 elements, the
size from which the FP8/block casts run compiled) in a process of its own and records
the first step and the median of the others. "cold" runs with ``TORCHINDUCTOR_CACHE_DIR``
a fresh folder; "warm" is a second process on the same folder, as a second ``amped
compare`` (or a probe's process) finds it. The cases:

* ``bf16-pure-8bit``: the fused 8-bit AdamW step (quantized moments);
* ``bf16-pure``: the fused compensated (Kahan) AdamW step;
* ``bf16-master``: the fused master-weight AdamW step;
* ``fp8-rowwise``, ``mxfp8``: the compiled casts (and bf16-mixed's AdamW).

The step time is what ``amped compare``'s warm-up (docs/compare.md) takes out of the
budget; ``first - later`` is the compile (or the cache load). Print the load with the
figures: compiles are CPU-bound and slow down in proportion.

    python benchmarks/first_step.py [--threads 1] [--cases bf16-pure-8bit,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("bf16-pure-8bit", "bf16-pure", "bf16-master", "fp8-rowwise", "mxfp8")
ROOT = Path(__file__).resolve().parent.parent


def _child(recipe: str, threads: int) -> dict[str, float]:
    """Runs in the measured process: 3 steps of ``recipe``, each timed."""
    import torch

    import amped

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    x = torch.randn(64, width)
    times = []
    for _ in range(3):
        began = time.perf_counter()
        with setup.autocast():
            loss = setup.model(x).float().square().mean()
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        loss.item()
        times.append(time.perf_counter() - began)
    return {"first_s": times[0], "later_s": statistics.median(times[1:])}


def _run(recipe: str, threads: int, cache: str) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    command = [sys.executable, __file__, "--child", recipe, "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{recipe}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.threads)))
        return
    rows = []
    for recipe in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            cold = _run(recipe, args.threads, cache)
            warm = _run(recipe, args.threads, cache)
        rows.append({"recipe": recipe, "cold": cold, "warm": warm})
        if not args.json:
            print(
                f"{recipe:<15} cold first {cold['first_s']:7.2f} s  warm first "
                f"{warm['first_s']:6.2f} s  later {warm['later_s'] * 1e3:7.1f} ms",
                flush=True,
            )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.json:
        print(json.dumps({"threads": args.threads, "load_1min": load, "cases": rows}, indent=2))
    else:
        print(f"threads {args.threads}, load average (1 min) at the end: {load}")


if __name__ == "__main__":
    main()
