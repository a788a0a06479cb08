"""Verification: is a low-precision run right? :func:`verify` runs one training step
through a backend (amped, torchao, Transformer Engine) and checks every cast bit for
bit, and every GEMM within the bound of its accumulation, against amped's exact
reference of the recipe said to be running. It returns a
:class:`~amped.verification.report.VerifyReport`.
"""

from amped.verification.report import VerifyReport as VerifyReport  # the return type
from amped.verification.verify import verify

__all__ = ["verify"]
