"""Open a report of a tiny-model run in the system Chromium, driven by Playwright, and check what a
reader sees:

- the first section is the headline, then every section the tiny run has, each with a heading and a
  height, and every figure decoded;
- no request leaves the file (every URL is file:, data: or about:, and the only file: URL is the
  report), with a positive control that the recorder does see a request that leaves;
- no console error and no uncaught exception;
- full-page screenshots at 1400 and 600 px wide, saved as reports/report-<width>.png (gitignored),
  and at 600 px nothing sticks out sideways beyond the page;
- with six models side by side, a table wider than its column scrolls inside the column.

The browser is Debian's chromium, installed by the apt step of the README's test command (.ci/run);
no test installs anything, and where no Chromium is found every browser test fails (it does not skip).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from kvprobe.reports.html import render_report
from tests.reports.test_render import ALL as SECTIONS  # the sections a tiny run has

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "reports"  # outputs only; *.png is gitignored
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
APT_STEP = "apt-get install -y -qq chromium"  # the install step of .ci/run (a test below keeps it so)
LOCAL_SCHEMES = ("file:", "data:", "about:")
PROBE = "http://127.0.0.1:9/kvprobe-probe"  # port 9 (discard): refused at once, never reaches anything
WIDE, NARROW = 1400, 600
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# the outermost elements that stick out to the right of the viewport (those inside a scrolling or
# clipping box do not widen the page), for the message of a failed overflow check
STICKING_OUT = """() => [...document.body.querySelectorAll('*')].filter(e => {
    if (e.getBoundingClientRect().right <= innerWidth + 1) return false;
    for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
        if (getComputedStyle(a).overflowX !== 'visible') return false;
    const p = e.parentElement;
    return !p || p === document.body || p.getBoundingClientRect().right <= innerWidth + 1;
}).slice(0, 8).map(e => `${e.tagName.toLowerCase()}${e.id ? '#' + e.id : ''}`
    + `${typeof e.className === 'string' && e.className ? '.' + e.className.trim().split(/\\s+/).join('.') : ''}`
    + ` in #${e.closest('section')?.id ?? '-'}: right edge ${Math.round(e.getBoundingClientRect().right)} px`)"""


def find_browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


@dataclass
class Loaded:
    """A report open in a page, with every request, console error and uncaught exception recorded."""

    page: object  # playwright.sync_api.Page
    url: str
    requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)


def load(browser, report: Path, width: int) -> Loaded:
    page = browser.new_page(viewport={"width": width, "height": 1800}, device_scale_factor=1)
    page.set_default_timeout(60_000)
    seen = Loaded(page, report.as_uri())

    def console(msg):
        if msg.type == "error":
            seen.console_errors.append(f"{msg.text} (at {msg.location.get('url', '?')})")

    page.on("request", lambda r: seen.requests.append(r.url))
    page.on("console", console)
    page.on("pageerror", lambda e: seen.page_errors.append(str(e)))
    page.goto(seen.url, wait_until="load")
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    return seen


@pytest.fixture(scope="module")
def browser():
    exe = find_browser()
    if exe is None:
        pytest.fail(f"no Chromium found ({', '.join(BROWSERS)} on PATH): install Debian's chromium with the "
                    f"apt step of .ci/run ({APT_STEP})", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def report(tiny_results, tmp_path_factory) -> Path:
    return render_report([tiny_results], tmp_path_factory.mktemp("report") / "report.html")


@pytest.fixture(scope="module")
def opened(browser, report):
    """The tiny run's report at 1400 px wide."""
    seen = load(browser, report, WIDE)
    yield seen
    seen.page.close()


def section_ids(page) -> list[str]:
    return page.evaluate("() => [...document.querySelectorAll('section.section')].map(s => s.id)")


def test_headline_comes_first(opened):
    ids = section_ids(opened.page)
    assert ids and ids[0] == "headline", ids


def test_every_section_in_the_dom(opened):
    page = opened.page
    assert section_ids(page) == SECTIONS
    boxes = page.evaluate("() => [...document.querySelectorAll('section.section')].map(s => ({id: s.id,"
                          " h2: s.querySelector('h2')?.textContent.trim() ?? '',"
                          " height: s.getBoundingClientRect().height}))")
    assert [b for b in boxes if not b["h2"] or b["height"] <= 0] == []
    notes = page.evaluate("() => ({tokens: document.querySelectorAll('#notes .tok').length,"
                          " field: document.querySelectorAll('#notes .tok.field').length,"
                          " decision: document.querySelectorAll('#notes .tok.decision').length,"
                          " coloured: [...document.querySelectorAll('#notes .tok')].filter(t => t.style.background"
                          " && t.style.background !== 'transparent').length})")
    assert notes["tokens"] > 50 and notes["field"] >= 1 and notes["decision"] >= 1 and notes["coloured"] > 10, notes


def test_every_figure_decoded(opened):
    # an SVG that failed to parse has no natural size
    imgs = opened.page.evaluate("() => [...document.images].map(i => [i.complete, i.naturalWidth, i.alt])")
    assert len(imgs) >= 6
    assert [i for i in imgs if not (i[0] and i[1] > 0)] == []


def test_no_console_errors(opened):
    errors = [e for e in opened.console_errors if "kvprobe-probe" not in e]  # the probe fetch below fails
    assert errors == []
    assert opened.page_errors == []


def test_no_request_leaves_the_file(opened):
    urls = list(opened.requests)
    assert urls and urls[0] == opened.url
    assert [u for u in urls if not u.startswith(LOCAL_SCHEMES)] == []
    assert [u for u in urls if u.startswith("file:")] == [opened.url]
    # the recorder does see a request that leaves (so the empty list above means something)
    opened.page.evaluate(f"() => fetch('{PROBE}').catch(() => 0)")
    for _ in range(20):
        if PROBE in opened.requests:
            break
        opened.page.wait_for_timeout(100)
    assert PROBE in opened.requests


@pytest.mark.parametrize("width", [WIDE, NARROW])
def test_full_page_screenshot(browser, report, width):
    seen = load(browser, report, width)
    try:
        SHOTS.mkdir(exist_ok=True)
        path = SHOTS / f"report-{width}.png"
        png = seen.page.screenshot(path=path, full_page=True, type="png")
        scroll_width, inner_width = seen.page.evaluate(
            "() => [document.documentElement.scrollWidth, window.innerWidth]")
        sticking_out = seen.page.evaluate(STICKING_OUT)
    finally:
        seen.page.close()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    assert path.read_bytes() == png
    if width == NARROW:  # a phone-sized window: the page must not scroll sideways
        assert scroll_width <= inner_width + 1, (scroll_width, inner_width, sticking_out)


def test_wide_tables_stay_in_their_column(browser, variant):
    """With many models side by side a table can be wider than its column: it must scroll inside
    the column, not spill over the next model's figures."""
    folders = [variant(f"m{i}") for i in range(6)]
    seen = load(browser, render_report(folders, folders[0].parent / "wide.html"), WIDE)
    try:
        cols = seen.page.evaluate("() => [...document.querySelectorAll('.col')].map(c => [c.closest('section').id,"
                                  " c.scrollWidth, c.clientWidth, getComputedStyle(c).overflowX])")
    finally:
        seen.page.close()
    assert len(cols) >= 6 * len(SECTIONS) - 6
    wide = [c for c in cols if c[1] > c[2] + 1]
    assert wide, "no table is wider than its column at this size, so the check would not mean anything"
    assert [c for c in wide if c[3] not in ("auto", "scroll", "hidden")] == []


def test_the_missing_browser_message_names_the_ci_step():
    assert APT_STEP in (REPO / ".ci" / "run").read_text()
