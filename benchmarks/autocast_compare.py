"""The engine before and after a change, one machine, one run: old commit vs this tree.

Runs ``benchmarks/autocast_overhead.py --json`` of an old commit (extracted once with
``git archive``, its ``src`` on PYTHONPATH) and of this tree, alternately (old, new, new,
old, ...), each in its own process, and prints for every path (the overhead script's
sides) the medians over rounds of:

* added us per listed op (``F.linear``) and per untouched op (``torch.add``), and per
  region enter+exit, each against torch.autocast in the same process;
* the eager train-step ratio to torch.autocast on each model (the new tree's: the
  median of every round's ABBA blocks, pooled, with a bootstrap 95 % interval of that
  median; a tree whose overhead script writes no blocks gives its rounds' medians);

then new minus old, against the targets of issue 23: no path slower by more than 0.2 us
per call or 1 us per region; step ratios <= 1.02 on every non-diagnostic path ("engine",
the forced mode, is the diagnostic one): "ok" where the whole interval is at most 1.02,
"over 1.02" where all of it is above, "within noise of 1.02" where it straddles 1.02
(rerun longer or quieter). Per call and per region the interval is the range of the
rounds' new minus old (round by round: one old and one new process each), judged the
same way against 0.2 us and 1 us. The side names are the same on both commits; what each runs is
described in each commit's overhead script (e.g. "module": old, a parked lean mode;
new, torch's autocast plus module hooks).

Print the CPU and the load average with the figures: on a shared machine, rerun it
quieter before trusting a difference under the noise (the spread across rounds is
printed too).

    python benchmarks/autocast_compare.py [--old bdcfd6f] [--rounds 3] [--repeats 5]
        [--models encoder,gpt2,cnn] [--calls 500]

``--repeats`` counts the samples per side and tree over all rounds: each process takes
``ceil(repeats / rounds)`` of them (the overhead script takes at least 5 per-call and
per-region samples, and per step one ABBA block per side and repeat). A new-tree process
took 58 s at 4 repeats (load average 2.5-3; bdcfd6f's, which times one step per side and
repeat, less), ``--rounds 2 --repeats 10`` 4 min 22 s, so ``--rounds 4 --repeats 15`` (8
processes of 4 repeats) takes about 7 to 8 minutes. At a load of 3 a step ratio's 95 %
interval is about +-0.02 to 0.04 with 10 pooled blocks: resolving 0.01 needs an idle
machine and more blocks (e.g. ``--rounds 8 --repeats 64``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autocast_overhead import FEW_BLOCKS, FEW_BLOCKS_NOTE, interval

from amped.comparison.environment import cpu_name

ROOT = Path(__file__).resolve().parents[1]
CALL_KINDS = {"listed op": "listed op (F.linear)", "untouched op": "untouched op (torch.add)"}
DIAGNOSTIC = {"engine"}


def old_tree(commit: str) -> Path:
    """The files of ``commit`` (``git archive``, extracted once under the system's temp
    directory: no worktree is registered in the repository)."""
    where = Path(tempfile.gettempdir()) / f"amped-{commit}"
    if not (where / "src").exists():
        where.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
            check=True,
            capture_output=True,
        )
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def run_once(tree: Path, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        target = Path(out.name)
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree / 'benchmarks'}"}
    command = [
        sys.executable,
        str(tree / "benchmarks" / "autocast_overhead.py"),
        "--no-compile",
        f"--repeats={math.ceil(args.repeats / args.rounds)}",
        f"--models={args.models}",
        f"--calls={args.calls}",
        f"--json={target}",
    ]
    subprocess.run(command, check=True, env=env, cwd=tree, capture_output=True, text=True)
    figures = json.loads(target.read_text())
    target.unlink()
    return figures


def blocks(figures: dict) -> dict[tuple[str, str], list[float]]:
    """(step measure, side) -> the ABBA blocks' step ratios (trees whose overhead script
    writes them: ``train_step_blocks``; older ones write medians only)."""
    return {
        (f"step {model}", side): values
        for model, ratios in figures.get("train_step_blocks", {}).items()
        for side, values in ratios.items()
    }


def verdict(low: float, high: float, limit: float, over: str) -> str:
    """ "ok" where the whole interval meets ``limit``, ``over`` where none of it does."""
    if high <= limit:
        return "ok"
    return over if low > limit else f"within noise of {limit}"


def flatten(figures: dict) -> dict[tuple[str, str], float]:
    """(measure, side) -> value, for the measures compared here."""
    flat = {}
    for label, key in CALL_KINDS.items():
        for side, value in figures["per_call_us"][key].items():
            flat[(label, side)] = value
    for side, value in figures["per_region_us"].items():
        flat[("region", side)] = value
    for model, ratios in figures["train_step_ratio"].items():
        for side, value in ratios.items():
            flat[(f"step {model}", side)] = value
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="bdcfd6f", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--repeats", type=int, default=5, help="samples per side and tree, over all rounds"
    )
    parser.add_argument("--models", default="encoder,gpt2,cnn")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed sample")
    args = parser.parse_args()
    trees = {"old": old_tree(args.old), "new": ROOT}
    runs: dict[str, list[dict[tuple[str, str], float]]] = {"old": [], "new": []}
    pooled: dict[tuple[str, str], list[float]] = {}  # the new tree's blocks, all rounds
    for i in range(args.rounds):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            figures = run_once(trees[name], args)
            runs[name].append(flatten(figures))
            if name == "new":
                for key, values in blocks(figures).items():
                    pooled.setdefault(key, []).extend(values)
            print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    cpu = cpu_name()
    load = os.getloadavg()
    per_process = math.ceil(args.repeats / args.rounds)
    print(f"old {args.old} vs new (this tree); {args.rounds} rounds x {per_process} repeats")
    print(f"CPU {cpu}, {os.cpu_count()} cores; load average {load[0]:.2f} {load[1]:.2f}")
    print("per call / region: added us vs torch.autocast; steps: ratio to torch.autocast")
    print(
        "steps: new is the median of the new tree's ABBA blocks' ratios (all rounds), "
        "interval a bootstrap 95 % interval of that median"
    )
    print("per call / region: interval is the range of the rounds' new-old (paired by round)")
    fewest = min((len(values) for values in pooled.values()), default=0)
    if fewest < FEW_BLOCKS:
        print(f"note: {fewest} blocks per side: {FEW_BLOCKS_NOTE}")
    print(
        f"{'measure':16s} {'side':8s} {'old':>8s} {'new':>8s} {'new-old':>8s}  spread(new)  "
        f"{'interval':>15s}  verdict"
    )
    keys = [k for k in runs["new"][0] if all(k in r for r in runs["old"])]
    for key in keys:
        old = statistics.median(r[key] for r in runs["old"])
        values = [r[key] for r in runs["new"]]
        new = statistics.median(values)
        spread = max(values) - min(values)
        measure, side = key
        if measure.startswith("step"):
            if key in pooled:
                new = statistics.median(pooled[key])
                low, high = interval(pooled[key])
            else:  # a tree without blocks: the rounds' medians
                low, high = interval(values)
            between = f"{low:.3f} to {high:.3f}"
            judged = verdict(low, high, 1.02, "over 1.02")
            judged = "diagnostic" if side in DIAGNOSTIC else judged
        else:
            limit = 1.0 if measure == "region" else 0.2
            diffs = [n[key] - o[key] for o, n in zip(runs["old"], runs["new"], strict=True)]
            low, high = min(diffs), max(diffs)
            between = f"{low:+.3f} to {high:+.3f}"
            judged = verdict(low, high, limit, f"slower by > {limit} us")
        print(
            f"{measure:16s} {side:8s} {old:8.3f} {new:8.3f} {new - old:+8.3f}  "
            f"{spread:10.3f}  {between:>15s}  {judged}"
        )


if __name__ == "__main__":
    main()
