"""pscluster: parameter-server training of PyTorch models, driven from Jupyter.

The control-plane names (Cluster, Run) and the datasets load on first use, so importing
``pscluster.runtime`` on an engine or a plain process pulls in no IPython or
ipyparallel, and the side panel's server extension no torch.
"""

import importlib
import importlib.metadata

from . import environ, placement  # placement is light: no torch, plotly or IPython
from .errors import PSClusterError
from .spec import ClusterSpec, TaskSpec

__version__ = importlib.metadata.version("pscluster")  # one place: labextension/package.json

__all__ = ["Cluster", "ClusterSpec", "PSClusterError", "Run", "TaskSpec", "clusters", "compare", "datasets",
           "environ", "evaluate", "init", "load_ipython_extension", "open_run", "placement", "runs",
           "train_from_environment",
           "__version__"]


def __getattr__(name):
    if name == "Cluster":
        from .cluster.handle import Cluster

        return Cluster
    if name == "Run":
        from .cluster.run import Run

        return Run
    if name == "train_from_environment":
        from .cluster.script_run import train_from_environment

        return train_from_environment
    if name == "init":
        from .cluster.script_loop import init

        return init
    if name == "open_run":
        from .stored_run import open_run

        return open_run
    if name in ("datasets", "evaluate"):  # modules of torch, loaded on first use
        return importlib.import_module(f".{name}", __name__)
    if name == "compare":
        from .comparison import compare

        return compare
    raise AttributeError(f"module 'pscluster' has no attribute {name!r}")


def runs(store=None):
    """Past runs in the run store (default ``$PSCLUSTER_HOME/runs.sqlite``), newest first, as a DataFrame (see
    ``RunStore.runs``), ``started`` and ``ended`` as dates in this machine's time zone (``NaT``: not ended)."""
    from datetime import datetime

    import pandas as pd

    from .metrics.store import RunStore

    with RunStore(store) as s:
        found = s.runs()
    zone = datetime.now().astimezone().tzinfo
    for column in ("started", "ended"):
        found[column] = pd.to_datetime(found[column], unit="s", utc=True).dt.tz_convert(zone)
    return found


def clusters() -> list[dict]:
    """The clusters running on this machine (from the cluster registry under ``$PSCLUSTER_HOME``): name,
    state (``running``, or ``detached`` while no process owns it: ``Cluster.attach(name)``), ps, workers,
    owner pid."""
    from .cluster import registry

    return [{k: e.get(k) for k in ("name", "state", "ps", "workers", "owner_pid")} for e in registry.read_all()[0]]


def load_ipython_extension(ipython):
    """``%load_ext pscluster``: registers the ``%pscluster`` magics."""
    from .magics import load_ipython_extension as load

    load(ipython)
