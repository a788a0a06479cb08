"""report.html and doctor.html in headless Chromium: rendered, readable, nothing cut off.

Skips cleanly where no Chromium is installed (the README's optional line installs it:
``apt-get install -y chromium``; CI runs that line). Each page is rendered twice: with
``--dump-dom`` after a small probe script (added to a copy of the page) has measured
the layout, and with ``--screenshot``; the PNG must exist, have plausible size and not
be blank. A fresh ``--user-data-dir`` per run, and no network.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from repo_paths import HELPERS

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

from amped.cli.main import main
from amped.doctor import diagnose

pytestmark = pytest.mark.xdist_group("browser")  # one worker builds the report

Image = pytest.importorskip("PIL.Image")

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (see README: Tests)")
WIDTH = 1024  # a laptop's browser window: nothing may need a horizontal scroll bar

# Appended to a copy of the page: records the layout in the DOM that --dump-dom prints.
_PROBE = """<script>
const wide = [...document.querySelectorAll('body *')].filter(
  e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1);
const images = [...document.images].map(i => i.naturalWidth > 0 && i.complete);
document.body.setAttribute('data-probe', JSON.stringify({
  scrollWidth: document.documentElement.scrollWidth,
  clientWidth: document.documentElement.clientWidth,
  cutOff: wide.map(e => e.tagName + '.' + e.className).slice(0, 5),
  images: images}));
</script>"""


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--hide-scrollbars", f"--user-data-dir={profile}",
    ]  # fmt: skip
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


def _render(page: Path, tmp: Path, height: int) -> tuple[str, dict, Path]:
    """The page's DOM text, the layout probe's record, and a screenshot."""
    probed = tmp / f"probed-{page.name}"
    probed.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    dom = _chromium(f"--window-size={WIDTH},{height}", "--dump-dom", probed.as_uri(),
                    profile=tmp / "profile-dom").stdout  # fmt: skip
    found = re.search(r"data-probe=\"([^\"]*)\"", dom)
    assert found, dom[-2000:]
    probe = json.loads(found.group(1).replace("&quot;", '"'))
    shot = tmp / f"{page.stem}.png"
    _chromium(f"--window-size={WIDTH},{height}", f"--screenshot={shot}", page.as_uri(),
              profile=tmp / "profile-shot")  # fmt: skip
    return dom, probe, shot


def _check_picture(shot: Path, height: int) -> None:
    assert shot.exists() and shot.stat().st_size > 20_000, "no screenshot, or a tiny one"
    picture = Image.open(shot).convert("L")
    assert picture.size == (WIDTH, height)
    histogram = picture.histogram()
    non_white = sum(histogram[:250]) / (picture.width * picture.height)
    assert non_white > 0.03, "the screenshot is (almost) blank"
    assert sum(1 for count in histogram if count) > 50  # text and plots: many grey levels


def _check_layout(probe: dict) -> None:
    assert probe["scrollWidth"] <= probe["clientWidth"], probe  # no horizontal scrolling
    assert probe["cutOff"] == [], probe  # no element reaches past the window's edge
    assert probe["images"] and all(probe["images"]), probe  # every plot decoded


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    args = ["compare", "--model", f"{HELPERS / 'cli_factories.py'}:good", "--recipes",
            "fp32,bf16,fp16,fp16-master", "--steps", "12", "--max-time", "0", "--threads", "1",
            "--peak-memory", "in-process", "--no-progress", "--out", str(out),
            "--json"]  # fmt: skip
    with redirect_stdout(io.StringIO()):
        assert main(args) == 0
    return out / "report.html"


@pytest.mark.slow
def test_report_renders_readable_and_whole(report, tmp_path):
    dom, probe, shot = _render(report, tmp_path, 4200)
    _check_layout(probe)
    _check_picture(shot, 4200)
    text = re.sub(r"<[^>]+>", " ", dom)
    for needed in ("What mixed precision buys", "Speed and memory", "IQR", "range",
                   "curves coincide", "Environment", "threads chosen by"):  # fmt: skip
        assert needed in text or needed in dom, needed
    results = json.loads((report.parent / "results.json").read_text())
    for recipe in results["recipes"]:
        assert f'<td class="recipe">{recipe["name"]}</td>' in dom
    environment = dom[dom.index("<h2>Environment</h2>") :]
    assert "None" not in environment and "['" not in environment  # no list repr, no None
    assert "fp32, bf16-mixed, fp16-mixed, fp16-master" in environment


@pytest.mark.slow
def test_doctor_report_renders_readable_and_whole(tmp_path):
    import doctor_models

    model, x, _, _ = doctor_models.norm_variance_overflow()
    report = diagnose(model, x, lambda out: out.float().mean(), dtype=torch.float16)
    page = report.save_html(tmp_path / "doctor.html")
    dom, probe, shot = _render(page, tmp_path, 2400)
    _check_layout(probe)
    _check_picture(shot, 2400)
    text = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
    assert "pow" in text and "norm" in text and "suggestion" in text.lower()


@pytest.mark.slow
def test_tune_report_renders_readable_and_whole(tmp_path):
    """The widest tune.html: six formats and a long transformers-style layer name."""
    import tune_fixture

    from amped.cli.tune.report import write_report

    tuned = tune_fixture.six_formats()
    context = {"task": "tiny-gpt", "device": "cpu", "created": "now", "command": ["amped", "tune"]}
    _, page = write_report(tuned, context, tmp_path)
    dom, probe, shot = _render(page, tmp_path, 2600)
    _check_layout(probe)
    _check_picture(shot, 2600)
    text = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
    assert "Verification passed" in text and "fp8-rowwise-gw-hp" in text
    assert tune_fixture.LONG_NAME in text
