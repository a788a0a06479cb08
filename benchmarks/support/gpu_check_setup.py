"""The GPU check's setup: install the test and benchmark packages this interpreter lacks.

The GPU machine comes with torch (2.11 there) and most of the test packages, and may
have no network. Only what cannot be imported is installed, with ``--no-deps`` (so
torch is never replaced), into ``--site`` (which ``gpu_check.py`` puts on the parts'
``PYTHONPATH``), pinned as ``constraints.txt`` pins it: from ``.whl/`` when that folder
exists (wheels carried to an offline machine), else from PyPI. amped itself is not
installed: it is pure Python and runs from ``src/``. Exits 1 if a package is still
missing afterwards.

Usage: python benchmarks/support/gpu_check_setup.py --site DIR [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import name -> distribution name: what the GPU tests and the benchmarks import.
# expecttest: torch.testing._internal (the op lists) imports it; without it the
# conformance test skips instead of running.
NEEDED = {
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis",
    "expecttest": "expecttest",
    "numpy": "numpy",
    "transformers": "transformers",
    "torchao": "torchao",
}


def pins(root: Path) -> dict[str, str]:
    """``constraints.txt``'s ``name==version`` lines, by lower-case name."""
    found = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            found[name.lower()] = f"{name}=={version}"
    return found


def missing() -> list[str]:
    importlib.invalidate_caches()
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def install(names: list[str], site: Path, root: Path) -> dict:
    """pip-install the distributions of ``names`` into ``site``; what ran and its outcome."""
    pinned = pins(root)
    requirements = [pinned.get(NEEDED[n].lower(), NEEDED[n]) for n in names]
    wheels = root / ".whl"
    source = ["--no-index", "--find-links", str(wheels)] if wheels.is_dir() else []
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site)]
    command += ["--retries", "0", "--timeout", "15", *source, *requirements]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    return {
        "requirements": requirements,
        "source": str(wheels) if source else "PyPI",
        "pip_returncode": done.returncode,
        "pip_tail": (done.stdout + done.stderr).strip().splitlines()[-10:],
    }


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in ("torch", *NEEDED.values()):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", required=True)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    site = Path(args.site)
    sys.path.insert(0, str(site))  # what an earlier run installed counts as there
    result: dict = {"missing_before": missing(), "site": str(site)}
    if result["missing_before"]:
        result["install"] = install(result["missing_before"], site, ROOT)
    result["still_missing"] = missing()
    result["versions"] = versions()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 1 if result["still_missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
