"""The run report in a real browser: headless Chromium (Debian's `chromium`) loads the report of the
demo with no console errors and no request beyond the file itself (the network is blocked), every
plotly figure holds traces and draws them, the page fits a laptop's width, and neither the page's
screenshot nor any figure's is blank. The last tests prove the checks can fail (a thrown error, a
figure div without a plot, a missing plotly.js, an empty figure, a blank page, a remote image or
stylesheet).

The report is the demo's: `tomlens/runs/demo.toml`, run as `tomlens run` runs it (`run_file`),
with `--set` overrides that only shrink it so it runs in seconds: a tiny random model, fewer
stories, resamples, permutations, folds and regularisation strengths. The stages, sites, targets and figures are the demo's.
On the embedded model the demo's patching gate passes and its per-head figures are drawn; on a tiny
random model the gate fails, so `patching.force = true` runs the patching anyway (flagged as forced
in the page) to put those figures on the page too: the page has every kind of figure the demo's has.

Skips (with the reason) only where no Chromium is found: tests never install one (`.ci/run` does).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest
from browser import _PLOTS_JS, Browser, Page, colours, find_browser

DEMO = Path(__file__).resolve().parents[1] / "tomlens" / "runs" / "demo.toml"
SMALL = ["model.name=tiny-llama",
         'behaviour.stimuli=[{family="unexpected-transfer",n=2},{family="order-only",n=2},'
         '{family="motomqa",n=1,options={conditions=["simplified/true-first","simplified/false-first"]}},'
         '{family="kosoy",n=1},{family="indirect-request",n=2},{family="scalar-implicature",n=1}]',
         "behaviour.n_boot=50", "probes.stimuli.n=6", "probes.n_boot=20", "probes.n_permutations=50",
         "probes.c_grid=[1.0]", "probes.folds=2", "probes.inner_folds=2", "patching.force=true"]
MIN_COLOURS = 16  # a page of text and plots has hundreds (anti-aliasing); a blank one has 1
MAX_HEIGHT = 5000  # px at a 1400 px window: the findings, the figures and the collapsed tables, not 16,000


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    exe, why = find_browser(install=False)
    if exe is None:
        pytest.skip(f"no headless Chromium for the browser test: {why}")
    with Browser(exe) as browser:
        yield browser


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tomlens.cli.run import run_file
    from tomlens.runs.experiment import ExperimentConfig

    out = tmp_path_factory.mktemp("demo")
    # the activations stay in the test's folder, as `tomlens demo` keeps them in <out>/activations
    run_file(ExperimentConfig.load(DEMO, [*SMALL, f"probes.store='{out / 'activations'}'"]), out, progress=False)
    return out / "report.html"


def _explain(page: Page) -> str:
    return (f"errors {page.errors}; plots {page.plots}; data {page.data}; traces {page.traces}; "
            f"remote requests {page.remote_requests}; console {page.messages[:10]}")


def _rendered(page: Page) -> list[str]:
    """The figures that failed to render: no SVG root, no trace in plotly's data, no trace drawn, or a
    blank screenshot of the figure."""
    return [d for d in page.plots if not (page.plots[d] >= 1 and page.data.get(d, 0) > 0 and page.traces.get(d, 0) > 0
                                          and d in page.figure_pngs and colours(page.figure_pngs[d]) > MIN_COLOURS)]


def test_demo_report_renders_in_chromium_without_errors(chromium, demo_report):
    text = demo_report.read_text()
    # the order a reader needs: findings, figures (each with its reading guide), tables, provenance
    marks = [text.index("<h2 id='findings'>"), text.index("<h2 id='figures'>"), text.index("<table"),
             text.index("<h2 id='provenance'>")]
    assert marks == sorted(marks)
    assert "<script src=" not in text and text.count("<script>") >= 1  # plotly inline: opens offline
    n_figures = text.count('class="plotly-graph-div"')
    guides = re.findall(r"<figcaption class='guide'>([^<]+)</figcaption>", text)
    assert n_figures >= 4 and len(guides) == n_figures and all(len(g) > 40 for g in guides)
    assert text.count("class='finding ") >= 3 and "probes</span> whether protagonist belief" in text
    # the forced patching run's per-head figures are flagged, never under a result's heading
    assert "<h3>Patching (forced past its gate: not a result)</h3>" in text
    assert "Patching: heads that carry belief" not in text
    assert any(g.startswith("FORCED past a failed gate, not a result: ") for g in guides)

    page = chromium.load(demo_report, width=1280)
    assert page.errors == [], _explain(page)
    assert page.requests and page.remote_requests == [], _explain(page)
    assert len(page.plots) == n_figures and _rendered(page) == [], _explain(page)
    assert page.scroll_width <= 1280, f"the page is {page.scroll_width} px wide at a 1280 px window"
    assert colours(page.png) > MIN_COLOURS, "the screenshot at 1280 px is blank"


def page_height(browser: Browser, path: Path, width: int = 1400, settle_s: float = 15.0) -> int:
    """The rendered page's height in CSS pixels at `width`, once every figure has drawn (the height
    stops changing), with every <details> closed as the page ships."""
    import json
    import time

    pipe = browser._pipe
    target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    try:
        pipe.send("Page.enable", session=session)
        pipe.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        pipe.events.clear()
        pipe.send("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
        assert pipe.wait_event("Page.loadEventFired", 60), f"{path} did not load"

        def height() -> int:
            r = pipe.send("Runtime.evaluate", {"expression": "JSON.stringify(document.documentElement.scrollHeight)",
                                               "returnByValue": True}, session=session)
            return int(json.loads(r["result"]["value"]))

        def drawn() -> bool:
            r = pipe.send("Runtime.evaluate", {"expression": _PLOTS_JS, "returnByValue": True}, session=session)
            return all(json.loads(r["result"]["value"]).values())

        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and not drawn():
            time.sleep(0.2)
        seen = [height()]
        while time.monotonic() < deadline and not (len(seen) >= 6 and len(set(seen[-6:])) == 1):
            time.sleep(0.3)
            seen.append(height())
        return seen[-1]
    finally:
        pipe.send("Target.closeTarget", {"targetId": target})


def test_demo_report_is_short_enough_to_read(chromium, demo_report):
    """The demo's page (behaviour with the seed papers' batteries, probes, forced patching) stays under
    MAX_HEIGHT at 1400 px: its long tables are behind <details>, each battery one line."""
    text = demo_report.read_text()
    assert text.count("<details>") >= 6 and "<details open" not in text
    assert re.search(r"<summary>motomqa \(Street et al\.", text) and re.search(r"<summary>kosoy \(Kosoy", text)
    height = page_height(chromium, demo_report)
    assert height < MAX_HEIGHT, f"the report is {height} px tall at 1400 px wide (limit {MAX_HEIGHT})"


def test_the_height_check_fails_on_a_long_open_table(chromium, tmp_path):
    from tomlens.report.html import Section, write_report

    long = [pd.DataFrame({"row": range(60), "value": [0.5] * 60})] * 6  # a page shows 60 rows of each table
    path = write_report(tmp_path / "report.html", "long", [Section("Long", "every row open", long)])
    assert page_height(chromium, path) > MAX_HEIGHT
    folded = write_report(tmp_path / "folded.html", "folded", [Section("Long", collapsed=[("360 rows", long)])])
    assert page_height(chromium, folded) < 1000


def test_demo_report_reads_at_800_px(chromium, demo_report):
    page = chromium.load(demo_report, width=800)
    assert page.errors == [], _explain(page)
    assert page.plots and _rendered(page) == [], _explain(page)
    assert page.scroll_width <= 800, f"the page is {page.scroll_width} px wide at an 800 px window"


FAMILY = Path(__file__).resolve().parents[1] / "examples" / "family-study.toml"


def test_family_study_comparison_renders_in_chromium(chromium, tmp_path):
    """The example family study's comparison (`examples/family-study.toml`, its stages as written,
    shrunk to seconds on two tiny models of different depths, as `tomlens study` would leave them)
    leads with its findings and passes the same browser checks as the run report."""
    from tomlens.report.compare import write_compare_report
    from tomlens.runs.compare import compare_runs
    from tomlens.runs.experiment import ExperimentConfig, run_experiment

    config = ExperimentConfig.load(FAMILY, [
        'models=[{name="tiny-llama"},{name="tom-organism"}]', "behaviour.n_boot=50",
        *(f"behaviour.stimuli.{i}.n=1" for i in range(3)), "probes.stimuli.n=6", "probes.n_boot=20",
        "probes.c_grid=[1.0]", "probes.folds=2", "probes.inner_folds=2", "probes.n_permutations=50", "pairs.n=2",
        "patching.n_random=5", f"probes.store='{tmp_path / 'store'}'"])
    run_experiment(config, tmp_path / "run", progress=False)
    path = write_compare_report(compare_runs([tmp_path / "run"]), tmp_path / "compare")
    text = path.read_text()
    assert text.index("<h2 id='findings'>") < text.index("<h2 id='figures'>") < text.index("<h2 id='provenance'>")
    page = chromium.load(path, width=1280)
    assert page.errors == [], _explain(page)
    assert page.requests and page.remote_requests == [], _explain(page)
    assert page.plots and _rendered(page) == [], _explain(page)
    assert page.scroll_width <= 1280 and colours(page.png) > MIN_COLOURS


def _small_report(tmp_path: Path) -> Path:
    from tomlens.report.html import Section, write_report

    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[0.5, 0.7, 0.9], name="probe"))
    return write_report(tmp_path / "report.html", "small",
                        [Section("Probes", "accuracy per layer", [pd.DataFrame({"layer": [0, 1]})], [fig],
                                 ["the line is the probe's accuracy per layer"])])


def test_the_console_check_fails_on_a_thrown_error(chromium, tmp_path):
    path = _small_report(tmp_path)
    clean = chromium.load(path)
    assert clean.errors == [] and len(clean.plots) == 1 and _rendered(clean) == [], _explain(clean)
    path.write_text(path.read_text().replace("</body>", "<script>throw new Error('injected failure')</script></body>"))
    page = chromium.load(path)
    assert any("injected failure" in e for e in page.errors), _explain(page)


def test_the_render_check_fails_on_a_figure_div_without_a_plot(chromium, tmp_path):
    path = _small_report(tmp_path)
    path.write_text(path.read_text().replace("</body>", "<div class='plotly-graph-div' id='no-plot'></div></body>"))
    page = chromium.load(path, settle_s=2)
    assert page.plots["no-plot"] == 0 and _rendered(page) == ["no-plot"], _explain(page)
    # without plotly.js no figure renders, and the page says why in its console
    text = re.sub(r"<script>.*?</script>", "", _small_report(tmp_path).read_text(), count=1, flags=re.S)
    path.write_text(text)
    page = chromium.load(path, settle_s=2)
    assert page.plots and not any(page.plots.values()) and any("Plotly" in e for e in page.errors), _explain(page)
    assert _rendered(page) == list(page.plots), _explain(page)


def test_the_trace_check_fails_on_an_empty_figure(chromium, tmp_path):
    """A figure with axes and a title but no trace renders SVG (so counting SVG roots passes it) and
    is not blank: only plotly's data and the drawn trace nodes tell it apart."""
    from tomlens.report.html import Section, write_report

    empty = go.Figure(layout={"title": "no data", "xaxis": {"title": "layer"}, "yaxis": {"title": "accuracy"}})
    path = write_report(tmp_path / "report.html", "empty", [Section("Empty", figures=[empty], guides=["nothing here"])])
    page = chromium.load(path, settle_s=2)
    [div] = page.plots
    assert page.plots[div] >= 1 and page.data[div] == 0 and page.traces[div] == 0, _explain(page)
    assert _rendered(page) == [div]


def test_the_network_check_fails_on_a_remote_image_or_stylesheet(chromium, tmp_path):
    path = _small_report(tmp_path)
    clean = chromium.load(path)
    assert clean.requests and clean.remote_requests == [], _explain(clean)
    path.write_text(path.read_text().replace(
        "</body>", "<link rel='stylesheet' href='https://cdn.example.org/style.css'>"
                   "<img src='http://images.example.org/x.png' alt=''></body>"))
    page = chromium.load(path, settle_s=2)
    assert sorted(page.remote_requests) == ["http://images.example.org/x.png",
                                            "https://cdn.example.org/style.css"], _explain(page)


def test_the_screenshot_check_fails_on_a_blank_page(chromium, tmp_path):
    path = tmp_path / "blank.html"
    path.write_text("<!doctype html><html><body></body></html>")
    page = chromium.load(path)
    assert page.errors == [] and page.plots == {} and colours(page.png) == 1 and page.figure_pngs == {}


def test_finding_a_browser_never_installs_one(monkeypatch):
    """Tests must not run apt-get (only .ci/run installs Chromium): with none on PATH, `find_browser`
    says why and how to get one, and runs nothing."""
    import subprocess

    import browser

    def refuse(*args, **kwargs):
        raise AssertionError(f"find_browser ran {args}")

    monkeypatch.delenv("TOMLENS_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(subprocess, "run", refuse)
    exe, why = find_browser(install=False)
    assert exe is None and "not installed by tests" in why and ".ci/run" in why
    assert browser.find_browser() == (None, why)  # the default installs nothing either
