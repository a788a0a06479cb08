"""The ``amped`` argument parser: its commands, and the validators they share.

A flag that means the same in ``amped compare``, ``amped doctor`` and ``amped tune`` is
parsed by the same validator, so all reject the same values with the same message
(exit code 2).
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from amped.cli.errors import UsageError
from amped.cli.out_dir import out_folder, seed
from amped.exporting.formats import EXPORT_FORMATS
from amped.lowp.attention_config import ATTENTION_CONFIGS
from amped.recipes.registry import recipe_names
from amped.tuning.tuner import DEFAULT_FORMATS

__all__ = ["build_parser", "loss_budget", "positive_int", "seconds"]

DEFAULT_STEPS = 200
DEFAULT_MAX_TIME = 120.0
DEFAULT_OUT = "amped-report"
DEFAULT_DOCTOR_OUT = "amped-doctor"
DEFAULT_TUNE_OUT = "amped-tune"
DEFAULT_VERIFY_OUT = "amped-verify"
DEFAULT_TUNE_STEPS = 50
DEFAULT_TUNE_SEEDS = 3
DEFAULT_TUNE_MAX_TIME = 600.0
DEFAULT_TUNE_ROUNDS = 4


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one-line UsageErrors."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def positive_int(text: str) -> int:
    """An integer >= 1 (``--steps``, ``--batch-size``, ``--threads``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A duration in seconds, 0 for no limit (``--max-time``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"expected seconds (0 for no limit), got {text!r}")
    return value


def loss_budget(text: str) -> float:
    """An accuracy budget: a loss change >= 0 (``--budget``)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value != float("inf")):  # also refuses NaN
        raise argparse.ArgumentTypeError(
            f"expected a loss change >= 0 (e.g. 0.01), got {text!r}; leave --budget out "
            "for the default (the measured seed-to-seed spread of bf16-mixed)"
        )
    return value


def _add_layer_arguments(add: argparse._ActionsContainer, who: str) -> None:
    """``--module-filter`` and ``--exclude``, the same for compare and tune."""
    add.add_argument("--module-filter", default=None, metavar="LAYERS",
                     help=f"the layers {who} (names or regular expressions matched "
                     "against the whole qualified name, comma-separated; default: "
                     "layers with dims multiple of 16, 32 for MX, and 64x64 weights or "
                     "more, except the output head)")  # fmt: skip
    add.add_argument("--exclude", default=None, metavar="LAYERS",
                     help="layers kept in bfloat16 whatever --module-filter says "
                     "(names or regular expressions, comma-separated)")  # fmt: skip


def _add_task_arguments(add: argparse._ActionsContainer, device_help: str, out: str) -> None:
    """The flags that pick and build the task, the same for both commands."""
    add.add_argument("--batch-size", type=positive_int, default=None,
                     help="passed to the factory")  # fmt: skip
    add.add_argument("--device", default=None, help=device_help)
    add.add_argument("--seed", type=seed, default=0,
                     help="seed for weights, data and dropout, in [0, 2**64 - 1] "
                     "(default: 0)")  # fmt: skip
    add.add_argument("--out", type=out_folder, default=out,
                     help=f"report folder (default: {out}/); one run at a time "
                     "writes into it")  # fmt: skip


_COMPARE = (
    "measure what mixed precision buys a model",
    "Train one task once per precision recipe (fp32 first) and compare speed, memory and "
    "loss; print a table and write report.html and results.json.",
)
_DOCTOR = (
    "find the op that overflows or underflows in low precision, and a fix",
    "Run one training step of a task in float32 and in a low dtype; report per module and "
    "op where values overflow, underflow or lose precision, the first op that produced "
    "inf/NaN, and a verified fix (a policy or a loss scale).",
)
_DOCTOR_EXIT = (
    "exit status: 0 no non-finite value, or one the doctor fixed (the fix is verified by a "
    "re-run); 3 a non-finite value (inf/NaN) it could not fix; 1 the doctor failed; 2 bad "
    "arguments. With --replay: 0 the bundle replayed as recorded and any non-finite value "
    "has a verified fix; 3 otherwise; 2 a bundle refused"
)


def _add_compare(compare: argparse.ArgumentParser) -> None:
    add = compare.add_argument
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory returning (model, batches, loss_fn); a module or path/to/file.py "
        "(default: the built-in tiny GPT on Python's own source)")  # fmt: skip
    names = ", ".join(recipe_names())
    add("--recipes", default="all",
        help=f"comma-separated recipes or aliases (default: all: {names})")  # fmt: skip
    add("--steps", type=positive_int, default=DEFAULT_STEPS,
        help=f"train steps per recipe (default: {DEFAULT_STEPS})")  # fmt: skip
    _add_task_arguments(compare, "cpu, cuda or cuda:N (default: cuda if available)", DEFAULT_OUT)
    _add_layer_arguments(compare, "the FP8 and block recipes convert")
    add("--attention", default=None, metavar="CONFIG",
        help="run every recipe's attention (nn.MultiheadAttention, a transformers "
        "model's) through amped's low-precision attention in this config: "
        f"{', '.join(sorted(ATTENTION_CONFIGS))} (default: attention as it is)")  # fmt: skip
    add("--max-time", type=seconds, default=DEFAULT_MAX_TIME, metavar="SECONDS",
        help="bound the whole comparison, memory probes included (not the warm-up: "
        "each recipe's first steps and compiles), by SECONDS: estimate "
        "each recipe's step time, then train all for as many steps as fit, at most "
        f"--steps; the report says what was cut (default: {DEFAULT_MAX_TIME:g}; "
        "0: no limit)")  # fmt: skip
    add("--threads", type=positive_int, default=None,
        help="CPU threads for torch, the same for every recipe (default: the task's "
        "choice, else torch's, or 1 when other processes keep the cores busy; the "
        "built-in task uses 1)")  # fmt: skip
    add("--peak-memory", choices=["own-process", "in-process"], default="own-process",
        help="on a CPU, measure each recipe's peak memory in a process of its own (default; "
        "a few seconds per recipe, and its ordering follows the state each recipe holds) "
        "or in this process (quicker, but noise at small sizes)")  # fmt: skip
    add("--json", action="store_true", help="print only the results JSON on stdout")
    add("--no-progress", action="store_true", help="no progress bars (a line per recipe)")
    add("--traceback", action="store_true", help="print the traceback of failed recipes")


def _add_doctor(doctor: argparse.ArgumentParser) -> None:
    add = doctor.add_argument
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory, as for amped compare (default: the built-in tiny GPT)")  # fmt: skip
    add("--dtype", default="float16", metavar="DTYPE",
        help="low dtype: float16 (fp16, half) or bfloat16 (bf16) (default: float16)")  # fmt: skip
    add("--policy", default="torch", choices=["torch", "strict"], help="policy preset")
    add("--loss-scale", type=float, default=None,
        help="loss scale to check (default: 65536 for fp16, 1 for bf16)")  # fmt: skip
    _add_task_arguments(doctor, "cpu or cuda (default: cuda if available)", DEFAULT_DOCTOR_OUT)
    add("--json", action="store_true", help="print only the report JSON on stdout")
    add("--traceback", action="store_true", help="print the traceback of a failure")
    add("--replay", default=None, metavar="BUNDLE",
        help="rerun a bundle that amped.monitor(setup, record=DIR) wrote, on the CPU: "
        "reproduce its first non-finite value, bisect its cause over the recipe and verify "
        "the smallest fix (--model, if given, must be the model it recorded; --recipe NAME "
        "checks the recipe); prints the result, writes nothing")  # fmt: skip
    add("--recipe", default=None, metavar="NAME",
        help="with --replay: the recipe the bundle must come from")  # fmt: skip


_TUNE = (
    "choose each layer's precision (FP8, MXFP8, NVFP4, ...), verified by training",
    "Measure each eligible layer's sensitivity to every candidate format on real batches, "
    "choose the per-layer plan that lowers the most GEMM FLOPs within the accuracy budget, "
    "verify it by short training runs against bf16-mixed over several seeds; print a "
    "table and write tuned.json (load it with amped.prepare(model, optimizer, "
    "'DIR/tuned.json')) and tune.html.",
)
_TUNE_EXIT = (
    "exit status: 0 a plan met the budget and passed its verification; 3 no lowered plan "
    "met the budget, or the chosen plan failed its verification or --max-time cut it "
    "short (tuned.json says which, and why); 1 the run failed; 2 bad arguments or a "
    "model with no eligible layer"
)


def _add_tune(tune: argparse.ArgumentParser) -> None:
    add = tune.add_argument
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory, as for amped compare (default: the built-in tiny GPT)")  # fmt: skip
    add("--formats", default="all",
        help="comma-separated candidate formats for the layers (default: all: "
        f"{', '.join(DEFAULT_FORMATS)}); bf16 is always a choice")  # fmt: skip
    add("--budget", type=loss_budget, default=None, metavar="LOSS",
        help="the largest loss change a plan may cost against bf16-mixed (default: the "
        "seed-to-seed spread of bf16-mixed's final loss, the sample standard deviation "
        "over the seeds, measured on the task)")  # fmt: skip
    add("--steps", type=positive_int, default=DEFAULT_TUNE_STEPS,
        help=f"train steps per verification run (default: {DEFAULT_TUNE_STEPS})")  # fmt: skip
    add("--seeds", type=positive_int, default=DEFAULT_TUNE_SEEDS,
        help="seeds the verification trains each arm with, from --seed on (default: "
        f"{DEFAULT_TUNE_SEEDS})")  # fmt: skip
    add("--rounds", type=positive_int, default=DEFAULT_TUNE_ROUNDS,
        help="the most plans the verification trains: the first is the largest within "
        "the budget by the estimate, each later one moves along the estimate's order (a "
        "bisection); 1 verifies that first plan only (default: "
        f"{DEFAULT_TUNE_ROUNDS})")  # fmt: skip
    add("--attention", default=None, metavar="FORMAT",
        choices=sorted(name for name in ATTENTION_CONFIGS if name != "bf16"),
        help="also tune the attention: the format to try in each role ("
        f"{', '.join(sorted(n for n in ATTENTION_CONFIGS if n != 'bf16'))}); roles that "
        "fail the budget or the verification stay bf16 (default: attention as it is)")  # fmt: skip
    _add_layer_arguments(tune, "tune may lower")
    _add_task_arguments(tune, "cpu, cuda or cuda:N (default: cuda if available)", DEFAULT_TUNE_OUT)
    add("--max-time", type=seconds, default=DEFAULT_TUNE_MAX_TIME, metavar="SECONDS",
        help="no verification run starts after SECONDS from the start; a verification "
        "cut short does not pass (default: "
        f"{DEFAULT_TUNE_MAX_TIME:g}; 0: no limit)")  # fmt: skip
    add("--threads", type=positive_int, default=None,
        help="CPU threads for torch (default: as amped compare chooses them)")  # fmt: skip
    add("--json", action="store_true", help="print only tuned.json on stdout")
    add("--no-progress", action="store_true", help="no progress bar (a line per phase)")
    add("--traceback", action="store_true", help="print the traceback of a failure")


_VERIFY = (
    "check a low-precision backend's step against amped's exact reference",
    "Run one training step of a task through a backend (amped, torchao or Transformer "
    "Engine) and check every low-precision GEMM of the layers the recipe converts: casts "
    "bit for bit against amped's, outputs within the bound of float32 accumulation; print "
    "a table and write verify.json and verify.html.",
)
_VERIFY_EXIT = "exit status: 0 nothing flagged; 1 something flagged (or verify failed); 2 bad input"


def _add_verify(verify: argparse.ArgumentParser) -> None:
    from amped.verification.verify import RECIPES

    add = verify.add_argument
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory, as for amped compare (default: the built-in tiny GPT)")  # fmt: skip
    add("--backend", default="amped", choices=["amped", "torchao", "te"],
        help="what runs the step (default: amped)")  # fmt: skip
    add("--recipe", required=True, choices=list(RECIPES),
        help="the recipe said to be running; with --backend torchao, torchao's own "
        "configuration of it")  # fmt: skip
    _add_task_arguments(verify, "cpu or cuda (default: cuda if available)", DEFAULT_VERIFY_OUT)
    add("--json", action="store_true", help="print only verify.json on stdout")
    add("--traceback", action="store_true", help="print the traceback of a failure")


_EXPORT = (
    "write a trained checkpoint in the inference format of its recipe, checked",
    "Build the model with --model, prepare it for --recipe, load --checkpoint (saved by "
    "amped.checkpoint.save_checkpoint) and write OUT/ in the inference format of the "
    "recipe (NVFP4, MXFP8, MXFP4 in compressed-tensors' layout; fp8-blockwise in "
    "DeepSeek-V3's): each low-precision weight cast as its forward cast it, read back "
    "with an independent reader and compared bit for bit, weights and logits.",
)
_EXPORT_EXIT = (
    "exit status: 0 written and checked; 3 the check failed (nothing written); 2 bad "
    "arguments, OUT exists without --force, a format the recipe did not train in without "
    "--requantize, or a layer the format cannot hold; 1 the export failed"
)


def _add_export(export: argparse.ArgumentParser) -> None:
    add = export.add_argument
    add("out", metavar="OUT", help="the folder to write (its parent must exist)")
    add("--checkpoint", required=True, metavar="PATH",
        help="a checkpoint saved by amped.checkpoint.save_checkpoint, holding the "
        "prepared model's state_dict (setup.model.state_dict())")  # fmt: skip
    add("--key", default="model",
        help="the checkpoint's entry holding the model state (default: model)")  # fmt: skip
    add(
        "--recipe",
        required=True,
        help="the recipe the model trained with (nvfp4, mxfp8, mxfp4, fp8-blockwise, ...)",
    )
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory, as for amped compare, building the model as training did "
        "(default: the built-in tiny GPT)")  # fmt: skip
    add("--format", default=None, choices=sorted(EXPORT_FORMATS),
        help="the inference format (default: the one the recipe trained in)")  # fmt: skip
    add(
        "--requantize",
        action="store_true",
        help="allow a format the recipe did not train in (a new grid, not the trained one)",
    )
    add("--force", action="store_true", help="replace OUT if it exists")
    add("--no-check", action="store_true", help="write without reading the folder back")
    add(
        "--seed",
        type=seed,
        default=0,
        help="the factory's seed (default: 0); the check's held-out batches use seed + 1",
    )
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cpu)")
    add("--traceback", action="store_true", help="print the traceback of a failure")


def build_parser() -> argparse.ArgumentParser:
    """The ``amped`` parser with its ``compare``, ``doctor``, ``tune``, ``verify`` and
    ``export`` commands."""
    parser = _Parser(prog="amped", description="Mixed-precision training for PyTorch.")
    parser.add_argument("--version", action="store_true", help="print amped's version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_compare(commands.add_parser("compare", help=_COMPARE[0], description=_COMPARE[1]))
    doctor = commands.add_parser("doctor", help=_DOCTOR[0], description=_DOCTOR[1])
    doctor.epilog = _DOCTOR_EXIT
    _add_doctor(doctor)
    tune = commands.add_parser("tune", help=_TUNE[0], description=_TUNE[1])
    tune.epilog = _TUNE_EXIT
    _add_tune(tune)
    verify = commands.add_parser("verify", help=_VERIFY[0], description=_VERIFY[1])
    verify.epilog = _VERIFY_EXIT
    _add_verify(verify)
    export = commands.add_parser("export", help=_EXPORT[0], description=_EXPORT[1])
    export.epilog = _EXPORT_EXIT
    _add_export(export)
    return parser
