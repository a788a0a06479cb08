"""The repository's folders, for tests that run a file or read one: the tests live in
``tests/<package>/``, the helpers and workers beside this module in ``tests/helpers/``
(on ``sys.path`` through tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
ROOT = TESTS.parent
