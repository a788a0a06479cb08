"""Shared pieces of the CLI fault tests: the report folder's old and new pair, and
how a subprocess runs the CLI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from results_schema import validate

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = Path(__file__).resolve().parent / "cli_factories.py"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
}
TINY = ("--model", f"{FACTORIES}:good", "--batch-size", "8", "--threads", "1")
TINY += ("--max-time", "0", "--no-progress")
OLD = "OLD-RUN-MARKER"
PAIRS = {"compare": ("results.json", "report.html"), "doctor": ("doctor.json", "doctor.html")}


def old_pair(out: Path, command: str = "compare") -> None:
    """A previous run's files, recognisable by their marker."""
    out.mkdir(parents=True, exist_ok=True)
    data, page = PAIRS[command]
    (out / data).write_text(json.dumps({"created": OLD}))
    (out / page).write_text(f"<html>{OLD}</html>\n")


def pair_state(out: Path, command: str = "compare") -> str:
    """'old' or 'new' when the folder holds one whole, consistent pair; fails otherwise."""
    data, page = PAIRS[command]
    # The run's lock file (amped.cli.out_dir) stays beside the pair, unlocked.
    names = sorted(n for n in os.listdir(out) if n != ".amped.lock")
    assert names == sorted(PAIRS[command]), f"not a pair (torn or half-written): {names}"
    document = json.loads((out / data).read_text())  # whole JSON, or this raises
    html = (out / page).read_text()
    assert html.rstrip().endswith("</html>"), "a torn page"
    if document.get("created") == OLD:
        assert OLD in html, "a new page beside an old results file"
        return "old"
    assert OLD not in html, "an old page beside a new results file"
    if command == "compare":
        assert validate(document) == []
        assert document["created"] in html
    return "new"


def unwrap(err: str) -> list[str]:
    """The messages of ``err``: lines wrapped at 80 columns (continuation lines
    indented) joined back with single spaces."""
    lines: list[str] = []
    for line in err.splitlines():
        if line.startswith("  ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def one_line(err: str) -> str:
    """stderr is a single message (nothing ran before the error)."""
    lines = [line for line in unwrap(err) if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


def error_line(err: str) -> str:
    """The one ``amped: error:`` line among the progress lines; no traceback."""
    lines = [line for line in unwrap(err) if line.startswith("amped: ")]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("amped: error: "), err
    return lines[0]


def compare_command(*args: str) -> list[str]:
    """``python -m amped compare`` on the tiny task, with ``args``."""
    return [sys.executable, "-m", "amped", "compare", *TINY, *args]
