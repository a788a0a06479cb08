"""The schema of ``results.json`` (``"schema": "amped.compare/1"``), and a checker for it.

:data:`SCHEMA` is a JSON Schema (draft 2020-12) document; ``docs/results-schema.md``
explains every field. :func:`validate` checks the subset of JSON Schema used here
(``type``, ``required``, ``properties``, ``additionalProperties``, ``items``, ``enum``,
``minimum``, ``const``) without a dependency, and returns the problems it found.
The version in ``schema`` changes when a field is removed or changes meaning; new
optional fields do not change it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMA", "STATUSES", "validate"]

STATUSES = ["complete", "stopped", "interrupted", "failed", "not_run", "running"]

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer", "minimum": 0}
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
_STR = {"type": "string"}
_STR_OR_NULL = {"type": ["string", "null"]}
_PAIR_OR_NULL = {"type": ["array", "null"], "items": _NUM}


def _object(
    properties: dict[str, Any],
    nullable: bool = False,
    optional: tuple[str, ...] = (),
    **extra: Any,
) -> dict[str, Any]:
    return {
        "type": ["object", "null"] if nullable else "object",
        "required": sorted(set(properties) - set(optional)),
        "properties": properties,
        **extra,
    }


_MEMORY = _object(
    {
        "param_count": _INT,
        "params_bytes": _INT,
        "grads_bytes": _INT,
        "optimizer_state_bytes": _INT,
        "masters_bytes": _INT,
        "state_bytes": _INT,
        "bytes_per_param": _NUM,
        "source": _STR,
        "peak_bytes": {"type": ["integer", "null"]},
        "peak_kind": {
            "type": ["string", "null"],
            "enum": [
                "cuda_allocator_peak",
                "own_process_peak_rss",
                "rss_growth",
                "process_peak_rss",
                None,
            ],
        },
    },
    nullable=True,
    additionalProperties=False,
)

_RECIPE = _object(
    {
        "name": _STR,
        "summary": _STR,
        "dtype": _STR_OR_NULL,
        "weights": _STR,
        "loss_scaling": {"type": "boolean"},
        "status": {"type": "string", "enum": STATUSES},
        "stop_reason": _STR_OR_NULL,
        "error": _STR_OR_NULL,
        "steps_requested": _INT,
        "steps_planned": _INT,
        "steps_done": _INT,
        "wall_s": _NUM,
        "step_time_s": _NUM_OR_NULL,
        "samples_per_s": _NUM_OR_NULL,
        "throughput_vs_baseline": _NUM_OR_NULL,
        "timing": _object(
            {
                "repeats": _INT,
                "median_s": _NUM,
                "q1_s": _NUM,
                "q3_s": _NUM,
                "min_s": _NUM,
                "max_s": _NUM,
            },
            nullable=True,
            additionalProperties=False,
        ),
        "samples_per_s_iqr": _PAIR_OR_NULL,
        "throughput_vs_baseline_range": _PAIR_OR_NULL,
        "slow_on_this_hardware": {"type": "boolean"},
        "memory": _MEMORY,
        "losses": {"type": "array", "items": _NUM_OR_NULL},
        "final_train_loss": _NUM_OR_NULL,
        "train_loss_at_common_step": _NUM_OR_NULL,
        "eval": _object({}, nullable=True, additionalProperties=_NUM_OR_NULL),
        "loss_scales": {"type": ["array", "null"], "items": _NUM},
        "skipped_steps": _INT,
        "final_loss_scale": _NUM_OR_NULL,
        "diverged": {"type": "boolean"},
        "diverged_at_step": {"type": ["integer", "null"], "minimum": 1},
        "notes": {"type": "array", "items": _STR},
    },
    optional=("timing", "samples_per_s_iqr", "throughput_vs_baseline_range"),
    additionalProperties=False,
)

_MACHINE = _object(
    {
        "cores": _INT,
        "threads": _INT,
        "other_processes_cores": _NUM_OR_NULL,
        "load_average_1min": _NUM_OR_NULL,
        "busy": {"type": "boolean"},
    },
    nullable=True,
    additionalProperties=False,
)
# Added without a new schema version: files written before them stay valid.
_RECIPE["required"] = [k for k in _RECIPE["required"] if k not in ("diverged", "diverged_at_step")]

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "amped compare results",
    **_object(
        {
            "schema": {"const": "amped.compare/1"},
            "partial": {"type": "boolean"},
            "created": _STR,
            "command": {"type": "array", "items": _STR},
            "wall_s": _NUM,
            "config": _object(
                {
                    "task": _STR,
                    "recipes": {"type": "array", "items": _STR},
                    "steps": _INT,
                    "batch_size": _INT_OR_NULL,
                    "device": _STR,
                    "seed": {"type": "integer"},
                    "max_time_s": _NUM_OR_NULL,
                    "threads": _INT_OR_NULL,
                    "threads_source": _STR_OR_NULL,
                    "peak_memory": {"type": "string", "enum": ["own-process", "in-process"]},
                },
                optional=("threads", "threads_source", "peak_memory"),
                additionalProperties=False,
            ),
            "environment": _object(
                {"python": _STR, "torch": _STR, "amped": _STR, "device": _STR, "cpu": _STR},
            ),
            "task": _object(
                {"name": _STR, "description": _STR, "factory": _STR, "parameters": _INT},
                nullable=True,
            ),
            "plan": _object(
                {
                    "steps": _INT,
                    "shortened": {"type": "boolean"},
                    "max_time_s": _NUM,
                    "timing_s": _NUM,
                    "step_s": {"type": "object", "additionalProperties": _NUM},
                    "note": _STR,
                },
                nullable=True,
                additionalProperties=False,
            ),
            "baseline": _STR_OR_NULL,
            "common_step": _INT_OR_NULL,
            "machine": _MACHINE,
            "identical_losses": {"type": "array", "items": {"type": "array", "items": _STR}},
            "recipes": {"type": "array", "items": _RECIPE},
        },
        optional=("machine", "identical_losses"),
        additionalProperties=False,
    ),
}

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
    "null": (type(None),),
}


def _is(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False  # JSON booleans are not numbers, though Python's bool is an int
    return isinstance(value, _TYPES[name])


def validate(data: Any, schema: dict[str, Any] = SCHEMA, where: str = "$") -> list[str]:
    """The ways ``data`` breaks ``schema`` (empty if it conforms), each naming its path."""
    if "const" in schema and data != schema["const"]:
        return [f"{where}: expected {schema['const']!r}, got {data!r}"]
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(data, n) for n in names):
            return [f"{where}: expected {' or '.join(names)}, got {type(data).__name__}"]
    if "enum" in schema and data not in schema["enum"]:
        return [f"{where}: {data!r} is not one of {schema['enum']}"]
    if "minimum" in schema and _is(data, "number") and data < schema["minimum"]:
        return [f"{where}: {data} is below the minimum {schema['minimum']}"]
    if isinstance(data, dict):
        return _validate_object(data, schema, where)
    if isinstance(data, list) and "items" in schema:
        return [
            e for i, v in enumerate(data) for e in validate(v, schema["items"], f"{where}[{i}]")
        ]
    return []


def _validate_object(data: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    errors = [f"{where}: missing {key!r}" for key in schema.get("required", []) if key not in data]
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, value in data.items():
        if key in properties:
            errors += validate(value, properties[key], f"{where}.{key}")
        elif extra is False:
            errors.append(f"{where}: unexpected key {key!r}")
        elif isinstance(extra, dict):
            errors += validate(value, extra, f"{where}.{key}")
    return errors
