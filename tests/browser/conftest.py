"""Browser tests: a real JupyterLab server (a child process, stopped by pid) in a fresh
PSCLUSTER_HOME, driven by playwright in Debian's headless chromium."""

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlparse

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """PSCLUSTER_HOME of the server and of the clusters this module starts."""
    path = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSCLUSTER_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def lab(home, tmp_path_factory):
    """The base URL (with its token) of a JupyterLab server with the pscluster extensions."""
    root = tmp_path_factory.mktemp("lab")
    port, token = _free_port(), secrets.token_hex(16)
    news = root / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no news toast over the page
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
         f"--LabApp.user_settings_dir={root / 'settings'}", f"--LabApp.workspaces_dir={root / 'workspaces'}"],
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(root / "config"), "JUPYTER_RUNTIME_DIR": str(root / "runtime")},
        stdout=open(root / "server.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not start: see {root / 'server.log'}") from None
                time.sleep(0.3)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, lab):
    """A page of the lab, with every request to anywhere but the server aborted (pages try CDNs)."""
    base, token = lab
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    local = urlparse(base).netloc
    context.route("**/*", lambda route: route.continue_() if urlparse(route.request.url).netloc == local
                  else route.abort())
    page = context.new_page()
    page.goto(f"{base}/lab?reset&token={token}")
    page.locator(".jp-LauncherCard").first.wait_for(timeout=60_000)
    yield page
    context.close()
