"""A slow test's independent jobs, run in two worker processes at a time.

CI has 2 cores and runs the tests one at a time. A test whose work is several
independent jobs that each keep one core busy (cold Inductor compiles, which a process
runs one after another; one-thread training runs) finishes in about half the time when
two processes share the jobs. The results are the same as run here: the same
functions on the same inputs, the same torch, the thread count the job sets.

The workers are spawned (a fresh interpreter: no threads forked mid-state) and import
the job's module by name, which works for the test modules because pytest puts each
test's folder (and tests/conftest.py tests/helpers/) on ``sys.path`` and spawning
passes it on. They see none of tests/conftest.py's
fixtures: a job sets what it needs (threads, the casts' compile setting).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["run_in_two_processes"]


def run_in_two_processes(
    job: Callable[..., Any], arguments: dict[Hashable, tuple[Any, ...]]
) -> dict[Hashable, Any]:
    """``{key: job(*args)}`` for each ``key: args``, two worker processes at a time.

    ``job`` must be a module-level function and its arguments and result picklable
    (FP8 tensors are not: pass their bits as ``uint8``). An exception in a job is
    raised here, a worker that dies as ``BrokenProcessPool``; then, as on a time-out
    (pytest-timeout's), the jobs not started are cancelled and the running ones left to
    end on their own.
    """
    spawn = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn)
    try:
        futures = {key: pool.submit(job, *args) for key, args in arguments.items()}
        return {key: future.result() for key, future in futures.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
