"""One GPU check: CUDA op-list conformance, every ``-m gpu`` test and the benchmarks on CUDA.

Runs these parts in order, each in its own subprocess under its own time budget, and
writes one JSON file (rewritten after every part, so a killed run leaves what it had):

- ``setup``: finds the test and benchmark packages the interpreter lacks and installs
  them into ``<work>/site`` from ``.whl/`` (wheels carried to an offline machine) or PyPI,
  pinned by ``constraints.txt`` (torch left as installed). amped itself runs from
  ``src/`` (pure Python, no install).
- ``op_lists``: ``tests/autocast_mode/test_autocast_op_lists.py::test_cuda_lists_match_torch``.
- ``gpu_tests``: every other ``-m gpu`` test, in the test files that mark any.
- ``recipes``, ``fp8``, ``autocast_overhead``, ``scaler_overhead``: ``benchmarks/*.py``
  with ``--device cuda`` (fp8: ``fp8.py step --gpu-only``, its GPU part) and ``--json``.

A part that fails or runs out of time is recorded (status, exit code, output tail) and
the next part runs; the run stops starting parts once ``--total`` seconds are spent.
The ``targets`` section evaluates the speed targets (support/gpu_targets.py). Exit status: 0
when every part passed (skips allowed in a dry run), 1 otherwise; missed targets are in
the JSON, not the exit status.

``--dry-run`` (or ``AMPED_GPU_CHECK_DRY_RUN=1``) runs the same parts on the CPU with the
benchmarks' smallest settings and no setup, writing the same JSON shape; its budgets
are four times the GPU's (a CPU may be busy, and has no 8-minute goal), and it runs two
parts at a time (``--jobs``; on CUDA one, so that no benchmark shares the machine).

Usage: bash benchmarks/gpu_check.sh [--out gpu_check.json] [--work .gpu-check] [--dry-run]
           [--parts op_lists,recipes,...] [--budget PART=SECONDS ...] [--total 450]
           [--jobs 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The helpers are beside this script (benchmarks/support/), and amped runs from this checkout's
# src/: importable also when this file is imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_parts import (
    DRY_SLACK,
    PARTS,
    TOTAL_S,
    Part,
    environment,
    parts_for,
    read_junit,
    run_command,
)
from gpu_targets import evaluate

from amped._internal.files import write_files
from amped._internal.jsonio import from_json, to_json

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file to write")
    parser.add_argument("--work", default=str(ROOT / ".gpu-check"), help="logs, site, temp")
    parser.add_argument("--dry-run", action="store_true", help="CPU, smallest settings")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset")
    parser.add_argument(
        "--budget", action="append", default=[], metavar="PART=SECONDS", help="override"
    )
    parser.add_argument(
        "--total", type=float, default=None, help=f"seconds for all parts ({TOTAL_S} on CUDA)"
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="parts at a time (1 on CUDA, 2 in the dry run)"
    )
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or os.environ.get("AMPED_GPU_CHECK_DRY_RUN") == "1"
    if args.total is None:
        args.total = TOTAL_S * (DRY_SLACK if args.dry_run else 1)
    # On CUDA one part at a time: a benchmark times the GPU and the host it shares.
    # The dry run's figures mean nothing, so it may use a second core.
    if args.jobs is None:
        args.jobs = 2 if args.dry_run else 1
    if args.jobs < 1:
        parser.error(f"--jobs takes 1 or more; received {args.jobs}")
    chosen = args.parts.split(",")
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    args.parts = chosen
    args.budgets = {}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--budget takes PART=SECONDS with a part of {list(PARTS)}: {item!r}")
        args.budgets[name] = float(seconds)
    return args


def child_env(site: Path | None) -> dict[str, str]:
    """The parts' environment: this checkout's ``src`` (and the setup's site) first."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT / "src")] + ([str(site)] if site is not None and site.is_dir() else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_part(part: Part, timeout: float, work: Path, env: dict[str, str]) -> dict:
    """Run one part; its section of the JSON. Never raises for the part's own failure."""
    log = work / f"{part.name}.log"
    result_file = work / f"{part.name}.{'xml' if part.kind == 'pytest' else 'json'}"
    result_file.unlink(missing_ok=True)
    extra = [f"--junitxml={result_file}"] if part.kind == "pytest" else ["--json", str(result_file)]
    command = [sys.executable, *part.args, *extra]
    section: dict = {"kind": part.kind, "command": command[1:], "budget_s": round(timeout, 1)}
    section.update(run_command(command, timeout, env, log, cwd=ROOT))
    if part.kind == "pytest":
        section["tests"] = read_junit(result_file)
        section["status"] = pytest_status(section)
    else:
        section["figures"] = from_json(result_file.read_text()) if result_file.exists() else None
        if section["status"] == "passed" and section["figures"] is None:
            section["status"], section["reason"] = "failed", "the script wrote no figures"
    return section


def pytest_status(section: dict) -> str:
    """passed: some ran, none failed; skipped: none ran (nor failed); else the run's."""
    tests = section["tests"]
    if section["status"] == "timeout":
        return "timeout"
    if tests is None or tests["failed"] or tests["errors"]:
        return "failed"
    if section["returncode"] not in (0, 5):  # 5: pytest selected no test
        return "failed"
    if tests["passed"]:
        return "passed"
    if not tests["skipped"]:  # the CUDA cases of a parametrized test exist only with CUDA
        section["reason"] = "pytest selected no test on this machine"
    return "skipped"


def not_run(part: Part, args: argparse.Namespace, cuda: bool, budget: float) -> dict | None:
    """The section of a part that will not run, and why; None for a part to run."""
    if part.name not in args.parts:
        return {"status": "not run", "reason": "not chosen by --parts"}
    if part.skip_reason is not None:
        return {"status": "skipped", "reason": part.skip_reason}
    if not args.dry_run and not cuda:
        return {"status": "not run", "reason": "no CUDA device; try --dry-run"}
    if budget < 1:
        return {"status": "not run", "reason": f"--total {args.total}s spent"}
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()  # the environment's probe counts towards --total too
    report: dict = {"dry_run": args.dry_run, "environment": environment(ROOT, args.dry_run)}
    cuda = report["environment"]["cuda_available"]
    site = work / "site"
    lock = threading.Lock()

    def attempt(part: Part) -> None:
        left = args.total - (time.monotonic() - began)
        budget = min(args.budgets.get(part.name, part.budget_s), left)
        section = not_run(part, args, cuda, budget)
        if section is None:
            print(f"[gpu_check] {part.name}: running (budget {budget:.0f} s)", flush=True)
            section = run_part(part, budget, work, child_env(site))
        print(f"[gpu_check] {part.name}: {section['status']}", flush=True)
        with lock:
            report[part.name] = section
            report["targets"] = evaluate(report)
            report["seconds"] = round(time.monotonic() - began, 1)
            write(Path(args.out), report)

    setup, *rest = parts_for(args.dry_run, site, ROOT)
    attempt(setup)  # first and alone: the other parts use what it installs
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for done in [pool.submit(attempt, part) for part in rest]:
            done.result()
    allowed = {"passed", "skipped"} if args.dry_run else {"passed"}
    report["ok"] = all(report[name]["status"] in allowed for name in args.parts)
    write(Path(args.out), report)
    print(f"[gpu_check] wrote {args.out} in {report['seconds']} s; ok={report['ok']}")
    return 0 if report["ok"] else 1


def write(path: Path, report: dict) -> None:
    """The report, its sections in the order the parts run whatever order they ended in."""
    order = ("dry_run", "environment", *PARTS, "targets", "seconds", "ok")
    ordered = {key: report[key] for key in order if key in report}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_files([(path, to_json(ordered, indent=2) + "\n")])


if __name__ == "__main__":
    sys.exit(main())
