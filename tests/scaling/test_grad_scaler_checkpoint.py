"""Scaler state across processes: state_dict both ways with torch, pickling, atomic
checkpoints that refuse torn files, and a run killed with SIGKILL that resumes bitwise."""

from __future__ import annotations

import io
import math
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import HELPERS
from scaler_helpers import BackoffOnly

import amped
from amped.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from amped.scaling import Bounded, DynamicScale, Hysteresis, StaticScale

WORKER = HELPERS / "scaler_train_worker.py"
FLAGS = [False, True, False, False, True, True, False, False, False, True, False, False]


def through_bytes(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class Loop:
    """One parameter, one optimizer: ``run(scaler, flags)`` returns the scales."""

    def __init__(self) -> None:
        self.param = torch.zeros(3, requires_grad=True)
        self.optimizer = torch.optim.SGD([self.param], lr=0.1)

    def run(self, scaler, flags: list[bool]) -> list[float]:
        scales = []
        for overflow in flags:
            self.optimizer.zero_grad()
            value = math.inf if overflow else 1.0
            scaler.scale((self.param * value).sum()).backward()
            scaler.step(self.optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales


EXTRAS = {
    "default": {},
    "hysteresis": dict(hysteresis=3),
    "bounds-history": dict(min_scale=2.0, max_scale=64.0, record_history=True),
    "strategy": dict(strategy=Bounded(Hysteresis(DynamicScale(), 3), min_scale=2.0)),
    "strategy-static": dict(strategy=StaticScale()),
}


@pytest.mark.parametrize("extras", EXTRAS.values(), ids=EXTRAS.keys())
@pytest.mark.parametrize("how", ["state_dict", "pickle"])
def test_round_trip_mid_run_continues_identically(extras, how: str) -> None:
    args = dict(init_scale=8.0, growth_interval=2, **extras)
    whole = Loop().run(amped.GradScaler("cpu", **args), FLAGS)
    loop = Loop()
    first = amped.GradScaler("cpu", **args)
    head = loop.run(first, FLAGS[:5])  # stops inside an overflow streak
    if how == "pickle":
        second = pickle.loads(pickle.dumps(first))
    else:
        second = amped.GradScaler("cpu")
        second.load_state_dict(through_bytes(first.state_dict()))
    assert second.strategy == first.strategy
    assert head + loop.run(second, FLAGS[5:]) == whole


# Strategies no keyword arguments describe: state_dict cannot rebuild them, so the
# loading scaler must be built with the same one.
UNDESCRIBED = {
    "own-class": BackoffOnly(),
    "inside-out": Hysteresis(Bounded(DynamicScale(), max_scale=64.0), 2),
}


@pytest.mark.parametrize("strategy", UNDESCRIBED.values(), ids=UNDESCRIBED.keys())
@pytest.mark.parametrize("how", ["state_dict", "pickle"])
def test_round_trip_of_a_strategy_no_keywords_describe(strategy, how: str) -> None:
    args = dict(init_scale=8.0, growth_interval=2, strategy=strategy)
    whole = Loop().run(amped.GradScaler("cpu", **args), FLAGS)
    loop = Loop()
    first = amped.GradScaler("cpu", **args)
    head = loop.run(first, FLAGS[:5])
    if how == "pickle":
        second = pickle.loads(pickle.dumps(first))
    else:
        state = through_bytes(first.state_dict())
        assert state["amped"]["strategy"] is None
        second = amped.GradScaler("cpu", init_scale=8.0, strategy=strategy)
        second.load_state_dict(state)
    assert second.strategy == strategy
    assert head + loop.run(second, FLAGS[5:]) == whole


def test_undescribed_strategy_needs_the_same_kind_of_scaler() -> None:
    source = amped.GradScaler("cpu", strategy=BackoffOnly())
    Loop().run(source, FLAGS[:3])
    target = amped.GradScaler("cpu", hysteresis=2)
    before = target.state_dict()
    with pytest.raises(ValueError, match="strategy of your own"):
        target.load_state_dict(source.state_dict())
    assert target.state_dict() == before
    with pytest.raises(ValueError, match="holds counters"):  # another strategy of one's own
        amped.GradScaler("cpu", init_scale=8.0, strategy=UNDESCRIBED["inside-out"]).load_state_dict(
            source.state_dict()
        )


def test_pickle_keeps_history_and_skip_flag() -> None:
    scaler = amped.GradScaler("cpu", record_history=True)
    Loop().run(scaler, [False, True])
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.history == scaler.history and clone.last_step_skipped is True


def test_state_dict_is_torchs_unless_an_amped_strategy_is_in_use() -> None:
    # Frameworks save and compare torch's layout; amped adds its entry only when it
    # holds something torch's cannot (a strategy of its own, a recorded history).
    ours, theirs = amped.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    Loop().run(ours, FLAGS[:5])
    Loop().run(theirs, FLAGS[:5])
    assert ours.state_dict() == theirs.state_dict()
    assert set(amped.GradScaler("cpu", hysteresis=2).state_dict()) == set(theirs.state_dict()) | {
        "amped"
    }
    assert "amped" in amped.GradScaler("cpu", record_history=True).state_dict()


@pytest.mark.parametrize("extras", EXTRAS.values(), ids=EXTRAS.keys())
def test_amped_checkpoint_loads_into_torch(extras) -> None:
    scaler = amped.GradScaler("cpu", init_scale=8.0, growth_interval=2, **extras)
    Loop().run(scaler, FLAGS[:7])
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(through_bytes(scaler.state_dict()))
    ours = scaler.state_dict()
    assert {key: ours[key] for key in theirs.state_dict()} == theirs.state_dict()


def test_torch_checkpoint_loads_into_amped_keeping_its_strategy() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5, backoff_factor=0.25)
    Loop().run(theirs, FLAGS[:7])
    ours = amped.GradScaler("cpu", hysteresis=2)
    ours.load_state_dict(through_bytes(theirs.state_dict()))
    assert ours.get_scale() == theirs.get_scale()
    assert ours.get_backoff_factor() == 0.25 and ours.get_growth_interval() == 5
    assert ours._get_growth_tracker() == theirs._get_growth_tracker()
    assert ours.state_dict()["amped"]["strategy"]["hysteresis"] == 2
    assert ours.state_dict()["amped"]["counters"] == {"overflow_streak": 0}


def test_amped_checkpoint_brings_its_strategy() -> None:
    source = amped.GradScaler("cpu", hysteresis=4, max_scale=2.0**20)
    target = amped.GradScaler("cpu")
    target.load_state_dict(source.state_dict())
    assert target.strategy == source.strategy
    # A strategy passed as an object is saved as the keywords that compose it.
    same = amped.GradScaler("cpu", strategy=Bounded(Hysteresis(DynamicScale(), 4), None, 2.0**20))
    assert same.state_dict() == source.state_dict()
    assert amped.GradScaler("cpu", strategy=DynamicScale()).state_dict() == (
        amped.GradScaler("cpu").state_dict()
    )


def test_loading_after_scale_refills_in_place() -> None:
    scaler = amped.GradScaler("cpu", hysteresis=2)
    scale_tensor = scaler.scale(torch.ones(())) and scaler._scale
    source = amped.GradScaler("cpu", init_scale=32.0, hysteresis=2)
    scaler.load_state_dict(source.state_dict())
    assert scaler._scale is scale_tensor and scaler.get_scale() == 32.0


# --- checkpoint files -------------------------------------------------------------


def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "run.pt"
    scaler = amped.GradScaler("cpu", hysteresis=2)
    save_checkpoint(path, weight=torch.arange(256.0), scaler=scaler.state_dict(), step=7)
    return path


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    state = load_checkpoint(checkpoint(tmp_path))
    assert state["step"] == 7 and torch.equal(state["weight"], torch.arange(256.0))
    assert state["scaler"] == amped.GradScaler("cpu", hysteresis=2).state_dict()
    assert os.listdir(tmp_path) == ["run.pt"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[: len(data) // 2], "torn, truncated or corrupt"),
        (lambda data: data[:100], "torn, truncated or corrupt"),
        (lambda data: b"", "torn, truncated or corrupt"),
        (
            lambda data: data.replace(torch.arange(256.0)[9:10].numpy().tobytes(), b"\0" * 4),
            "CRC-32",
        ),
    ],
    ids=["half", "header-only", "empty", "flipped-tensor-bytes"],
)
def test_damaged_checkpoint_is_refused(tmp_path: Path, damage, message: str) -> None:
    path = checkpoint(tmp_path)
    data = path.read_bytes()
    damaged = damage(data)
    assert damaged != data
    path.write_bytes(damaged)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nothing.pt")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = checkpoint(tmp_path)
    with pytest.raises(Exception):  # noqa: B017 - torch's pickling error type varies
        save_checkpoint(path, unpicklable=lambda: None)
    assert load_checkpoint(path)["step"] == 7
    assert os.listdir(tmp_path) == ["run.pt"]


def test_non_dict_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="holds a list"):
        load_checkpoint(path)


# --- kill and resume ----------------------------------------------------------------


def worker(*args: str | os.PathLike[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        cwd=HELPERS,
        stdout=subprocess.PIPE,
        text=True,
    )


def final_params(path: Path) -> list[torch.Tensor]:
    return load_checkpoint(path)["params"]


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bitwise_identical(tmp_path: Path) -> None:
    reference = worker(tmp_path / "reference.pt", tmp_path / "reference-out.pt")
    killed = worker(tmp_path / "run.pt", tmp_path / "out.pt", "--slow")
    assert killed.stdout is not None
    for line in killed.stdout:
        if line.strip() == "saved 40":
            break
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    interrupted_at = load_checkpoint(tmp_path / "run.pt")["step"]
    assert 40 <= interrupted_at < 120, "the kill must land mid-run"
    assert not (tmp_path / "out.pt").exists()

    resumed = worker(tmp_path / "run.pt", tmp_path / "out.pt")
    assert resumed.wait(timeout=120) == 0 and reference.wait(timeout=120) == 0
    for ours, theirs in zip(
        final_params(tmp_path / "out.pt"), final_params(tmp_path / "reference-out.pt"), strict=True
    ):
        assert torch.equal(ours, theirs)
