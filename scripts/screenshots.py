"""Full-page screenshots of kvprobe HTML reports, taken in the system Chromium through Playwright.

    .venv/bin/python scripts/screenshots.py REPORT.html [REPORT2.html ...] --out DIR [--widths 1400,600]

Opens each report from file:// in a window of each width (1800 px tall; the screenshot covers the
whole page), waits for the load and two frames, and writes DIR/<stem>-<width>.png. Prints one line
per screenshot: its path and the page's height in CSS pixels. Uses the Chromium already on the PATH
(Debian: ``apt-get install -y chromium``, the first step of .ci/run); it never downloads a browser.

Bad input (a report that is missing or not an .html file, a width that is not a positive number, an
output folder that cannot be written, no Chromium or one that does not start, no playwright) prints
one ``error:`` line on stderr and exits 2, before any screenshot is written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
HEIGHT = 1800  # the window's height; a full-page screenshot is as tall as the page


class BadInput(Exception):
    """Input this script refuses: one line for stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage + message, as one line
        raise BadInput(message)


def parse_widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        widths = []
    if not widths or any(w <= 0 for w in widths):
        raise BadInput(f"--widths {text!r} is not a comma-separated list of positive pixel widths")
    return widths


def check_reports(paths: list[str]) -> list[Path]:
    reports = []
    for p in map(Path, paths):
        if not p.exists():
            raise BadInput(f"{p} does not exist")
        if not p.is_file():
            raise BadInput(f"{p} is not a file")
        if p.suffix.lower() != ".html":
            raise BadInput(f"{p} is not an .html report")
        reports.append(p.resolve())
    stems = [r.stem for r in reports]
    if len(set(stems)) < len(stems):
        raise BadInput(f"two reports share a name ({', '.join(sorted({s for s in stems if stems.count(s) > 1}))}): "
                       "their screenshots would overwrite each other")
    return reports


def find_browser() -> str:
    exe = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if exe is None:
        raise BadInput(f"no Chromium found ({', '.join(BROWSERS)} on PATH): install Debian's chromium "
                       "(apt-get install -y chromium)")
    return exe


def writable_folder(out: Path) -> Path:
    """``out``, created if needed, after a real write into it (root ignores file modes)."""
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".screenshots-"):
            pass
    except OSError as exc:
        raise BadInput(f"--out {out} cannot be written ({exc.strerror or exc})") from None
    return out


def screenshots(reports: list[Path], out: Path, widths: list[int], exe: str) -> list[tuple[Path, int]]:
    """Write out/<stem>-<width>.png for each report and width; return (path, page height) pairs."""
    from playwright.sync_api import Error, sync_playwright

    shots = []
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        except Error as exc:
            raise BadInput(f"Chromium at {exe} did not start: {str(exc).splitlines()[0]}") from None
        try:
            for report in reports:
                for width in widths:
                    page = browser.new_page(viewport={"width": width, "height": HEIGHT}, device_scale_factor=1)
                    page.goto(report.as_uri(), wait_until="load", timeout=120_000)
                    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                    height = page.evaluate("() => document.documentElement.scrollHeight")
                    path = out / f"{report.stem}-{width}.png"
                    page.screenshot(path=path, full_page=True, type="png")
                    page.close()
                    print(f"{path}  {height} px", flush=True)
                    shots.append((path, height))
        finally:
            browser.close()
    return shots


def main(argv: list[str] | None = None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", metavar="REPORT.html")
    ap.add_argument("--out", required=True, type=Path, metavar="DIR")
    ap.add_argument("--widths", default="1400,600", help="comma-separated window widths in px (default 1400,600)")
    try:
        args = ap.parse_args(argv)
        widths = parse_widths(args.widths)
        reports = check_reports(args.reports)
        exe = find_browser()
        try:
            import playwright.sync_api  # noqa: F401  (checked before the output folder is made)
        except ImportError:
            raise BadInput("playwright is not installed (pip install -e '.[test]')") from None
        out = writable_folder(args.out)
        screenshots(reports, out, widths, exe)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
