"""Every ```python block of README.md and docs/**/*.md runs, so no snippet can drift.

The convention, for everyone who writes docs:

- A fenced block whose info string starts with ``python`` is executed; ``text``,
  ``bash``, ``json`` and every other kind are not. Use ```text for output and
  ```bash for shell commands.
- The blocks of one file run in order, in one namespace, in a fresh Python process
  whose working directory is an empty temporary folder (so a block may use what an
  earlier block of the same file defined, and anything it writes is thrown away).
  They run on the CPU, with one torch thread, and must download nothing. (The process
  is a fork of one that has imported torch and amped and run nothing: importing them
  once, not once per file, is most of what running every file costs.)
- Each block must finish in :data:`BLOCK_LIMIT_S` seconds (a few seconds on an idle
  machine; the limit leaves room for a busy one).
- A block that cannot run here (it needs several processes, a GPU, a user's data)
  says so in its info string: ```python no-run: <why>. GitHub still highlights it.
  Use this sparingly: the reason is required, and such a block is still compiled, so
  a syntax error fails the test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

pytestmark = pytest.mark.xdist_group("docs")  # one worker runs every doc's blocks

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK_LIMIT_S = 30.0
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

# One process imports torch and amped, then forks a child per file (``jobs``: the
# file's blocks, an empty working folder, files for its output): the child runs the
# blocks, printing a JSON line after each, and is killed by SIGALRM past its limit.
_RUNNER = r"""
import json, os, signal, sys, time, traceback
import torch
torch.set_num_threads(1)
import amped
for job in json.loads(sys.stdin.read()):
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.chdir(job["cwd"])
        signal.alarm(job["limit_s"])
        namespace = {"__name__": "__doc__"}
        code = 0
        for line, block in job["blocks"]:
            began = time.monotonic()
            try:
                exec(compile(block, f"block at line {line}", "exec"), namespace)
            except BaseException as error:
                print(json.dumps({"line": line, "error": f"{type(error).__name__}: {error}"}))
                traceback.print_exc()
                code = 1
                break
            print(json.dumps({"line": line, "seconds": time.monotonic() - began}), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps({"id": job["id"], "returncode": code}), flush=True)
"""


def blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, info string, code) of every fenced block of ``path``."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group(1).strip(), match.group(2)))
    return found


def _python(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    run, skipped = [], []
    for line, info, code in blocks(path):
        words = info.split(maxsplit=1)
        if not words or words[0] != "python":
            continue
        if len(words) > 1 and words[1].startswith("no-run"):
            skipped.append((line, words[1], code))
        else:
            run.append((line, code))
    return run, skipped


def test_the_fence_parser_finds_blocks_and_their_kind(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n```python\nx = 1\n```\ntext\n```bash\nls\n```\n"
        "```python no-run: needs two processes\ny = 2\n```\n"
    )
    assert _python(page) == ([(2, "x = 1\n")], [(9, "no-run: needs two processes", "y = 2\n")])


def test_every_doc_is_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert "README.md" in names and "docs/results-schema.md" in names


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Every doc's runnable blocks, run once: {doc id: (exit code, stdout, stderr)}."""
    root = tmp_path_factory.mktemp("docs")
    jobs = []
    for index, path in enumerate(DOCS):
        run, _ = _python(path)
        if run:
            cwd = root / str(index)
            cwd.mkdir()
            job = {"id": _id(path), "blocks": run, "cwd": str(cwd)}
            job["limit_s"] = int(BLOCK_LIMIT_S * len(run) + 30)
            job["stdout"], job["stderr"] = str(cwd) + ".out", str(cwd) + ".err"
            jobs.append(job)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _path(), "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=sum(job["limit_s"] for job in jobs) + 30,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    codes = {r["id"]: r["returncode"] for r in map(json.loads, result.stdout.splitlines())}
    output = {
        job["id"]: [Path(job[name]).read_text() for name in ("stdout", "stderr")] for job in jobs
    }
    return {id_: (codes[id_], *output[id_]) for id_ in output}


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_python_blocks_run(path, doc_runs):
    run, skipped = _python(path)
    for line, reason, code in skipped:
        assert re.match(r"no-run: \S", reason), f"{path.name}:{line}: no-run needs a reason"
        compile(code, f"{path.name}:{line}", "exec")
    if not run:
        return
    returncode, stdout, stderr = doc_runs[_id(path)]
    reports = [json.loads(x) for x in stdout.splitlines() if x.startswith('{"line"')]
    failed = [r for r in reports if "error" in r]
    assert returncode == 0 and not failed, f"{path.name}: {failed or ''}\n{stderr[-3000:]}"
    slow = [r for r in reports if r["seconds"] > BLOCK_LIMIT_S]
    assert not slow, f"{path.name}: blocks over {BLOCK_LIMIT_S} s: {slow}"
    assert len(reports) == len(run)


def _path() -> str:
    """The interpreter's own path, so the blocks import the amped under test."""
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def test_the_doctor_sample_output_is_what_the_example_prints(monkeypatch):
    """docs/doctor.md shows the RMSNorm report as examples/doctor_reports.py prints it."""
    import importlib.util

    import torch

    from amped.doctor import diagnose

    monkeypatch.chdir(ROOT)  # the source line is reported relative to where it runs
    spec = importlib.util.spec_from_file_location("doctor_reports", "examples/doctor_reports.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, x = example.norm_variance_overflow()
    summary = diagnose(model, x, example._mean, dtype=torch.float16).summary()
    shown = [code for _, info, code in blocks(ROOT / "docs" / "doctor.md") if info == "text"]
    assert summary + "\n" in shown
