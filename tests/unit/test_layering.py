"""The runtime (code that runs on engines) imports no IPython, Jupyter or ipyparallel."""

import json
import subprocess
import sys

RUNTIME_MODULES = ["pscluster.runtime." + m for m in (
    "protocol", "plan", "placement", "ps", "client", "worker", "data", "metrics", "engine", "standalone", "optim",
    "steps")]
FORBIDDEN = ("IPython", "ipyparallel", "ipywidgets", "ipykernel", "jupyter", "anywidget", "plotly")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_runtime_imports_no_notebook_or_control_plane_modules():
    # A fresh interpreter: this test process has IPython loaded already.
    done = subprocess.run([sys.executable, "-c", PROBE, *RUNTIME_MODULES], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    offending = sorted(m for m in loaded if m.startswith(FORBIDDEN))
    assert not offending, f"importing the runtime loaded {offending}"
    assert "torch" in loaded and "zmq" in loaded  # the probe did import the runtime
