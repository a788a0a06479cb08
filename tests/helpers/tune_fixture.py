"""Hand-written tuned.json documents for the report and table tests, shaped as
docs/tune.md's schema (``amped.tune/1``) says: a tiny GPT's layers in model order, two
candidate formats, one layer kept in bf16 for its estimate, and a verification that
passed. :func:`failed`, :func:`incomplete` and :func:`no_plan` derive the other outcomes;
:func:`rule_won` a plan that came from a first/last-N rule, :func:`no_rule_tried` one no
rule could beat.

They stand for what ``amped.tune`` returns only in the renderer's tests; the command's
own tests run the real tuner.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

LAYERS = ("blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj",
          "head")  # fmt: skip
_FLOPS = (6 * 64 * 192 * 512, 6 * 64 * 64 * 512, 6 * 64 * 256 * 512, 6 * 256 * 64 * 512,
          6 * 64 * 256 * 512)  # fmt: skip
# Per layer: (output SQNR dB, estimated loss change) for fp8-rowwise, then nvfp4.
_SENSITIVITY = (
    ((31.2, 2.1e-4), (17.9, 3.3e-3)),
    ((30.8, 1.2e-4), (18.2, 1.9e-3)),
    ((31.0, 3.0e-4), (17.5, 4.8e-3)),
    ((12.4, 4.0e-2), (6.1, 9.5e-2)),  # the outlier layer: kept in bf16
    ((math.inf, 6.0e-4), (16.8, 2.2e-2)),  # an exact output: SQNR inf
)
PLAN = dict(zip(LAYERS, ("nvfp4", "nvfp4", "fp8-rowwise", "bf16", "fp8-rowwise"), strict=True))
RULE = {LAYERS[0]: "bf16", **dict.fromkeys(LAYERS[1:4], "fp8-rowwise"), "head": "bf16"}
BASE_LOSSES = [2.412, 2.405, 2.421]
BUDGET = 0.008
LARGER = {**PLAN, LAYERS[3]: "nvfp4", "head": "nvfp4"}  # a round that failed


def _round(index: int, layers: dict[str, str], estimate: float, gap: float) -> dict[str, Any]:
    return {"source": "estimate", "index": index, "layers": dict(layers),
            "estimate": estimate, "gap": gap, "passed": gap <= BUDGET,
            "completed": True}  # fmt: skip


def _arm(layers: dict[str, str], losses: list[float], complete: bool = True) -> dict[str, Any]:
    mean = statistics.fmean(losses) if losses else math.nan
    gap = mean - statistics.fmean(BASE_LOSSES) if losses else math.nan
    return {
        "layers": layers,
        "final_losses": losses,
        "mean": mean,
        "spread": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "gap": gap,
        "completed": complete,
        "passed": complete and gap <= BUDGET,
    }


def _flops(layers: dict[str, str]) -> int:
    return sum(f for n, f in zip(LAYERS, _FLOPS, strict=True) if layers[n] != "bf16")


def passed() -> dict[str, Any]:
    """A plan that met its budget and passed its verification."""
    measurements = {}
    for name, flops, per_format in zip(LAYERS, _FLOPS, _SENSITIVITY, strict=True):
        formats = {}
        for fmt, (sqnr, estimate) in zip(("fp8-rowwise", "nvfp4"), per_format, strict=True):
            formats[fmt] = {
                "sqnr_output": sqnr,
                "sqnr_grad_input": sqnr - 1.5,
                "sqnr_grad_weight": sqnr - 2.0,
                "loss_change_estimate": estimate,
                "underflow": 0.002 if fmt == "fp8-rowwise" else 0.04,
                "saturation": 0.01 if name == "blocks.0.mlp.proj" else 0.0,
            }
        measurements[name] = {"flops": flops, "formats": formats}
    arms = {
        "bf16-mixed": _arm(dict.fromkeys(LAYERS, "bf16"), BASE_LOSSES),
        "plan": _arm(PLAN, [2.418, 2.409, 2.425]),
        "estimate": _arm(PLAN, [2.418, 2.409, 2.425]),
        "rule": _arm(RULE, [2.431, 2.426, 2.440]),
    }
    return {
        "schema": "amped.tune/1",
        "base": "bf16-mixed",
        "layers": dict(PLAN),
        "passed": True,
        "source": "estimate",
        "reason": None,
        "settings": {
            "formats": ["fp8-rowwise", "nvfp4"],
            "target": "blackwell",
            "speedups": {"bf16": 1.0, "fp8-rowwise": 2.0, "nvfp4": 4.0},
            "steps": 60,
            "seeds": 3,
            "seed": 0,
            "seed_list": [0, 1, 2],
            "max_time": None,
        },
        "budget": {
            "value": BUDGET,
            "source": "bf16-mixed seed spread (sample std of final loss over 3 seeds)",
            "plan_estimate": 0.0072,
            "rule_estimate": 0.0406,
        },
        "choice": {
            "saving_flops": 1.1e8,
            "lowered_flops": _flops(PLAN),
            "total_flops": sum(_FLOPS),
        },
        "rule": {
            "first": 1,
            "last": 1,
            "format": "fp8-rowwise",
            "layers": dict(RULE),
            "saving_flops": 5.6e7,
            "lowered_flops": _flops(RULE),
        },
        "measurements": measurements,
        "verification": {"seeds": [0, 1, 2], "steps": 60, "arms": arms, "passed": True},
        "passes": {"capture": 1, "reference": 1.0, "formats": {"fp8-rowwise": 1.0, "nvfp4": 1.0}},
        # The first plan (within the budget by the estimate) passed, the larger one after
        # it failed, so the search kept the first.
        "rounds": [_round(5, PLAN, 0.0072, 0.0047), _round(8, LARGER, 0.0291, 0.0213)],
    }


def failed() -> dict[str, Any]:
    """The same plan, whose verified gap exceeds the budget."""
    document = passed()
    document["verification"]["arms"]["plan"] = _arm(PLAN, [2.461, 2.458, 2.470])
    document["passed"] = document["verification"]["passed"] = False
    document["rounds"] = [_round(5, PLAN, 0.0072, 0.0497)]  # rounds=1: nothing else tried
    return document


def incomplete() -> dict[str, Any]:
    """--max-time ran out after the plan's first seed: the plan does not pass."""
    document = passed()
    document["verification"]["arms"]["plan"] = _arm(PLAN, [2.418], complete=False)
    document["verification"]["arms"]["rule"] = _arm(RULE, [], complete=False)
    document["passed"] = document["verification"]["passed"] = False
    document["rounds"] = [_round(5, PLAN, 0.0072, 0.006) | {"passed": False, "completed": False}]
    return document


def rule_won() -> dict[str, Any]:
    """The estimate's plan failed (+0.0503); the rule "first 1/last 1" passed (+0.0027)
    and is the plan."""
    document = failed()
    rule_arm = _arm(RULE, [2.414, 2.408, 2.424])
    arms = document["verification"]["arms"]
    arms["estimate"] = arms["plan"]
    arms["plan"] = arms["rule"] = rule_arm
    source = "rule: first 1/last 1, fp8-rowwise"
    document |= {"layers": dict(RULE), "passed": True, "source": source}
    document["budget"]["plan_estimate"] = document["budget"]["rule_estimate"]
    document["verification"]["passed"] = True
    rule_round = _round(0, RULE, 0.0406, rule_arm["gap"]) | {"source": source, "index": None}
    document["rounds"].append(rule_round)
    return document


def no_rule_tried() -> dict[str, Any]:
    """Every layer lowered passed: no rule could save more, so none was trained."""
    document = passed()
    del document["verification"]["arms"]["rule"]
    document["rule"] = None
    document["budget"]["rule_estimate"] = None
    return document


def no_plan() -> dict[str, Any]:
    """A budget no lowered plan meets: the all-bf16 plan, with the reason."""
    document = passed()
    bf16 = dict.fromkeys(LAYERS, "bf16")
    document["layers"] = bf16
    document["budget"] |= {"value": 1e-5, "source": "given", "plan_estimate": 0.0}
    document["reason"] = (
        "no plan meets the budget: the smallest estimated loss change of any layer in any "
        "format is 0.00012, the budget is 1e-05; every layer stays in bf16. Give a larger "
        "budget, or more seeds for the measured default"
    )
    document["verification"]["arms"]["plan"] = _arm(bf16, BASE_LOSSES)
    document["rounds"] = []
    return document


LONG_NAME = "model.transformer.encoder.layers.11.self_attention.query_key_value"


def six_formats() -> dict[str, Any]:
    """The passed document measured in all six formats (the default), with a long
    transformers-style name for its last layer: the widest tables."""
    tuned = passed()
    six = ["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8", "mxfp4", "nvfp4"]
    tuned["settings"]["formats"] = six
    for layer in tuned["measurements"].values():
        layer["formats"] = {f: layer["formats"]["fp8-rowwise"] for f in six}
    tuned["measurements"][LONG_NAME] = tuned["measurements"].pop("head")
    tuned["layers"][LONG_NAME] = tuned["layers"].pop("head")
    return tuned


_ROLES = {  # role: (worst SQNR dB as tuned.json writes it, estimate, chosen)
    "s": ({"out": 1.1, "dq": 5.2, "dk": 4.0, "dv": 3.9}, 2.6e-4, False),
    "o": ({"out": 29.8, "dq": "inf", "dk": "inf", "dv": "inf"}, 2.0e-6, True),
    "dv": ({"out": "inf", "dq": "inf", "dk": "inf", "dv": 28.7}, 0.0, True),
}
ATTENTION_KEPT = "o:mxfp8/head,dv:mxfp8/head"


def with_attention() -> dict[str, Any]:
    """The passed document tuned with ``attention="mxfp8"`` over three roles, read back
    from JSON (infinities as ``"inf"``): ``s`` failed its round and stays bf16."""
    document = passed()
    roles = {
        role: {"rule": "mxfp8/head", "flops": 524288, "sqnr": sqnr,
               "loss_change_estimate": estimate, "loss_change_coherent": estimate,
               "loss_change_second_order": 0.0, "chosen": chosen}
        for role, (sqnr, estimate, chosen) in _ROLES.items()
    }  # fmt: skip
    document["attention_tuning"] = {
        "config": "s:mxfp8/head,o:mxfp8/head,dv:mxfp8/head",
        "target": "blackwell",
        "speedups": dict.fromkeys(_ROLES, 2.0),
        "order": ["o", "dv", "s"],
        "roles": roles,
        "chosen": ATTENTION_KEPT,
        "reason": None,
        "not_converted": [],
    }
    document["schema"] = "amped.tune/2"
    document["attention"] = dict.fromkeys(("s", "dp", "dq", "dk")) | {
        "o": "mxfp8/head", "dv": "mxfp8/head", "causal_safe": True, "block_size": 128
    }  # fmt: skip
    plan = document["verification"]["arms"]["plan"] | {"attention": ATTENTION_KEPT}
    document["verification"]["arms"]["plan"] = plan
    every = "s:mxfp8/head," + ATTENTION_KEPT
    document["rounds"] = [
        _round(5, PLAN, 0.0072, 0.0047),
        _round(3, PLAN, 0.0075, 0.0213) | {"source": "attention", "attention": every,
                                           "passed": False},
        _round(2, PLAN, 0.0072, 0.0049) | {"source": "attention", "attention": ATTENTION_KEPT},
    ]  # fmt: skip
    return document
