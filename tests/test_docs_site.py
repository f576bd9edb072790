"""The docs site in a real browser: built with ``mkdocs build --strict``, served on 127.0.0.1 and
loaded in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which ``.ci/run``
installs). The home page, the API reference of ``GenerationInterface`` and a guide load, show
what they are about, log no browser error, and every link on them leads to a page that loads
(and, for a link with an anchor, to an element with that id). Screenshots of each go to
``GEN_DOCS_SCREENSHOTS`` when set (else the test's temporary directory).

    uv run pytest tests/test_docs_site.py                              # builds the site first
    GEN_DOCS_SCREENSHOTS=shots uv run pytest tests/test_docs_site.py   # and keeps the pictures
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Debian's Chromium, else a Chrome (as CI images ship it, with its driver in CHROMEWEBDRIVER).
CHROMIUM = shutil.which("chromium") or shutil.which("google-chrome") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or str(
    Path(os.environ.get("CHROMEWEBDRIVER", "/usr/bin")) / "chromedriver"
)

#: (path on the site, text its main heading holds, an element id that must be on it)
PAGES = [
    ("", "gen: the generation layer", "the-two-commands"),
    (
        "reference/gen_interface/#gen_interface.GenerationInterface",
        "gen_interface",
        "gen_interface.GenerationInterface",
    ),
    ("concepts/weights/", "Weight versions and transactions", "a-refit-is-one-transaction"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site, built strictly (or the one ``GEN_DOCS_SITE`` names, built so by ``.ci/run``),
    served on 127.0.0.1; its base URL."""
    pytest.importorskip("mkdocs")
    if os.environ.get("GEN_DOCS_SITE"):
        out = Path(os.environ["GEN_DOCS_SITE"]).resolve()
        assert (out / "index.html").exists(), f"GEN_DOCS_SITE={out} holds no built site"
    else:
        out = tmp_path_factory.mktemp("site")
        built = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
            timeout=600,
        )
        assert built.returncode == 0, built.stdout + built.stderr
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium through chromedriver, with a fresh profile and no network of its own."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        message = (
            "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{message}; .ci/run installs them")
        pytest.skip(message)
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: download nothing
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.parametrize(("path", "heading", "element"), PAGES)
def test_a_page_loads_and_every_link_on_it_works(
    site: str, browser: Any, tmp_path: Path, path: str, heading: str, element: str
):
    from selenium.webdriver.common.by import By

    url = urljoin(site, path)
    browser.get(url)
    assert browser.execute_script("return document.readyState") == "complete"
    assert heading in browser.find_element(By.CSS_SELECTOR, "article h1").text
    assert browser.find_elements(By.ID, element), f"{url} has no element #{element}"
    shots = Path(os.environ.get("GEN_DOCS_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(
        str(shots / f"{path.split('#')[0].strip('/').replace('/', '-') or 'home'}.png")
    )
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{url}: the browser logged errors:\n" + "\n".join(errors)
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('a[href]'), a => a.href)"
    )
    assert links, f"{url} has no links"
    broken = [f"{link}: {why}" for link in sorted(set(links)) if (why := _broken(link, site))]
    assert not broken, f"{url} links to what does not load:\n" + "\n".join(broken)


def _broken(link: str, site: str) -> str | None:
    """Why ``link`` does not work, or None; links off the site are not followed (the machines
    this runs on may have no network), only checked to be http(s) or mailto."""
    if not link.startswith(site):
        scheme = urlparse(link).scheme
        return None if scheme in ("http", "https", "mailto") else f"scheme {scheme!r}"
    page, anchor = urldefrag(link)
    loaded = _load(page)
    if isinstance(loaded, str):
        return loaded
    if anchor and anchor not in loaded:
        return f"no element with id {anchor!r}"
    return None


@functools.cache
def _load(page: str) -> frozenset[str] | str:
    """The ids on ``page``, or why it did not load."""
    try:
        with urllib.request.urlopen(page, timeout=30) as response:
            html = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    parser = _Ids()
    parser.feed(html)
    return frozenset(parser.ids)


class _Ids(HTMLParser):
    """Every ``id`` attribute of a page (what an anchor can point at)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass
