"""Browser tests: a real JupyterLab server (a child process, stopped by pid) in a fresh
PSCLUSTER_HOME, driven by playwright in Debian's headless chromium."""

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

CHROMIUM = "/usr/bin/chromium"
FAILURES = Path(__file__).resolve().parents[2] / "reports"
# Pages try CDNs: every host name but the server's resolves to nothing. (Not a playwright route: its
# handlers run only while the test is inside a playwright call, so a test waiting on anything else would
# hold every request of the page.)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """``jupyter lab`` on 127.0.0.1 in a child process, with a temporary root, settings and runtime
    directory; ``restart()`` stops it and starts a new one on the same port with the same token, as
    a user restarting their server would."""

    def __init__(self, root: Path):
        self.root = root
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        news = root / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        news.parent.mkdir(parents=True)
        news.write_text('{"fetchNews": "false"}')  # no news toast over the page

    def start(self, timeout: float = 90.0) -> None:
        r = self.root
        with open(r / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
                 f"--port={self.port}", "--port-retries=0", f"--ServerApp.token={self.token}",
                 f"--ServerApp.root_dir={r / 'files'}", "--LabApp.news_url=None",
                 f"--LabApp.user_settings_dir={r / 'settings'}", f"--LabApp.workspaces_dir={r / 'workspaces'}"],
                env={**os.environ, "JUPYTER_CONFIG_DIR": str(r / "config"),
                     "JUPYTER_RUNTIME_DIR": str(r / "runtime")},
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not start: see {r / 'server.log'}") from None
                time.sleep(0.3)

    def kernels(self) -> list[dict]:
        """The server's kernels (``GET /api/kernels``): id, execution_state, connections...; none while the server
        cannot list them: jupyter_server answers 500 (KeyError 'last_activity') when asked while a kernel starts,
        and callers poll again, as the page's own polling does."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/kernels?token={self.token}", timeout=10) as answer:
                return json.load(answer)
        except urllib.error.HTTPError as e:
            if e.code != 500:
                raise
            return []

    def stop(self) -> None:
        """SIGTERM (the server shuts its kernels down), SIGKILL after 20 s; then SIGKILL whatever it had
        started that is still alive 10 s later (a kernel's engines, when a test failed before it stopped
        them)."""
        started = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(started, timeout=10)  # a kernel's reaper stops its cluster
        for process in alive:
            try:
                process.kill()  # psutil checks that the pid still names the same process
            except psutil.NoSuchProcess:
                pass

    def restart(self) -> None:
        self.stop()
        self.start()


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
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
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
