"""Every ```python block of README.md and docs/**/*.md runs, so no snippet can drift.

The convention, for everyone who writes docs:

- A fenced block whose info string starts with ``python`` is executed; ``text``,
  ``bash``, ``json`` and every other kind are not. Use ```text for output and
  ```bash for shell commands.
- The blocks of one file run in order, in one namespace, in a fresh Python process
  whose working directory is an empty temporary folder (so a block may use what an
  earlier block of the same file defined, and anything it writes is thrown away).
  They run on the CPU, with one torch thread, and must download nothing.
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

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK_LIMIT_S = 30.0
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

_RUNNER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__doc__"}
for line, code in blocks:
    began = time.monotonic()
    try:
        exec(compile(code, f"block at line {line}", "exec"), namespace)
    except BaseException as error:
        print(json.dumps({"line": line, "error": f"{type(error).__name__}: {error}"}))
        raise
    print(json.dumps({"line": line, "seconds": time.monotonic() - began}), flush=True)
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


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(path, tmp_path):
    run, skipped = _python(path)
    for line, reason, code in skipped:
        assert re.match(r"no-run: \S", reason), f"{path.name}:{line}: no-run needs a reason"
        compile(code, f"{path.name}:{line}", "exec")
    if not run:
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _path(), "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(run),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=BLOCK_LIMIT_S * len(run) + 30,
    )
    reports = [json.loads(x) for x in result.stdout.splitlines() if x.startswith('{"line"')]
    failed = [r for r in reports if "error" in r]
    assert result.returncode == 0 and not failed, (
        f"{path.name}: {failed or ''}\n{result.stderr[-3000:]}"
    )
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
