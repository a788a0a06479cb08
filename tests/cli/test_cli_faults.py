"""The CLI under faults: a full disk, a file-size limit, a read-only or hostile --out,
tasks that break the contract, and runs that diverge (signals: test_cli_signals.py).

Every case ends with the documented exit code, one line on stderr and no traceback,
and the report folder holds either the previous pair of files or the new pair, whole.
In-process cases call main(); the ones that need a real kernel limit (tmpfs, rlimit,
signals) run the CLI in a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fault_helpers import (
    ENV,
    FACTORIES,
    OLD,
    ROOT,
    TINY,
    compare_command,
    error_line,
    old_pair,
    one_line,
    pair_state,
)
from results_schema import validate

from amped._internal import files
from amped.cli.main import main

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

# The runs that train measure peaks in process: an own-process probe is one more
# interpreter per recipe, and no fault here is about the probe.
IN_PROCESS = ("--peak-memory", "in-process")
RUN = (*TINY, *IN_PROCESS)

# --- the factory contract, checked before training ------------------------------


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("exits", "called sys.exit() (SystemExit(0))"),
        ("half_model", "must be float32"),
        ("details_not_json", "must be JSON-serialisable"),
        ("negative_threads", "Task.threads from"),
    ],
)
def test_contract_breaches_exit_2_before_training(capsys, tmp_path, factory, expected):
    args = ["compare", "--out", str(tmp_path / "out"), "--max-time", "0", "--no-progress"]
    code = main([*args, "--model", f"{FACTORIES}:{factory}"])
    err = capsys.readouterr().err
    assert code == 2
    line = one_line(err)  # no "fp32: running" line: no recipe started
    assert line.startswith("amped: error: ") and expected in line
    assert "Received:" in line
    assert not (tmp_path / "out").exists()  # checked before the folder is even made


def test_systemexit_from_doctor_factory_exits_2(capsys, tmp_path):
    code = main(["doctor", "--out", str(tmp_path), "--model", f"{FACTORIES}:exits"])
    assert code == 2
    assert "sys.exit()" in one_line(capsys.readouterr().err)


# --- diverged runs and bytes/param ------------------------------------------------


@pytest.mark.slow
def test_nan_from_step_one_is_flagged_with_exit_3(capsys, tmp_path):
    out = tmp_path / "out"
    args = [*RUN, "--model", f"{FACTORIES}:nan_loss", "--recipes", "fp32,bf16", "--steps", "4"]
    code = main(["compare", *args, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 3
    assert "2 recipe(s) diverged" in captured.err and "Traceback" not in captured.err
    assert "DIVERGED" in captured.out
    results = json.loads((out / "results.json").read_text())
    assert validate(results) == []
    for recipe in results["recipes"]:
        assert recipe["status"] == "complete"
        assert recipe["diverged"] is True and recipe["diverged_at_step"] == 1
        assert "diverged: the loss is inf/NaN from step 1 on" in recipe["notes"]
    page = (out / "report.html").read_text()
    assert "DIVERGED" in page and "fp32 diverged: its loss is inf/NaN from step 1" in page


@pytest.mark.slow
def test_healthy_run_is_not_diverged(capsys, tmp_path):
    args = [*RUN, "--recipes", "fp32", "--steps", "3", "--json", "--out", str(tmp_path)]
    assert main(["compare", *args]) == 0
    recipe = json.loads(capsys.readouterr().out)["recipes"][0]
    assert recipe["diverged"] is False and recipe["diverged_at_step"] is None


@pytest.mark.slow
def test_bytes_per_param_counts_optimizer_state_when_first_steps_are_skipped(capsys, tmp_path):
    spec = f"{FACTORIES}:overflows_first"
    args = [*RUN, "--model", spec, "--recipes", "fp32,fp16", "--steps", "14", "--json"]
    assert main(["compare", *args, "--out", str(tmp_path)]) == 0
    fp32, fp16 = json.loads(capsys.readouterr().out)["recipes"]
    assert fp16["skipped_steps"] >= 2  # the first steps did overflow
    assert fp16["loss_scales"][0] == 65536.0
    # fp16-mixed keeps float32 weights: the same state as fp32 (params, grads, AdamW's two
    # moments and step counters), not 8 bytes/param from a skipped first step.
    assert fp16["memory"]["optimizer_state_bytes"] == fp32["memory"]["optimizer_state_bytes"]
    assert fp16["memory"]["bytes_per_param"] == fp32["memory"]["bytes_per_param"] > 16


# --- the report writer --------------------------------------------------------------


def test_symlink_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    """Temporary names are random; even one guessed and planted is never written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    names = iter(["guessed", "guessed", "fresh1", "fresh2"])
    monkeypatch.setattr(files.tempfile, "_get_candidate_names", lambda: names)
    (out / ".results.json.guessed.tmp").symlink_to(victim)
    (out / "report.html").symlink_to(victim)  # and one at the target itself
    files.write_files([(out / "results.json", "{}"), (out / "report.html", "<html></html>")])
    assert victim.read_text() == "precious"
    assert not (out / "report.html").is_symlink()
    assert (out / "report.html").read_text() == "<html></html>"
    assert (out / "results.json").read_text() == "{}"
    assert (out / ".results.json.guessed.tmp").is_symlink()  # left as it was found


@pytest.mark.slow
def test_write_error_keeps_the_old_pair_and_no_temporaries(capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    old_pair(out)

    def full(handle: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    code = main(["compare", *RUN, "--recipes", "fp32", "--steps", "2", "--out", str(out)])
    assert code == 1
    line = error_line(capsys.readouterr().err)
    assert "Could not write the report" in line and "No space left on device" in line
    assert pair_state(out) == "old"


def test_doctor_write_error_keeps_the_old_pair(capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    old_pair(out, "doctor")
    monkeypatch.setattr(
        files.os, "fsync", lambda handle: (_ for _ in ()).throw(OSError(errno.EFBIG, "too large"))
    )
    code = main(["doctor", "--out", str(out), "--model", f"{FACTORIES}:good"])
    assert code == 1
    assert "Could not write the doctor's report" in error_line(capsys.readouterr().err)
    assert pair_state(out, "doctor") == "old"


def test_doctor_plot_takes_dollar_signs_in_module_names(capsys, tmp_path):
    code = main(["doctor", "--out", str(tmp_path), "--model", f"{FACTORIES}:dollar_names"])
    assert code == 0, capsys.readouterr().err
    assert pair_state(tmp_path, "doctor") == "new"
    assert "a$^$b" in (tmp_path / "doctor.json").read_text()


# --- kernel limits, in a subprocess -----------------------------------------------------


def _unshare_available() -> bool:
    if not shutil.which("unshare") or not shutil.which("mount"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=16k tmpfs /tmp"],
        capture_output=True,
    )
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(
    sys.platform != "linux" or not _unshare_available(),
    reason="needs unshare -rm to mount a private tmpfs",
)


def _in_tmpfs(
    out: Path, options: str, command: list[str], *, copy_to: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with a private tmpfs (``options``) mounted at ``out``, first
    holding an old pair (if writable); afterwards its whole content, hidden files
    included, is copied to ``copy_to`` (the mount ends with the namespace)."""
    seed = (
        f"printf '%s' '{json.dumps({'created': OLD})}' > \"$1/results.json\" && "
        f"printf '<html>{OLD}</html>\\n' > \"$1/report.html\" && "
        if copy_to is not None
        else ""
    )
    copy = f'; cp -a "$1/." "{copy_to}/"' if copy_to is not None else ""
    script = (
        f'mount -t tmpfs -o {options} tmpfs "$1" && {seed}'
        f'{{ out="$1"; shift; "$@"; rc=$?; set -- "$out"{copy}; exit $rc; }}'
    )
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(out), *command],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
    )


@pytest.mark.slow
@needs_tmpfs
def test_full_disk_exits_1_with_the_old_pair_kept(tmp_path):
    """A real 64 KiB filesystem: the report (~180 KB with its plots) does not fit."""
    out, seen = tmp_path / "out", tmp_path / "seen"
    out.mkdir()
    seen.mkdir()
    command = compare_command("--recipes", "fp32", "--steps", "3", *IN_PROCESS, "--out", str(out))
    result = _in_tmpfs(out, "size=64k", command, copy_to=seen)
    assert result.returncode == 1, result.stderr
    line = error_line(result.stderr)
    assert "Could not write the report" in line and "No space left on device" in line
    assert pair_state(seen) == "old"  # and no temporary left beside it


@pytest.mark.slow
@needs_tmpfs
def test_read_only_out_exits_2_before_training(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = _in_tmpfs(out, "ro", compare_command("--steps", "100000", "--out", str(out)))
    assert result.returncode == 2, result.stderr
    line = one_line(result.stderr)  # no "fp32: running" line: nothing trained
    assert "Cannot write into the report folder (Read-only file system)" in line


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_file_size_limit_exits_1_with_the_old_pair_kept(tmp_path):
    out = tmp_path / "out"
    old_pair(out)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    result = subprocess.run(
        compare_command("--recipes", "fp32", "--steps", "3", *IN_PROCESS, "--out", str(out)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=ENV,
        preexec_fn=limit,
    )
    assert result.returncode == 1, result.stderr
    assert "File too large" in error_line(result.stderr)
    assert pair_state(out) == "old"


def test_tempdir_is_left_clean(tmp_path):
    """The writer's probe and temporaries leave nothing behind."""
    files.check_writable(tmp_path)
    files.write_files([(tmp_path / "a.json", "{}"), (tmp_path / "b.html", "<html></html>")])
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.html"]
