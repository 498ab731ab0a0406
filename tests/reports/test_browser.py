"""Open a report of a tiny-model run in headless Chromium (Chrome DevTools Protocol) and check the DOM:
every section is there, no request leaves the file, no console error; save a screenshot.

Skipped only where no Chromium can be found (Debian: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvprobe.reports.html import render_report

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "reports"  # outputs only; *.png is gitignored
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
from tests.reports.test_render import ALL as SECTIONS  # noqa: E402  (the sections a tiny run has)
LOCAL_SCHEMES = ("file:", "data:", "about:")


def find_browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class CDP:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, url: str):
        import websocket  # websocket-client, in the test extra

        self.ws = websocket.create_connection(url, timeout=60, suppress_origin=True)
        self.events: list[dict] = []
        self.n = 0

    def send(self, method: str, **params) -> dict:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            hit = next((e for e in self.events if e.get("method") == method), None)
            if hit:
                return hit
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout} s")
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            self.events.append(json.loads(self.ws.recv()))

    def drain(self, seconds: float) -> None:
        """Collect events for a while (late requests or errors)."""
        import websocket

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                self.events.append(json.loads(self.ws.recv()))
            except websocket.WebSocketTimeoutException:
                break

    def js(self, expression: str):
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(res["exceptionDetails"])
        return res["result"].get("value")

    def of(self, method: str) -> list[dict]:
        return [e["params"] for e in self.events if e.get("method") == method]


def install_chromium() -> str | None:
    """Install Debian's chromium when we are root with apt (CI's fresh machines); None otherwise."""
    import os

    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
            return None
    return find_browser()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = find_browser() or install_chromium()
    if exe is None:
        pytest.skip("no Chromium found and Debian's chromium package could not be installed here")
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-allow-origins=*", "--window-size=1400,1800", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Chromium did not start (exit {proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:  # the local debugger
            page = next(t for t in json.load(r) if t["type"] == "page")
        yield CDP(page["webSocketDebuggerUrl"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def opened(browser, tiny_results, tmp_path_factory):
    """The tiny run's report, loaded in the page with network, console and log events recorded."""
    out = render_report([tiny_results], tmp_path_factory.mktemp("report") / "report.html")
    cdp = browser
    for domain in ("Page", "Network", "Runtime", "Log"):
        cdp.send(f"{domain}.enable")
    cdp.send("Emulation.setDeviceMetricsOverride", width=1400, height=1800, deviceScaleFactor=1, mobile=False)
    cdp.send("Page.navigate", url=out.as_uri())
    cdp.wait_for("Page.loadEventFired")
    cdp.js("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    cdp.drain(1.0)
    return cdp, out


def test_every_section_in_the_dom(opened):
    cdp, _ = opened
    ids = cdp.js("[...document.querySelectorAll('section.section')].map(s => s.id)")
    assert ids == SECTIONS
    for sid in SECTIONS:
        info = cdp.js(f"(() => {{ const s = document.getElementById('{sid}'); return {{"
                      f"h2: s.querySelector('h2').textContent, cols: s.querySelectorAll('.col').length,"
                      f"height: s.getBoundingClientRect().height}}; }})()")
        assert info["h2"] and info["cols"] == 1 and info["height"] > 50, (sid, info)
    notes = cdp.js("(() => ({tokens: document.querySelectorAll('#notes .tok').length,"
                   "field: document.querySelectorAll('#notes .tok.field').length,"
                   "decision: document.querySelectorAll('#notes .tok.decision').length,"
                   "coloured: [...document.querySelectorAll('#notes .tok')].filter(t => t.style.background &&"
                   " t.style.background !== 'transparent').length}))()")
    assert notes["tokens"] > 50 and notes["field"] >= 1 and notes["decision"] >= 1 and notes["coloured"] > 10, notes
    # every figure decoded (an SVG that failed to parse has no natural size)
    imgs = cdp.js("[...document.images].map(i => [i.complete, i.naturalWidth, i.alt])")
    assert len(imgs) >= 6 and all(ok and w > 0 for ok, w, _ in imgs), imgs


def test_no_console_errors(opened):
    cdp, _ = opened
    # runs before test_no_request_leaves_the_file's deliberate failed fetch (filtered anyway)
    errors = [p for p in cdp.of("Runtime.consoleAPICalled") if p["type"] in ("error", "assert")]
    errors += cdp.of("Runtime.exceptionThrown")
    errors += [p for p in cdp.of("Log.entryAdded") if p["entry"]["level"] == "error"
               and "kvprobe-probe" not in p["entry"].get("url", "") + p["entry"].get("text", "")]
    assert errors == []


def test_no_request_leaves_the_file(opened):
    cdp, out = opened
    urls = [p["request"]["url"] for p in cdp.of("Network.requestWillBeSent")]
    assert urls and urls[0] == out.as_uri()
    outside = [u for u in urls if not u.startswith(LOCAL_SCHEMES)]
    assert outside == []
    assert [u for u in urls if u.startswith("file:")] == [out.as_uri()]
    # the recorder does see a request that leaves (so the empty list above means something)
    cdp.js("fetch('http://127.0.0.1:9/kvprobe-probe').catch(() => 0)")
    cdp.drain(1.0)
    assert "http://127.0.0.1:9/kvprobe-probe" in [p["request"]["url"] for p in cdp.of("Network.requestWillBeSent")]


def test_screenshot(opened, tmp_path):
    cdp, _ = opened
    box = cdp.js("(() => { const r = document.getElementById('notes').getBoundingClientRect();"
                 " return [r.x, r.y + window.scrollY, r.width, r.height]; })()")
    height = min(2400, box[1] + box[3])
    shot = cdp.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                    clip={"x": 0, "y": 0, "width": 1400, "height": height, "scale": 1})
    png = base64.b64decode(shot["data"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    path = tmp_path / "report-notes.png"
    path.write_bytes(png)
    SHOTS.mkdir(exist_ok=True)
    shutil.copy(path, SHOTS / "report-notes.png")


def test_wide_tables_stay_in_their_column(browser, variant):
    """With many models side by side a table can be wider than its column: it must scroll inside
    the column, not spill over the next model's figures."""
    folders = [variant(f"m{i}") for i in range(6)]
    out = render_report(folders, folders[0].parent / "wide.html")
    cdp = browser
    cdp.send("Page.enable")
    cdp.send("Emulation.setDeviceMetricsOverride", width=1400, height=1800, deviceScaleFactor=1, mobile=False)
    cdp.events.clear()  # wait for this page's load, not the earlier report's
    cdp.send("Page.navigate", url=out.as_uri())
    cdp.wait_for("Page.loadEventFired")
    assert cdp.js("location.href") == out.as_uri()
    cols = cdp.js("[...document.querySelectorAll('.col')].map(c => [c.closest('section').id, c.scrollWidth,"
                  " c.clientWidth, getComputedStyle(c).overflowX])")
    assert len(cols) >= 6 * len(SECTIONS) - 6
    wide = [c for c in cols if c[1] > c[2] + 1]
    assert wide, "no table is wider than its column at this size, so the check would not mean anything"
    assert all(c[3] in ("auto", "scroll", "hidden") for c in wide), [c for c in wide if c[3] == "visible"]
