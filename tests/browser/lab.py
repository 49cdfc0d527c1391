"""A real JupyterLab with the pscluster extensions, and the options of Debian's headless chromium that drives
it: shared by the browser tests (``conftest.py``) and the benchmarks that time the page (``benchmarks/run_view.py``),
so that both measure the same lab in the same browser. No pytest in here."""

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from pscluster.runtime.network import free_port

CHROMIUM = "/usr/bin/chromium"
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook the lab shows
LIVE_STEPS = 10**6  # a long live run's target, never reached: the test or benchmark that follows it stops it
# A notebook that starts a cluster and trains a long async run with its live dashboard (test_long_run, and
# benchmarks/live_page.py, which measures the page's main thread while it trains)
LIVE_CELLS = [
    "%load_ext pscluster\nimport torch\nimport pscluster",
    "%pscluster start --ps 1 --workers 2 --name long",
    f"%%pscluster train --mode async --steps {LIVE_STEPS} --batch-size 8 --lr 0.01 --log-every 1000000 "
    "--name long-async\n"
    "model = torch.nn.Linear(8, 1)\n"
    "loss_fn = torch.nn.MSELoss()\n"
    "g = torch.Generator().manual_seed(0)\n"
    "dataset = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))",
]
# each pscluster figure of the open notebook: how many of its traces are drawn with points
FIGURES_DRAWN = """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .pscluster-figure')]
    .map(div => (div.data || []).filter(t => (t.x && t.x.length) || (t.y && t.y.length)).length)"""
# scrolls the open notebook's first figure drawn without points into view: a live figure out of view is drawn when
# it comes into view, as a user scrolling to it sees it
SHOW_UNDRAWN_FIGURE = """() => { const div = [...document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .pscluster-figure')].find(div => !(div.data || []).some(
    t => (t.x && t.x.length) || (t.y && t.y.length)));
    if (div) { div.scrollIntoView({ block: 'center' }); } }"""
# Pages try CDNs: every host name but the server's resolves to nothing. (Not a playwright route: its
# handlers run only while the test is inside a playwright call, so a test waiting on anything else would
# hold every request of the page.)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]


def launch_chromium(playwright):
    """Debian's chromium, headless, through ``playwright`` (a ``sync_playwright()`` context); never a browser
    that playwright downloads."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def open_notebook(page, name: str):
    """Opens the lab's file ``name`` as a user does, by a double click on it in the file browser, and returns the
    notebook's locator once it shows. The file browser is refreshed first: a file written after the page loaded
    shows otherwise only at the browser's next poll of the server (every 10 s, later on a loaded machine)."""
    page.locator('.jp-FileBrowser [data-command="filebrowser:refresh"]').click(timeout=60_000)
    page.locator(".jp-DirListing-itemText", has_text=name).dblclick()
    page.locator(NOTEBOOK).wait_for(timeout=60_000)
    return page.locator(NOTEBOOK)


class LabServer:
    """``jupyter lab`` on 127.0.0.1 in a child process, with a temporary root, settings, runtime and IPython
    directory (ipyparallel's server extension loads every cluster of its IPython directory's profiles and polls
    their launchers on the server's event loop: an SSH cluster of another test, seen through a shared directory,
    held the server's answers for seconds while its ssh commands ran); ``restart()`` stops it and starts a new one on the same port with the same token, as
    a user restarting their server would. ``env``: variables the server gets besides this process's
    environment (``PSCLUSTER_HOME``: where the panel finds the run store and the cluster registry); ``python``:
    the interpreter whose JupyterLab it is (this one unless said), run from ``root``."""

    def __init__(self, root: Path, env: dict[str, str] | None = None, python: str = sys.executable):
        self.root = root
        self.env = dict(env or {})
        self.python = python
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        news = root / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        news.parent.mkdir(parents=True)
        news.write_text('{"fetchNews": "false"}')  # no news toast over the page

    def start(self, timeout: float = 90.0) -> None:
        r = self.root
        with open(r / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
                 f"--port={self.port}", "--port-retries=0", f"--ServerApp.token={self.token}",
                 f"--ServerApp.root_dir={r / 'files'}", "--LabApp.news_url=None",
                 f"--LabApp.user_settings_dir={r / 'settings'}", f"--LabApp.workspaces_dir={r / 'workspaces'}"],
                env={**os.environ, **self.env, "JUPYTER_CONFIG_DIR": str(r / "config"),
                     "JUPYTER_RUNTIME_DIR": str(r / "runtime"), "IPYTHONDIR": str(r / "ipython")},
                cwd=r, stdout=log, stderr=subprocess.STDOUT)
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


class MainThread:
    """How busy the page's main thread is: the share of wall time its tasks took (chromium's TaskDuration, over the
    DevTools protocol) since this was made."""

    def __init__(self, page):
        self.session = page.context.new_cdp_session(page)
        self.session.send("Performance.enable")
        self.start = self._now()

    def _now(self) -> tuple[float, float]:
        metrics = {m["name"]: m["value"] for m in self.session.send("Performance.getMetrics")["metrics"]}
        return time.monotonic(), metrics["TaskDuration"]

    def share(self) -> float:
        (t0, busy0), (t1, busy1) = self.start, self._now()
        return (busy1 - busy0) / (t1 - t0)
