"""Start real process groups for the distributed tests: loopback only, bounded in time.

(And a group of one rank in this process, for the tests that need one but no peer.)

Each rank is a subprocess running ``tests/helpers/dist_worker.py`` with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``) and
``GLOO_SOCKET_IFNAME=lo``, so neither the rendezvous nor gloo's own connections leave
the loopback interface. Output goes to files (a pipe nobody reads can block a rank),
and every wait has a deadline after which every rank still alive is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "dist_worker.py"
LOOPBACK = "127.0.0.1"
# Ranks give up on a collective after this long (init_process_group's timeout), and
# the launcher kills what is left after LAUNCH_DEADLINE_S.
COLLECTIVE_TIMEOUT_S = 30
LAUNCH_DEADLINE_S = 180
FSDP2_DEADLINE_S = 600  # tests/helpers/dist_fsdp2_worker.py: every FSDP2 scenario in one launch


@contextlib.contextmanager
def one_rank_group() -> Iterator[object]:
    """A gloo process group of this process alone, over an in-memory store (no socket
    is connected); destroyed on exit. Yields the group."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already running in this process")
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        if previous is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@dataclasses.dataclass
class Rank:
    rank: int
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def output(self) -> str:
        return self.stdout.read_text(errors="replace")

    def errors(self) -> str:
        return self.stderr.read_text(errors="replace")

    def describe(self) -> str:
        code = self.process.poll()
        return (
            f"--- rank {self.rank} (exit code {code}) stdout:\n{self.output()}\n"
            f"--- rank {self.rank} stderr:\n{self.errors()[-4000:]}"
        )


def launch(
    args: list[str], workdir: Path, world: int = 2, worker: Path | None = None
) -> list[Rank]:
    """Start ``world`` ranks of ``worker`` (default :data:`WORKER`) with ``args``; results
    and logs go to ``workdir``."""
    worker = worker or WORKER
    port = free_port()
    ranks = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "AMPED_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
            # Inductor compiles in this process: a rank's compiles are few and mostly
            # cache hits, where starting a pool of compile workers costs seconds.
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
        stdout, stderr = workdir / f"rank{rank}.out", workdir / f"rank{rank}.err"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            process = subprocess.Popen(
                [sys.executable, str(worker), str(workdir), *args], env=env, stdout=out, stderr=err
            )
        ranks.append(Rank(rank, process, stdout, stderr))
    return ranks


def kill_all(ranks: list[Rank]) -> None:
    for rank in ranks:
        if rank.process.poll() is None:
            rank.process.send_signal(signal.SIGKILL)
    for rank in ranks:
        rank.process.wait()


def wait_all(ranks: list[Rank], deadline_s: float = LAUNCH_DEADLINE_S) -> None:
    """Wait for every rank to exit 0; past the deadline, kill them all and fail."""
    end = time.monotonic() + deadline_s
    try:
        for rank in ranks:
            rank.process.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_all(ranks)
        report = "\n".join(rank.describe() for rank in ranks)
        raise AssertionError(f"ranks still running after {deadline_s} s\n{report}") from None
    failed = [rank for rank in ranks if rank.process.returncode != 0]
    if failed:
        raise AssertionError("\n".join(rank.describe() for rank in failed))


def wait_for_line(rank: Rank, line: str, deadline_s: float) -> None:
    """Poll the rank's stdout until it holds ``line``; fail (killing nothing) past the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if line in rank.output().splitlines():
            return
        if rank.process.poll() is not None:
            raise AssertionError(f"rank exited before printing {line!r}\n{rank.describe()}")
        time.sleep(0.02)
    raise AssertionError(f"no {line!r} within {deadline_s} s\n{rank.describe()}")


_RESULTS: dict[str, list[Any]] = {}


def ranks_results(worker: str, workdir: Path, deadline_s: float) -> list[Any]:
    """Each rank's results (``workdir/rankR.pt``) of a 2-rank run of ``tests/<worker>``,
    launched once per test session: test modules sharing a worker share its run."""
    if worker not in _RESULTS:
        wait_all(launch([], workdir, worker=TESTS / worker), deadline_s=deadline_s)
        files = [workdir / f"rank{rank}.pt" for rank in range(2)]
        _RESULTS[worker] = [torch.load(path, weights_only=False) for path in files]
    return _RESULTS[worker]
