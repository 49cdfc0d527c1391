"""Browser tests: a real JupyterLab server (a child process, stopped by pid) in a fresh
PSCLUSTER_HOME, driven by playwright in Debian's headless chromium."""

import os
import time
from pathlib import Path

import pytest

from .lab import CHROMIUM, LabServer, launch_chromium

FAILURES = Path(__file__).resolve().parents[2] / "reports"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """PSCLUSTER_HOME of the server and of the clusters this module starts."""
    path = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSCLUSTER_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def lab(home, tmp_path_factory):
    """A JupyterLab server with the pscluster extensions; its files are under ``lab.root / "files"``."""
    server = LabServer(tmp_path_factory.mktemp("lab"))
    (server.root / "files").mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_report = report
    return report


@pytest.fixture
def page(browser, lab, request):
    """A page of the lab. When the test fails, a screenshot of the page goes to ``reports/<test name>.png`` and
    the browser console's errors and warnings to the test's report."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    console = []
    page.on("console", lambda m: console.append(f"{time.strftime('%H:%M:%S')} {m.type}: {m.text[:500]}")
            if m.type in ("error", "warning") else None)
    page.goto(f"{lab.url}/lab?reset&token={lab.token}")
    page.locator(".jp-LauncherCard").first.wait_for(timeout=60_000)
    yield page
    if getattr(request.node, "call_report", None) is not None and request.node.call_report.failed:
        print("browser console, errors and warnings:", *console[-100:], sep="\n")
        FAILURES.mkdir(exist_ok=True)
        page.screenshot(path=str(FAILURES / f"{request.node.name}.png"))
    context.close()
