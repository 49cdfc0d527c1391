"""pscluster: parameter-server training of PyTorch models, driven from Jupyter."""

from . import datasets
from .cluster.cluster import Cluster
from .cluster.run import Run
from .errors import PSClusterError
from .spec import ClusterSpec, TaskSpec

__version__ = "0.1.0"

__all__ = ["Cluster", "ClusterSpec", "PSClusterError", "Run", "TaskSpec", "datasets",
           "load_ipython_extension", "__version__"]


def load_ipython_extension(ipython):
    """``%load_ext pscluster``: registers the ``%pscluster`` magics."""
    from .magics import load_ipython_extension as load

    load(ipython)
