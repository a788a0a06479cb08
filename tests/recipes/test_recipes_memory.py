"""memory_report: exact bytes per role for a known model, every recipe, SGD-momentum and
AdamW, against closed forms."""

from __future__ import annotations

import pytest
import torch
from recipes_helpers import batches, mlp, optimizer, train

import amped

N = 32 * 64 + 64 + 64 * 8 + 8  # parameters of mlp(norm=False): 2632, in 4 tensors
TENSORS = 4
NORM = 2 * 64  # the LayerNorm's weight and bias in mlp()

# Bytes per parameter: (weights, gradients, masters, SGD-momentum state, AdamW state).
PER_PARAM = {
    "fp32": (4, 4, 0, 4, 8),
    "bf16-mixed": (4, 4, 0, 4, 8),
    "fp16-mixed": (4, 4, 0, 4, 8),
    "bf16-master": (2, 2, 4, 4, 8),
    "fp16-master": (2, 2, 4, 4, 8),
    "bf16-pure": (2, 2, 0, 2 + 2, 2 + 2 + 2),  # + a bfloat16 Kahan compensation
    "bf16-pure-sr": (2, 2, 0, 2, 2 + 2),  # stochastic rounding needs no buffer
    # mlp()'s tensors are all below 4096 elements, so AdamW keeps their moments in
    # float32 (tests/optim/test_recipes_8bit.py counts a transformer's 8-bit ones); SGD's
    # momentum stays bfloat16.
    "bf16-pure-8bit": (2, 2, 0, 2, 4 + 4),
}
# torch's AdamW keeps its step count as a float32 tensor per parameter tensor; the
# compensated AdamW keeps a Python int.
TORCH_STEP_BYTES = 4 * TENSORS


def _report(recipe, opt_name, norm=False):
    model = mlp(norm=norm)
    setup = amped.prepare(model, optimizer(opt_name, model.parameters()), recipe)
    train(setup, batches(1))  # the optimizer builds its state at the first step
    return amped.memory_report(model, setup.optimizer)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("recipe", PER_PARAM)
def test_exact_bytes_per_role(recipe, opt_name):
    report = _report(recipe, opt_name)
    weights, grads, masters, sgd_state, adamw_state = PER_PARAM[recipe]
    state = N * (sgd_state if opt_name == "sgd" else adamw_state)
    if opt_name == "adamw" and "pure" not in recipe:
        state += TORCH_STEP_BYTES
    assert report.num_params == N
    assert (report.params, report.grads, report.masters, report.optimizer_state) == (
        N * weights,
        N * grads,
        N * masters,
        state,
    )
    assert report.master_grads == N * masters  # float32 master gradients, in the step only
    assert report.peak == report.total + (N * (4 - 2) if masters else 0)


def test_bytes_per_param_headlines():
    per_param = {
        (r, o): _report(r, o).bytes_per_param
        for r in ("fp32", "bf16-master", "bf16-pure")
        for o in ("sgd", "adamw")
    }
    step = TORCH_STEP_BYTES / N
    assert per_param == {
        ("fp32", "sgd"): 12.0,
        ("fp32", "adamw"): 16.0 + step,
        ("bf16-master", "sgd"): 12.0,
        ("bf16-master", "adamw"): 16.0 + step,
        ("bf16-pure", "sgd"): 8.0,
        ("bf16-pure", "adamw"): 10.0,
    }


def test_o2_norms_keep_float32_weights_and_need_no_master():
    report = _report("bf16-master", "adamw", norm=True)
    low = N
    assert report.num_params == low + NORM
    assert report.params_by_dtype == {"bfloat16": low, "float32": NORM}
    assert report.params == 2 * low + 4 * NORM
    assert report.masters == 4 * low
    assert report.optimizer_state == 8 * (low + NORM) + 4 * (TENSORS + 2)


def test_report_as_data_and_table():
    report = _report("bf16-pure", "adamw")
    data = report.as_dict()
    assert data["total"] == 10 * N and data["bytes_per_param"]["total"] == 10.0
    assert data["state_by_key"] == {"exp_avg": 2 * N, "exp_avg_sq": 2 * N, "compensation": 2 * N}
    table = report.table()
    assert str(report) == table
    assert "2,632 parameters (bfloat16 2,632)" in table
    assert "compensation" in table and "10.00" in table


def test_an_empty_optimizer_state_counts_zero():
    model = torch.nn.Linear(3, 3)
    report = amped.memory_report(model, torch.optim.AdamW(model.parameters()))
    assert report.optimizer_state == 0 and report.bytes_per_param == 8.0
