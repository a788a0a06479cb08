"""``amped compare``'s measured peaks for the memory ladder, ordered like the bytes per
parameter that ``amped.memory_report`` counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import HELPERS

pytest.importorskip("rich")


from amped.cli.main import main

FACTORIES = HELPERS / "cli_factories.py"


@pytest.mark.slow  # three recipes, each probed in a process of its own: a minute
def test_measured_peaks_follow_the_state_each_recipe_holds(tmp_path, capsys) -> None:
    # wide_mlp: 8.4 M parameters in two 2048 x 2048 layers, tiny activations, so the
    # training state dominates the peak: 16 bytes/param under fp32 (128 MiB), 10 under
    # bf16-pure (80 MiB), 6.03 under bf16-pure-8bit (48 MiB). On the built-in task the
    # same run orders nothing (2 MiB of state under the libraries' working memory). The
    # 8-bit step holds its kernel's float32 intermediates for one piece of 2**18
    # elements (about 6 MiB), far below the 32 MiB of state it saves over bf16-pure.
    def compare(recipes: str, out: Path) -> list[str]:
        return ["compare", "--model", f"{FACTORIES}:wide_mlp", "--recipes", recipes,
                "--steps", "2", "--max-time", "0", "--threads", "1", "--json",
                "--no-progress", "--out", str(out)]  # fmt: skip

    # No separate warm-up run: compare's own warm-up phase trains each recipe in this
    # process before the probes (amped.comparison.warmup), so the fused steps, at the
    # task's shapes, are in Inductor's disk cache before a probe process steps; on a
    # fresh machine the compiler's own memory stays out of the measured peaks.
    assert main(compare("fp32,bf16-pure,bf16-pure-8bit", tmp_path / "measured")) == 0
    results = json.loads(capsys.readouterr().out)
    fp32, pure, eight = (r["memory"] for r in results["recipes"])
    assert fp32["bytes_per_param"] > pure["bytes_per_param"] > eight["bytes_per_param"]
    assert all(m["peak_kind"] == "own_process_peak_rss" for m in (fp32, pure, eight))
    params = fp32["param_count"]
    # Each step down the ladder saves at least half its state difference in peak
    # (allocator rounding and the step's temporaries take the rest).
    assert fp32["peak_bytes"] - pure["peak_bytes"] > 3 * params, (fp32, pure)
    assert pure["peak_bytes"] - eight["peak_bytes"] > 2 * params, (pure, eight)
