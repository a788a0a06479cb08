"""The results.json schema (docs/results-schema.json): it is valid JSON Schema, it
catches each kind of mistake at its path, and the docs describe every field it declares."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
from repo_paths import ROOT
from results_schema import SCHEMA, schema_errors

DOC = ROOT / "docs" / "results-schema.md"

RECIPE = {
    "name": "fp32",
    "summary": "float32 throughout",
    "dtype": None,
    "weights": "fp32",
    "loss_scaling": False,
    "status": "complete",
    "stop_reason": None,
    "error": None,
    "steps_requested": 2,
    "steps_planned": 2,
    "steps_done": 2,
    "wall_s": 0.5,
    "step_time_s": 0.1,
    "samples_per_s": 160.0,
    "throughput_vs_baseline": 1.0,
    "slow_on_this_hardware": False,
    "memory": {
        "param_count": 10,
        "params_bytes": 40,
        "grads_bytes": 40,
        "optimizer_state_bytes": 80,
        "masters_bytes": 0,
        "state_bytes": 160,
        "bytes_per_param": 16.0,
        "source": "amped.cli",
        "peak_bytes": 1024,
        "peak_kind": "rss_growth",
    },
    "losses": [1.0, None],
    "final_train_loss": 1.0,
    "train_loss_at_common_step": 1.0,
    "eval": {"loss": 0.9},
    "loss_scales": None,
    "skipped_steps": 0,
    "final_loss_scale": None,
    "notes": [],
}
DOCUMENT = {
    "schema": "amped.compare/1",
    "partial": False,
    "created": "2026-01-01T00:00:00+00:00",
    "command": ["amped", "compare"],
    "wall_s": 1.0,
    "config": {
        "task": "m:f",
        "recipes": ["fp32"],
        "steps": 2,
        "batch_size": None,
        "device": "cpu",
        "seed": 0,
        "max_time_s": None,
    },
    "environment": {"python": "3", "torch": "2", "amped": "0", "device": "cpu", "cpu": "x"},
    "task": {"name": "t", "description": "", "factory": "m:f", "parameters": 10},
    "plan": None,
    "baseline": "fp32",
    "common_step": 2,
    "recipes": [RECIPE],
}


def _broken(path: str, value: object) -> dict:
    document = copy.deepcopy(DOCUMENT)
    *parents, last = path.split(".")
    target = document
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return document


def test_the_schema_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_a_conforming_document_passes():
    assert schema_errors(DOCUMENT) == []


@pytest.mark.parametrize(
    ("path", "value", "where", "rule"),
    [
        ("partial", KeyError, "$", "required"),
        ("partial", "no", "$.partial", "type"),
        ("schema", "amped.compare/2", "$.schema", "const"),
        ("recipes.0.steps_done", True, "$.recipes[0].steps_done", "type"),
        ("recipes.0.steps_done", -1, "$.recipes[0].steps_done", "minimum"),
        ("recipes.0.status", "done", "$.recipes[0].status", "enum"),
        ("recipes.0.losses", [1.0, "nan"], "$.recipes[0].losses[1]", "type"),
        ("recipes.0.memory.peak_kind", "vms", "$.recipes[0].memory.peak_kind", "enum"),
        ("recipes.0.eval", {"loss": "low"}, "$.recipes[0].eval.loss", "type"),
        ("recipes.0.extra", 1, "$.recipes[0]", "additionalProperties"),
        ("config.steps", 2.5, "$.config.steps", "type"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_each_kind_of_mistake_is_named_with_its_path(path, value, where, rule):
    errors = schema_errors(_broken(path, value))
    assert [(e.json_path, e.validator) for e in errors] == [(where, rule)], errors


def _fields(schema: dict, found: set[str]) -> set[str]:
    for key, sub in schema.get("properties", {}).items():
        found.add(key)
        _fields(sub, found)
    if isinstance(schema.get("items"), dict):
        _fields(schema["items"], found)
    return found


def test_the_docs_describe_every_field():
    documented = set(re.findall(r"`([a-z_0-9]+)`", DOC.read_text()))
    missing = _fields(SCHEMA, set()) - documented
    assert not missing, f"fields missing from {DOC.name}: {sorted(missing)}"
