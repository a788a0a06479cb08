"""``amped doctor``'s arguments (kept apart from the runner, which needs the cli extra)."""

from __future__ import annotations

import argparse

__all__ = ["add_doctor_parser"]


def add_doctor_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="find the op that overflows or underflows in low precision, and a fix",
        description=(
            "Run one training step of a task in float32 and in a low dtype; report per "
            "module and op where values overflow, underflow or lose precision, the first "
            "op that produced inf/NaN, and a verified fix (a policy or a loss scale)."
        ),
    )
    add = doctor.add_argument
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory, as for amped compare (default: the built-in tiny GPT)")  # fmt: skip
    add("--dtype", default="float16", metavar="DTYPE",
        help="low dtype: float16 (fp16, half) or bfloat16 (bf16) (default: float16)")  # fmt: skip
    add("--policy", default="torch", choices=["torch", "strict"], help="policy preset")
    add("--loss-scale", type=float, default=None,
        help="loss scale to check (default: 65536 for fp16, 1 for bf16)")  # fmt: skip
    add("--batch-size", type=int, default=None, help="passed to the factory")
    add("--device", default=None, help="cpu or cuda (default: cuda if available)")
    add("--seed", type=int, default=0, help="seed for weights, data and dropout")
    add("--out", default="amped-doctor", help="report folder (default: amped-doctor/)")
    add("--json", action="store_true", help="print only the report JSON on stdout")
    add("--traceback", action="store_true", help="print the traceback of a failure")
    doctor.epilog = (
        "exit status: 0 no non-finite value, or one the doctor fixed (the fix is verified "
        "by a re-run); 3 a non-finite value (inf/NaN) it could not fix; 1 the doctor failed; "
        "2 bad arguments"
    )
