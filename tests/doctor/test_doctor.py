"""The numerics doctor names the module and op that break, and its fixes work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import doctor_models
import pytest
import torch
import torch.nn as nn

import amped
from amped.doctor import diagnose
from amped.doctor.gradients import check_gradient, recommended_scale

FP16, BF16 = torch.float16, torch.bfloat16


def _mean_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


@pytest.mark.parametrize(
    "build",
    [
        doctor_models.exp_overflow,
        doctor_models.softmax_input_overflow,
        doctor_models.norm_variance_overflow,
    ],
    ids=["exp", "pre-softmax-linear", "norm-variance"],
)
def test_names_the_overflowing_module_and_op_and_fixes_it(build):
    model, x, module, op = build()
    report = diagnose(model, x, _mean_loss, dtype=FP16)
    assert not report.healthy
    culprit = report.forward_culprit
    assert culprit is not None and (culprit.module, culprit.op) == (module, op)
    assert culprit.source is not None and "doctor_reports.py" in culprit.source
    suggestion = report.suggestion
    assert suggestion is not None and suggestion.verified and suggestion.policy is not None
    # The fix is a Policy the user passes straight to autocast: re-run, nothing overflows.
    fixed = diagnose(model, x, _mean_loss, dtype=FP16, policy=suggestion.policy)
    assert fixed.forward_culprit is None
    assert all(o.n_inf == 0 and o.n_nan == 0 for o in fixed.ops)
    with amped.autocast("cpu", dtype=FP16, policy=suggestion.policy):
        assert torch.isfinite(model(x)).all()


def test_tiny_gradients_underflow_and_the_recommended_scale_keeps_them():
    model, x = doctor_models.tiny_gradients()

    def tiny_loss(out):
        return out.float().pow(2).mean() * 1e-6

    report = diagnose(model, x, tiny_loss, dtype=FP16, loss_scale=1.0)
    assert report.forward_culprit is None
    lossy = {g.name: g.underflow for g in report.gradients if g.underflow > 0.01}
    assert "0.weight" in lossy
    suggestion = report.suggestion
    assert suggestion is not None and suggestion.verified and suggestion.policy is None
    assert suggestion.loss_scale == report.recommended_scale > 1.0
    rescored = diagnose(model, x, tiny_loss, dtype=FP16, loss_scale=suggestion.loss_scale)
    assert all(g.underflow <= 0.01 for g in rescored.gradients)


def test_scaler_argument_sets_the_checked_scale():
    model, x = doctor_models.tiny_gradients()
    scaler = amped.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first scale() call
    report = diagnose(model, x, _mean_loss, dtype=FP16, scaler=scaler)
    assert report.loss_scale == 8.0


def test_underflow_fraction_and_scale_by_hand():
    # float16's smallest subnormal is 2**-24; values at or below half of it round to 0.
    half = 2.0**-25
    grad = torch.tensor([1e-9, 1e-5, 0.0, 1.0, -3e-8])
    check = check_gradient("w", grad, scale=1.0, dtype=FP16)
    # non-zeros: 1e-9, 1e-5, 1.0, 3e-8; lost: 1e-9 and 3e-8 (both <= 2**-25 ~ 2.98e-8)?
    lost = [v for v in (1e-9, 1e-5, 1.0, 3e-8) if v <= half]
    assert check.underflow == pytest.approx(len(lost) / 4)
    # smallest power of two S with 1e-9 * S > 2**-25: 2**5 = 32 (1e-9 * 32 = 3.2e-8)
    assert check.min_scale == 32.0
    assert not check.overflows and check.amax == 1.0
    assert check_gradient("w", grad, scale=2.0**17, dtype=FP16).overflows  # 2**17 > 65504
    # largest power of two below 65504 / 1.0 / 2 (headroom): 2**14
    assert recommended_scale([check], FP16) == 2.0**14


def test_healthy_transformers_model_gets_a_clean_report():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    report = diagnose(model, {"input_ids": ids, "labels": ids}, lambda out: out.loss, dtype=BF16)
    assert report.healthy, report.summary()
    assert report.forward_culprit is None and report.backward_culprit is None
    assert report.suggestion is None
    assert report.ops and all(o.n_inf == 0 and o.n_nan == 0 for o in report.ops)
    assert report.sqnr_db > 20  # bfloat16 keeps ~8 bits: output SQNR well above 20 dB


def test_leaves_no_state_behind():
    model, x, _, _ = doctor_models.exp_overflow()
    model.train()
    model.head.proj.weight.grad = torch.ones_like(model.head.proj.weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grad_before = model.head.proj.weight.grad.clone()
    rng = torch.get_rng_state()
    diagnose(model, x, _mean_loss, dtype=FP16)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model.head.proj.weight.grad, grad_before)
    assert model.embed.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_input_gets_clear_errors():
    model, x, _, _ = doctor_models.exp_overflow()
    with pytest.raises(ValueError, match="scalar floating tensor"):
        diagnose(model, x, lambda out: out, dtype=FP16)
    with pytest.raises(ValueError, match=r"float16 or torch\.bfloat16"):
        diagnose(model, x, _mean_loss, dtype=torch.float32)
    with pytest.raises(ValueError, match="input tensor is on 'meta'"):
        diagnose(model, x.to("meta"), _mean_loss, dtype=FP16)
    with pytest.raises(ValueError, match="device_type is 'cuda'"):
        diagnose(model, x, _mean_loss, dtype=FP16, device_type="cuda")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        diagnose(lambda t: t, x, _mean_loss)  # type: ignore[arg-type]


def test_json_and_html_outputs(tmp_path):
    pytest.importorskip("matplotlib")
    model, x, module, op = doctor_models.exp_overflow()
    report = diagnose(model, x, _mean_loss, dtype=FP16)
    data = json.loads(report.to_json())
    assert data["healthy"] is False
    assert (data["forward_culprit"]["module"], data["forward_culprit"]["op"]) == (module, op)
    assert data["suggestion"]["verified"] is True
    assert {"module", "op", "amax", "n_inf", "underflow", "sqnr_db"} <= set(data["ops"][0])
    page = report.save_html(tmp_path / "doctor.html").read_text()
    assert "data:image/png;base64," in page and "head" in page
    assert "first non-finite value" in report.summary()


def test_doctor_pages_refuse_what_is_not_a_report(tmp_path):
    from amped.cli.doctor.html import save_doctor_plot
    from amped.doctor.report import Report

    for save in (Report.save_html, save_doctor_plot):
        with pytest.raises(
            TypeError, match=r"the Report amped\.doctor\.diagnose\(\) returns.*Received: report='x'"
        ):
            save("x", tmp_path / "page")
    assert list(tmp_path.iterdir()) == []


def test_module_by_type_root_model_is_named_root():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.mul_(1e5)
    report = diagnose(lin, torch.randn(2, 4) * 10, _mean_loss, dtype=FP16)
    assert report.forward_culprit is not None and report.forward_culprit.module == ""
    assert report.suggestion is not None and report.suggestion.verified


_IMPORT_AND_RENDER = """
import sys, torch
state = lambda: (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
                 torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())
before = state()
import amped.doctor
assert "matplotlib" not in sys.modules, "importing amped.doctor imported matplotlib"
assert state() == before, (before, state())
import matplotlib
from amped.cli.doctor import html as doctor_report
model = torch.nn.Linear(4, 4)
report = amped.doctor.diagnose(model, torch.randn(2, 4), lambda y: y.float().mean())
assert doctor_report.doctor_plot_png(report).startswith(bytes([0x89]) + b"PNG")
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules
print("ok")
"""


@pytest.mark.slow
def test_import_and_plot_leave_matplotlib_and_torch_settings_alone():
    """Importing the doctor loads no matplotlib and changes no torch setting; drawing its
    plot keeps the user's matplotlib backend (no ``matplotlib.use``, no pyplot)."""
    pytest.importorskip("matplotlib")
    env = {**os.environ, "MPLBACKEND": "svg"}
    result = subprocess.run([sys.executable, "-c", _IMPORT_AND_RENDER], capture_output=True,
                            text=True, timeout=300, env=env)  # fmt: skip
    assert result.stdout.strip() == "ok", result.stderr


def test_exports_are_the_checks():
    # (their reports' types are private: reach them as what diagnose returns)
    assert set(amped.doctor.__all__) == {"diagnose", "diagnose_low_precision", "replay"}
    assert all(hasattr(amped.doctor, name) for name in amped.doctor.__all__)


@pytest.mark.parametrize(
    ("build", "policy"),
    [(doctor_models.exp_overflow, "torch"), (doctor_models.softmax_input_overflow, "torch")],
    ids=["op-fix", "module-fix"],
)
def test_the_fix_line_executed_builds_the_verified_policy(build, policy):
    model, x, *_ = build()
    report = diagnose(model, x, _mean_loss, dtype=FP16, policy=policy)
    suggestion = report.suggestion
    assert suggestion is not None and suggestion.verified and suggestion.code is not None
    assert suggestion.code.startswith(f"amped.Policy.preset({policy!r}, 'cpu').with_")
    built = eval(suggestion.code, {"amped": amped})  # the line a user pastes
    assert built == suggestion.policy
    fixed = diagnose(model, x, _mean_loss, dtype=FP16, policy=built)
    assert fixed.forward_culprit is None
    assert json.loads(report.to_json())["suggestion"]["code"] == suggestion.code
    assert f"  fix: {suggestion.code}" in report.summary().splitlines()


def test_a_forward_overflow_says_nothing_about_loss_scales():
    model, x, *_ = doctor_models.exp_overflow()
    report = diagnose(model, x, _mean_loss, dtype=FP16)
    assert report.forward_culprit is not None
    assert "loss scale:" not in report.summary() and "safe loss scale" not in report.summary()


def test_a_loss_scale_fix_line_builds_the_scaler_it_verified():
    model, x = doctor_models.tiny_gradients()
    report = diagnose(model, x, lambda out: out.float().pow(2).mean() * 1e-6, dtype=FP16,
                      loss_scale=1.0)  # fmt: skip
    suggestion = report.suggestion
    assert suggestion is not None and suggestion.verified and suggestion.code is not None
    scaler = eval(suggestion.code, {"amped": amped})
    assert isinstance(scaler, amped.GradScaler)
    assert scaler.get_scale() == suggestion.loss_scale
