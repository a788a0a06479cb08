"""Importing amped changes no global state: torch's settings, Python's, matplotlib's.

A library that flips a global on import changes the user's program before it has done
anything: a plotting backend switched under a notebook, a thread count or matmul
precision that silently differs from the run without amped. Each check runs in a fresh
interpreter, reads every global it can before and after ``import amped`` and
``import amped.doctor``, and compares.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import hashlib, json, logging, os, random, signal, sys, warnings
    {matplotlib_setup}
    import torch
    import torch._dynamo.config, torch._functorch.config  # read below; amped imports them


    def _optional(read):
        try:
            return read()
        except (AttributeError, RuntimeError, TypeError):  # absent on this torch release
            return "n/a"


    def torch_globals():
        cuda = torch.backends.cuda
        return {{
            "default dtype": torch.get_default_dtype(),
            "default device": _optional(torch.get_default_device),
            "num threads": torch.get_num_threads(),
            "num interop threads": torch.get_num_interop_threads(),
            "grad mode": torch.is_grad_enabled(),
            "inference mode": torch.is_inference_mode_enabled(),
            "anomaly mode": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            "autocast cpu": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
            "autocast cuda": (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
            "autocast cache": torch.is_autocast_cache_enabled(),
            "deterministic algorithms": (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            "float32 matmul precision": torch.get_float32_matmul_precision(),
            "cudnn": (
                torch.backends.cudnn.enabled,
                torch.backends.cudnn.benchmark,
                torch.backends.cudnn.deterministic,
                torch.backends.cudnn.allow_tf32,
            ),
            "cuda matmul": (
                cuda.matmul.allow_tf32,
                cuda.matmul.allow_fp16_reduced_precision_reduction,
                cuda.matmul.allow_bf16_reduced_precision_reduction,
            ),
            "sdp backends": (
                cuda.flash_sdp_enabled(),
                cuda.mem_efficient_sdp_enabled(),
                cuda.math_sdp_enabled(),
            ),
            "mkldnn": torch.backends.mkldnn.enabled,
            "rng state": hashlib.sha256(bytes(torch.get_rng_state().tolist())).hexdigest(),
            "initial seed": torch.initial_seed(),
            "print options": vars(torch._tensor_str.PRINT_OPTS),
            "torch function modes": torch._C._len_torch_function_stack(),
            "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
            "dynamo config": sorted(torch._dynamo.config.get_config_copy().items()),
            "dynamo compile callbacks": (
                list(torch._dynamo.callback_handler.start_callbacks),
                list(torch._dynamo.callback_handler.end_callbacks),
            ),
            "functorch config": sorted(torch._functorch.config.get_config_copy().items()),
        }}


    def python_globals():
        root = logging.getLogger()
        return {{
            "random state": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
            "warning filters": warnings.filters,
            "signal handlers": [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
            "excepthook": sys.excepthook,
            "root logger": (root.level, root.handlers),
            "torch logger": logging.getLogger("torch").level,
            "environment": sorted(os.environ.items()),
        }}


    def matplotlib_globals():
        if "matplotlib" not in sys.modules:
            return {{}}
        import matplotlib

        params = {{f"rcParams[{{key}}]": value for key, value in matplotlib.rcParams.items()}}
        return {{"backend": matplotlib.get_backend(), **params}}


    def snapshot():
        state = {{**torch_globals(), **python_globals(), **matplotlib_globals()}}
        return {{key: repr(value) for key, value in state.items()}}


    before = snapshot()
    import amped

    after_amped = snapshot()
    import amped.doctor

    print(json.dumps({{
        "before": before,
        "after import amped": after_amped,
        "after import amped.doctor": snapshot(),
        "matplotlib loaded": "matplotlib" in sys.modules,
    }}))
    """
)

# A backend other than the one the doctor would pick (Agg), set the way a user sets it.
_MATPLOTLIB_SETUP = "import matplotlib\nmatplotlib.use('svg')"


def _probe(matplotlib_setup: str) -> dict:
    script = _PROBE.format(matplotlib_setup=matplotlib_setup)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_unchanged(result: dict) -> None:
    before = result["before"]
    for stage in ("after import amped", "after import amped.doctor"):
        after = result[stage]
        changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
        assert not changed, f"{stage} changed global state (before, after): {changed}"


@pytest.mark.slow  # a fresh interpreter importing torch and amped: seconds
def test_import_leaves_torch_and_python_globals_untouched():
    result = _probe("")
    _assert_unchanged(result)
    # The core never needs the plotting library; only the CLI (the face) draws.
    assert not result["matplotlib loaded"]


@pytest.mark.slow
def test_import_leaves_the_users_matplotlib_backend_alone():
    pytest.importorskip("matplotlib")
    result = _probe(_MATPLOTLIB_SETUP)
    assert json.loads(json.dumps(result["before"]["backend"])) == "'svg'"
    _assert_unchanged(result)
