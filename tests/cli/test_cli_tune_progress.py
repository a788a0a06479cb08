"""``amped tune``'s progress: the lines and the bars it shows for ``amped.tune``'s
``progress(stage, done, total)`` reports, and the first Ctrl-C taking effect there."""

from __future__ import annotations

import io
import os
import signal

import pytest

pytest.importorskip("rich")

from rich.console import Console

from amped.cli.tune.progress import TuneLines, TuneProgress
from amped.comparison import interrupt

REPORTS = [("measure", 1, 4), ("measure", 4, 4), ("train", 1, 3), ("train", 2, 3), ("train", 3, 3)]


def test_lines_name_each_stage_and_each_verification_run():
    stream = io.StringIO()
    with TuneLines(stream) as progress:
        for report in REPORTS:
            progress(*report)
    assert stream.getvalue().splitlines() == [
        "amped tune: measuring layers (4)",
        "amped tune: measuring layers: 4/4",
        "amped tune: verifying (3)",
        "amped tune: verifying: 1/3",
        "amped tune: verifying: 2/3",
        "amped tune: verifying: 3/3",
    ]


def test_bars_show_both_stages_to_completion():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100, color_system=None)
    with TuneProgress(console) as progress:
        for report in REPORTS:
            progress(*report)
    shown = buffer.getvalue()
    assert "measuring layers" in shown and "4/4" in shown
    assert "verifying" in shown and "3/3" in shown


@pytest.mark.parametrize("make", [lambda: TuneLines(io.StringIO()), lambda: TuneProgress(
    Console(file=io.StringIO(), force_terminal=True))], ids=["lines", "bars"])  # fmt: skip
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_first_signal_stops_the_run_at_the_next_report(make, signum):
    handlers = {number: signal.getsignal(number) for number in interrupt.SIGNALS}
    interrupt.immediate_interrupts()
    try:
        with interrupt.graceful_interrupts(), make() as progress:
            progress("train", 1, 3)  # nothing asked yet: carries on
            os.kill(os.getpid(), signum)  # only sets the flag
            with pytest.raises(KeyboardInterrupt):
                progress("train", 2, 3)
        assert interrupt.exit_code() == 128 + signum
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
