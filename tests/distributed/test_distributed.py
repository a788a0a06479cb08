"""amped on torch.distributed, with 2 real processes (gloo, CPU, 127.0.0.1 only).

Two launches in all, since starting the ranks costs more than the scenarios: a run
whose rank 1 is killed mid-run, then one that runs every scenario of
``dist_scenarios.py``, resuming the killed run among them. The tests read what each
rank saved.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from dist_launch import COLLECTIVE_TIMEOUT_S, Rank, kill_all, launch, wait_all, wait_for_line
from dist_scenarios import (
    CKPT_EVERY,
    CKPT_STEPS,
    DDP_RECIPES,
    FSDP_RECIPES,
    GATHERS,
    INF_STEP,
    INF_STEPS,
    SCENARIOS,
)
from tolerances import DISTRIBUTED_LOSS_UNITS, DISTRIBUTED_PARAM_UNITS

import amped
from amped.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("timing")]  # one worker: timing


def unit_roundoff(recipe: str) -> float:
    dtype = amped.recipes.registry.resolve_recipe(recipe).dtype or torch.float32
    return torch.finfo(dtype).eps / 2  # 2**-8 bfloat16, 2**-11 float16, 2**-24 float32


def tolerance(units: dict[str, int], recipe: str) -> float:
    return unit_roundoff(recipe) * units["fp32" if recipe == "fp32" else "low"]


# A rank whose peer was killed must stop this soon: gloo notices the closed socket at
# once (measured: well under a second); the collective time-out bounds the worst case.
STOP_BOUND_S = COLLECTIVE_TIMEOUT_S + 15


@dataclasses.dataclass
class KilledRun:
    """A 2-rank ``checkpointed`` run whose rank 1 got SIGKILL after its first checkpoint."""

    workdir: Path
    survivor: Rank
    stopped_after_s: float | None  # from the kill until rank 0 exited; None: it hung
    saved_step: int | None  # the step of the last checkpoint it left


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> KilledRun:
    workdir = tmp_path_factory.mktemp("killed")
    ranks = launch(["--slow", "checkpointed"], workdir)
    try:
        wait_for_line(ranks[1], f"saved {CKPT_EVERY}", deadline_s=120)
        ranks[1].process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            ranks[0].process.wait(timeout=STOP_BOUND_S)
            stopped_after: float | None = time.monotonic() - killed_at
        except subprocess.TimeoutExpired:
            stopped_after = None
    finally:
        kill_all(ranks)  # the watchdog: nothing outlives the fixture
    checkpoint = workdir / "checkpoint.pt"
    saved = load_checkpoint(checkpoint)["step"] if checkpoint.exists() else None
    return KilledRun(workdir, ranks[0], stopped_after, saved)


@pytest.fixture(scope="module")
def results(tmp_path_factory, killed_run) -> dict[str, list[dict]]:
    """Run every scenario once on 2 ranks: {scenario: [rank 0's results, rank 1's]}.

    One launch (starting the ranks costs more than the scenarios), which also resumes
    the killed run from its last checkpoint (scenario ``resumed``).
    """
    out = tmp_path_factory.mktemp("dist")
    wait_all(launch(["--resume", str(killed_run.workdir), *SCENARIOS], out))
    return {
        name: [load_checkpoint(out / f"{name}.rank{rank}.pt") for rank in (0, 1)]
        for name in SCENARIOS
    }


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- 1. an inf on one rank only ----------------------------------------------------


@pytest.mark.parametrize("scenario", ["inf_ddp", "inf_fsdp"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(results, scenario):
    ranks = results[scenario]
    expected_stepped = [step != INF_STEP for step in range(INF_STEPS)]
    # init_scale 1024, backoff 0.5, growth_interval too long to grow: closed form.
    expected_scales = [1024.0 if step < INF_STEP else 512.0 for step in range(INF_STEPS)]
    for rank in ranks:
        assert rank["stepped"] == expected_stepped
        assert rank["scales"] == expected_scales
        assert rank["unchanged_at_inf_step"]  # no parameter moved on the skipped step
        assert rank["all_reduce_calls"] == INF_STEPS  # one collective per step
    assert same_params(ranks[0]["params"], ranks[1]["params"])


def test_without_agreement_the_replicas_diverge(results):
    """The control: the inf was written after DDP's all-reduce, where only an explicit
    process group makes the ranks agree; without one they split."""
    ranks = results["inf_ddp_unagreed"]
    assert ranks[0]["stepped"][INF_STEP] and not ranks[1]["stepped"][INF_STEP]
    assert ranks[0]["scales"] != ranks[1]["scales"]
    assert not same_params(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["all_reduce_calls"] == 0


# --- 2. two processes against one -----------------------------------------------------


@pytest.mark.parametrize(
    "scenario",
    [f"ddp_{r}" for r in DDP_RECIPES] + [f"fsdp_{r}" for r in FSDP_RECIPES],
)
def test_two_processes_match_one_on_the_same_global_batch(results, scenario):
    ranks = results[scenario]
    control = ranks[0]["control"]
    recipe = scenario.split("_", 1)[1]
    # Decisions are exact: the same steps skipped (the poisoned sample lies in rank 1's
    # rows only) and the same scale after every step.
    assert ranks[0]["stepped"] == ranks[1]["stepped"] == control["stepped"]
    assert ranks[0]["scales"] == ranks[1]["scales"] == control["scales"]
    assert same_params(ranks[0]["params"], ranks[1]["params"])  # replicas bitwise equal
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]),
        torch.tensor(control["losses"]),
        rtol=tolerance(DISTRIBUTED_LOSS_UNITS, recipe),
        atol=0.0,
        equal_nan=True,  # the poisoned step's loss is NaN in both
    )
    for name, expected in control["params"].items():
        got = ranks[0]["params"][name]
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            got, expected, rtol=0.0, atol=tolerance(DISTRIBUTED_PARAM_UNITS, recipe) * scale
        )


# --- 3. a rank killed mid-run, and resuming ------------------------------------------


def test_a_killed_rank_ends_the_job_with_a_clear_error_in_bounded_time(killed_run):
    survivor = killed_run.survivor
    assert killed_run.stopped_after_s is not None, f"rank 0 hung\n{survivor.describe()}"
    assert survivor.process.returncode == 3, survivor.describe()
    assert "Connection closed by peer" in survivor.errors(), survivor.describe()
    assert "restart every rank" in survivor.errors()


def test_resuming_from_the_last_checkpoint_matches_the_uninterrupted_run(results, killed_run):
    saved = killed_run.saved_step
    assert saved is not None and CKPT_EVERY <= saved < CKPT_STEPS  # the kill came mid-run
    resumed, whole = results["resumed"], results["checkpointed"]
    assert resumed[0]["start"] == saved and whole[0]["start"] == 0
    assert whole[0]["scales"] == whole[1]["scales"]
    assert len(set(whole[0]["scales"])) > 2  # the scale both backed off and grew
    for rank in (0, 1):
        assert resumed[rank]["scales"] == whole[rank]["scales"][saved:]
        assert resumed[rank]["losses"] == whole[rank]["losses"][saved:]
        assert same_params(resumed[rank]["params"], whole[rank]["params"])


# --- 4. gathering objects, and scalers that disagree ----------------------------------


def test_gather_objects_matches_all_gather_object_and_lets_go_of_its_tensors(results):
    for rank in (0, 1):
        objects = results["gathered"][rank]["objects"]
        assert objects == [
            [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * i}] for i in range(GATHERS)
        ]
        waits = results["gathered"][rank]["waits"]
        assert len(waits) == GATHERS
        # gloo's worker still holds the tensors on about 1 return of a collective in 4
        # here; every time, it had let go of them before gather_objects returned.
        assert all(wait["released"] and wait["back"] for wait in waits)


def test_check_scaler_agreement_names_the_rank_that_differs(results):
    for rank in (0, 1):
        message = results["gathered"][rank]["disagreement"]
        assert message is not None and "differing ranks=[1]" in message
        assert "'scale': 1024.0" in message  # rank 0's state, which the others differ from
