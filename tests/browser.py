"""Open a page in Debian's chromium through Playwright (its own browser download cannot reach its
servers here) and read what its audio players decode to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

# Every matching <audio>'s duration once its metadata loaded; a source that cannot decode rejects.
DURATIONS_JS = """selector => Promise.all([...document.querySelectorAll(selector)].map(a => new Promise(
    (ok, bad) => {
        if (a.readyState >= 1) return ok(a.duration);
        a.addEventListener('loadedmetadata', () => ok(a.duration));
        a.addEventListener('error', () => bad(new Error('cannot decode: ' + a.error.code)));
        a.load();
    })))"""


@contextlib.contextmanager
def open_page(path: Path, errors: list[str]) -> Iterator:
    """The page of ``path`` loaded in headless chromium; console errors and page errors go to ``errors``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(path.as_uri())
            yield page
        finally:
            browser.close()


def durations(page, selector: str) -> list[float]:
    """The decoded duration (seconds) of every ``selector`` audio element, in page order."""
    return page.evaluate(DURATIONS_JS, selector)
