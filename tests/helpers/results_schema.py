"""The ``results.json`` schema (``docs/results-schema.json``), checked with jsonschema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "docs" / "results-schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def schema_errors(document: Any) -> list[jsonschema.ValidationError]:
    """Every way ``document`` breaks the schema (empty when it conforms)."""
    return list(VALIDATOR.iter_errors(document))


def validate(document: Any) -> list[str]:
    """:func:`schema_errors` as ``"<json path>: <message>"`` lines, for readable asserts."""
    return [f"{error.json_path}: {error.message}" for error in schema_errors(document)]
