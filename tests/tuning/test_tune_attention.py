"""``amped.tune(..., attention=...)``: each attention role measured, the roles that fit
the budget and pass the verification lowered on top of the Linear plan, and the plan's
attention config through tuned.json and ``amped.prepare`` (docs/tune.md, "Attention
roles")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.helpers.tune_factories import ATTENTION_HEADS, ATTENTION_SEQ, attention_task, tiny

import amped
from amped.lowp.attention_config import ATTENTION_CONFIGS, AttentionConfig
from amped.recipes import PrecisionPlan
from amped.tuning import summary
from amped.tuning.attention import RoleMeasurement, measure_attention, role_order, role_path
from amped.tuning.choose import Choice

MXFP8 = ATTENTION_CONFIGS["mxfp8"]
KEPT = MXFP8.replace(s=None)  # what the outlier model's tune keeps
BUDGET = 1e-3
"""The loss budget of the tune below. The task's loss is the noise's variance, 0.25; an
MXFP8 cast costs a role or a layer about 30 dB, 1e-3 of the output's power, so a plan of
such casts changes the loss by about 1e-4 or less (its training gap). Losing S (the
outlier model's ``s``) makes the attention uniform, a change of the output's own size,
which training does not undo in a few steps: a gap far over 1e-3."""


def _roles(outlier: float | None) -> dict[str, RoleMeasurement]:
    model, batches, loss_fn = attention_task(outlier=outlier, count=1)
    measured, not_converted = measure_attention(model, batches, loss_fn, MXFP8)
    assert not_converted == []
    return {m.role: m for m in measured}


def test_the_flushed_role_is_measured_last_and_costliest() -> None:
    torch.manual_seed(0)
    roles = _roles(outlier=1e7)
    order = [m.role for m in role_order(list(roles.values()))]
    assert order[-1] == "s" and sorted(order) == sorted(MXFP8.rules())
    flushed = roles["s"]
    for role in ("o", "dv", "dp", "dq", "dk"):
        assert flushed.loss_change_estimate > 10 * roles[role].loss_change_estimate
    for role in ("dv", "dp", "dq", "dk"):  # backward roles leave the output as it is
        assert roles[role].loss_change_estimate == 0.0
        assert roles[role].sqnr["out"] == float("inf")
    assert roles["o"].loss_change_estimate > 0.0
    # 2 * batch * heads * q_len * k_len * head_dim, every role alike (head dims equal)
    flops = 2 * 4 * ATTENTION_HEADS * ATTENTION_SEQ * ATTENTION_SEQ * 32
    assert {m.flops for m in roles.values()} == {flops}

    torch.manual_seed(0)  # the control: the same model without the outlier channel
    control = _roles(outlier=None)["s"]
    assert control.loss_change_estimate < flushed.loss_change_estimate / 10
    assert control.worst_sqnr > flushed.worst_sqnr + 10


def _measurement(role: str, sqnr: float, estimate: float) -> RoleMeasurement:
    figures = dict.fromkeys(("out", "dq", "dk", "dv"), float("inf")) | {"out": sqnr}
    return RoleMeasurement(role, "mxfp8/head", 200, figures, estimate, estimate, 0.0)


def test_the_role_path_lowers_one_more_role_per_step_on_the_linear_plan() -> None:
    sqnrs = {"s": 1.0, "o": 30.0, "dv": 29.0, "dp": 30.0, "dq": 28.0, "dk": 25.0}
    measured = [_measurement(role, sqnr, 1e-5 * sqnr) for role, sqnr in sqnrs.items()]
    assert [m.role for m in role_order(measured)] == ["o", "dp", "dv", "dq", "dk", "s"]
    base = Choice({"inp": "fp8-rowwise", "out": "bf16"}, 1e-5, 100.0)
    path = role_path(measured, MXFP8, base, "blackwell")
    assert path[0] is base and len(path) == 7
    order = [m.role for m in role_order(measured)]
    for count, choice in enumerate(path[1:], start=1):
        assert choice.layers == base.layers and choice.attention is not None
        assert set(choice.attention.rules()) == set(order[:count])
        # saving: flops * (1 - 1/2) per role (MXFP8 runs 2x bf16 on Blackwell)
        assert choice.saving == pytest.approx(base.saving + count * 100)
        assert choice.estimate == pytest.approx(
            base.estimate + sum(sqnrs[r] for r in order[:count]) * 1e-5
        )
    assert path[-1].attention == MXFP8
    # Hopper has no MX tensor cores: no MXFP8 role saves time there
    assert role_path(measured, MXFP8, base, "hopper") == [base]


def test_tune_refuses_attention_for_a_model_without_attention() -> None:
    with pytest.raises(ValueError, match=r"this model has none"):
        amped.tune(tiny, formats=["fp8-rowwise"], steps=1, budget=1.0, attention="fp8")


@pytest.mark.slow
def test_tune_keeps_the_flushed_role_in_bf16_and_lowers_the_others(tmp_path: Path) -> None:
    # Whether the estimate proposes s or not, training fails it (a gap of about 3e-3)
    # and passes the plans without it, so the rounds (4) end on the five other roles.
    result = amped.tune(attention_task, formats=["fp8-rowwise"], steps=4, seeds=2,
                        budget=BUDGET, attention="mxfp8")  # fmt: skip
    assert result.passed and result.plan.attention == KEPT
    assert result.plan.lowered()  # the Linear layers too, verified together
    assert result.arms["plan"].attention == KEPT
    tuned = result.to_dict()
    assert tuned["schema"] == "amped.tune/2" and tuned["attention"] == KEPT.to_dict()
    roles = tuned["attention_tuning"]["roles"]
    assert {r for r, m in roles.items() if not m["chosen"]} == {"s"}
    attention_rounds = [r for r in tuned["rounds"] if r["source"] == "attention"]
    assert any(not r["passed"] and "s:" in r["attention"] for r in attention_rounds)
    path = result.save(tmp_path / "tuned.json")
    saved = json.loads(path.read_text())  # as the report reads it: infinities as "inf"
    rows = summary.attention_rows(saved)
    assert rows[-1]["role"] == "s" and rows[-1]["choice"] == "bf16"
    assert "s in bf16" in summary.headline(saved)

    model, _, _ = attention_task()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), path)
    assert setup.attention is not None and setup.attention.config == KEPT


def test_a_plan_with_attention_round_trips_through_tuned_json(tmp_path: Path) -> None:
    plan = PrecisionPlan("bf16-mixed", {"inp": "fp8-rowwise", "out": "bf16"}, KEPT)
    assert plan.to_dict()["schema"] == "amped.tune/2"
    assert PrecisionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert PrecisionPlan.load(plan.save(tmp_path / "tuned.json")) == plan
    assert PrecisionPlan("bf16-mixed", plan.layers, "mxfp8").attention == MXFP8
    assert plan.digest() != PrecisionPlan("bf16-mixed", plan.layers).digest()


@pytest.mark.parametrize(
    "config",
    [*ATTENTION_CONFIGS.values(), MXFP8.replace(causal_safe=False, block_size=64)],
    ids=[*ATTENTION_CONFIGS, "unsafe-block-64"],
)
def test_an_attention_config_round_trips_through_its_dict(config: AttentionConfig) -> None:
    assert AttentionConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_tuned_json_without_attention_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"  # as amped.tune wrote it before attention was tuned
    path.write_text('{"schema": "amped.tune/1", "base": "bf16-mixed", "layers": '
                    '{"inp": "fp8-rowwise"}, "passed": true, "source": "estimate"}')  # fmt: skip
    plan = PrecisionPlan.load(path)
    assert plan.attention is None and plan.layers == {"inp": "fp8-rowwise"}
    assert plan.to_dict()["schema"] == "amped.tune/1"


def test_load_refuses_an_attention_entry_under_the_old_schema(tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"  # a reader of amped.tune/1 would drop the attention
    path.write_text(json.dumps({"schema": "amped.tune/1", "base": "bf16-mixed",
                                "layers": {}, "attention": KEPT.to_dict()}))  # fmt: skip
    with pytest.raises(ValueError, match='has no "attention"') as caught:
        PrecisionPlan.load(path)
    assert str(path) in str(caught.value)


def _entry(**changes: object) -> object:
    return KEPT.to_dict() | changes


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("mxfp8", "keys"),
        ({"s": None}, "keys"),
        (_entry(extra=1), "keys"),
        (_entry(o="e9m9/head"), "format is one of"),
        (_entry(o=8), "role 'o'"),
        (_entry(causal_safe="yes"), "causal_safe"),
        (_entry(block_size=33), "block_size"),
    ],
    ids=[
        "a-name",
        "missing-keys",
        "unknown-key",
        "unknown-format",
        "a-number",
        "causal-safe-not-bool",
        "block-size",
    ],
)
def test_load_refuses_a_bad_attention_entry(tmp_path: Path, entry: object, match: str) -> None:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"schema": "amped.tune/2", "base": "bf16-mixed",
                                "layers": {}, "attention": entry}))  # fmt: skip
    with pytest.raises(ValueError, match=match) as caught:
        PrecisionPlan.load(path)
    assert str(path) in str(caught.value) and '"attention"' in str(caught.value)


def _trained(plan: PrecisionPlan | str, attention: AttentionConfig | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model, batches, loss_fn = attention_task(outlier=None, count=1)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), plan, attention=attention)
    assert setup.attention is not None and setup.attention.config == KEPT
    seen = []
    for inputs, targets in batches:
        with setup.autocast():
            loss = loss_fn(setup.model(inputs), targets)
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
        seen.append(loss.detach())
    return seen + [p.detach().clone() for p in model.parameters()]


def test_prepare_runs_the_plans_attention_as_the_attention_argument(tmp_path: Path) -> None:
    layers = {"inp": "fp8-rowwise", "out": "bf16"}
    path = PrecisionPlan("bf16-mixed", layers, KEPT).save(tmp_path / "tuned.json")
    from_plan = _trained(str(path), None)
    by_hand = _trained(PrecisionPlan("bf16-mixed", layers), KEPT)
    for a, b in zip(from_plan, by_hand, strict=True):  # losses, then every weight
        assert torch.equal(a, b)


def test_prepare_refuses_an_attention_argument_beside_a_plans_own() -> None:
    model, _, _ = attention_task(outlier=None, count=1)
    plan = PrecisionPlan("bf16-mixed", {}, KEPT)
    with pytest.raises(ValueError, match="carries its own attention config"):
        amped.prepare(model, torch.optim.AdamW(model.parameters()), plan, attention="fp8")


@pytest.mark.slow
def test_no_mxfp8_role_is_lowered_for_hopper_and_the_result_says_why() -> None:
    result = amped.tune(attention_task, formats=["fp8-rowwise"], steps=1, seeds=1,
                        budget=1.0, attention="mxfp8", target="hopper", rounds=1)  # fmt: skip
    assert result.plan.attention is None and result.plan.lowered()
    assert result.attention is not None and "no role of" in result.attention["reason"]
    assert not any(r["source"] == "attention" for r in result.rounds)
    assert result.to_dict()["schema"] == "amped.tune/1"
