"""The wheel as a new user gets it: installed into a fresh venv (torch from the pinned spec first, as the README
says), away from this checkout, it trains from a notebook through ``%load_ext pscluster``, lists its server
extension and its labextension as enabled, and its JupyterLab draws the side panel with that run.

Runs with ``make wheel-check`` (``PSCLUSTER_WHEEL`` names the wheel ``make dist`` built), not in ``make test``."""

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import pytest

from ..browser.lab import CHROMIUM, LabServer, launch_chromium

WHEEL = Path(os.environ.get("PSCLUSTER_WHEEL", "dist/pscluster.whl")).resolve()
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
STEPS = 20
NOTEBOOK = [
    "%load_ext pscluster",
    "import json\nimport torch\nimport pscluster",
    "%pscluster start --ps 1 --workers 1 --name wheel",
    f"%%pscluster train --mode sync --steps {STEPS} --batch-size 32 --optimizer sgd --lr 0.1 --name from-wheel --wait\n"
    "model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))\n"
    "loss_fn = torch.nn.CrossEntropyLoss()\n"
    "dataset = pscluster.datasets.digits('train')",
    "run = _\n"
    "print(json.dumps({'status': run.status, 'global_step': run.global_step, 'file': pscluster.__file__,\n"
    "                  'version': pscluster.__version__}))",
    "%pscluster stop",
]


def plain(text: str) -> str:
    """``text`` without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def run(args: list, cwd: Path, env: dict, timeout: float = 600) -> str:
    """``args`` run to their end; their output (stdout and stderr) returned; a failure raises with it."""
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv holding torch (the pinned spec) and the wheel, with nothing of this checkout; returns its
    root, the directory to run it from and the environment to run it with (its own PSCLUSTER_HOME)."""
    if not WHEEL.is_file():
        pytest.fail(f"no wheel at {WHEEL}: run `make wheel-check`, which builds it with `make dist`")
    root = tmp_path_factory.mktemp("fresh")
    home = root / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER", "VIRTUAL_ENV"))}
    env.update(PATH=f"{root / 'venv' / 'bin'}:{env['PATH']}", PSCLUSTER_HOME=str(home), IPP_NONINTERACTIVE="1")
    began = time.monotonic()
    run([sys.executable, "-m", "venv", root / "venv"], root, env)
    pip = [root / "venv" / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, TORCH_SPEC], root, env)
    run([*pip, WHEEL], root, env)
    print(f"fresh venv with torch and the wheel in {time.monotonic() - began:.0f} s")
    return root, env


def test_one_version_number_everywhere(venv):
    root, env = venv
    python = root / "venv" / "bin" / "python"
    shown = json.loads(run([python, "-c", "import json, pscluster; from importlib.metadata import version;"
                            "print(json.dumps([pscluster.__version__, version('pscluster')]))"], root, env))
    with zipfile.ZipFile(WHEEL) as wheel:
        package_json = next(n for n in wheel.namelist() if n.endswith("labextensions/pscluster/package.json"))
        labextension = json.loads(wheel.read(package_json))["version"]
    source = json.loads((Path(__file__).resolve().parents[2] / "labextension" / "package.json").read_text())
    assert shown == [labextension, labextension] == [source["version"]] * 2
    assert WHEEL.name.startswith(f"pscluster-{labextension}-")


def test_a_notebook_trains_through_load_ext(venv):
    root, env = venv
    notebook = root / "from_wheel.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK],
                                            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                     "language": "python"}}), notebook)
    # the kernel is the venv's own python3: ipykernel's spec names whichever python serves it
    run([root / "venv" / "bin" / "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
         "--ExecutePreprocessor.timeout=300", notebook], root, env)
    outputs = nbformat.read(notebook, as_version=4).cells[4].outputs
    result = json.loads(next(o["text"] for o in outputs if o.get("name") == "stdout"))
    assert result["status"] == "finished" and result["global_step"] == STEPS
    assert result["file"].startswith(str(root / "venv")), result["file"]  # the installed package, not the checkout


def test_both_extensions_are_listed_enabled(venv):
    root, env = venv
    jupyter = root / "venv" / "bin" / "jupyter"
    servers = plain(run([jupyter, "server", "extension", "list"], root, env)).splitlines()
    assert ["pscluster.labserver", "enabled"] in [line.split() for line in servers], servers
    assert ["pscluster.labserver", "OK"] in [line.split() for line in servers], servers
    labs = plain(run([jupyter, "labextension", "list"], root, env)).splitlines()
    version = json.loads(run([root / "venv" / "bin" / "python", "-c", "import json, pscluster;"
                              "print(json.dumps(pscluster.__version__))"], root, env))
    assert ["pscluster", f"v{version}", "enabled", "OK"] in [line.split() for line in labs], labs


def test_the_side_panel_shows_the_run_in_jupyterlab(venv, tmp_path):
    root, env = venv
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make wheel-check` installs it (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    (tmp_path / "files").mkdir()
    lab = LabServer(tmp_path, env={"PSCLUSTER_HOME": env["PSCLUSTER_HOME"], "PATH": env["PATH"]},
                    python=str(root / "venv" / "bin" / "python"))
    lab.start()
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{lab.url}/lab?reset&token={lab.token}")
            tab = page.locator('.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="pscluster-panel"]')
            tab.wait_for(timeout=60_000)
            tab.click()
            panel = page.locator("#pscluster-panel")
            panel.get_by_text("No cluster running").wait_for(timeout=30_000)
            row = panel.locator(".jp-pscluster-run", has_text="from-wheel")
            row.get_by_text("finished").wait_for(timeout=30_000)  # the run store, read by the server extension
            assert row.locator(".jp-pscluster-run-step").inner_text().startswith(f"{STEPS}")
            browser.close()
    finally:
        lab.stop()
