"""Every ``PSCLUSTER_*`` environment variable, read here and nowhere else.

============================  ==============================================================
``PSCLUSTER_CONFIG``          JSON ``{"cluster": <ClusterSpec>, "task": {"type", "index"}}``:
                              lets a plain process join a cluster (the TF_CONFIG analog).
``TF_CONFIG``                 TensorFlow's own: read when ``PSCLUSTER_CONFIG`` is unset
                              (see ``tfconfig``).
``PSCLUSTER_SECRET``          the data-plane key of a cluster named by ``TF_CONFIG`` (hex);
``PSCLUSTER_SECRET_FILE``     or a file holding it.
``PSCLUSTER_LAUNCH_OPTIONS``  JSON ``{option: value}``: the run options typed on
                              ``pscluster launch``'s command line (see ``launch_options``).
``PSCLUSTER_HOME``            directory of the run store (``runs.sqlite``) and the cluster
                              registry; default: the user's data directory.
``PSCLUSTER_SMOKE``           ``1`` makes the bundled notebooks run a small, fast size.
``PSCLUSTER_REPORT_DIR``      where the notebooks write their JSON reports.
============================  ==============================================================
"""

from __future__ import annotations

import json
import os

from .errors import ConfigError

CONFIG = "PSCLUSTER_CONFIG"
TF_CONFIG = "TF_CONFIG"
SECRET = "PSCLUSTER_SECRET"
SECRET_FILE = "PSCLUSTER_SECRET_FILE"
LAUNCH_OPTIONS = "PSCLUSTER_LAUNCH_OPTIONS"
HOME = "PSCLUSTER_HOME"
SMOKE = "PSCLUSTER_SMOKE"
REPORT_DIR = "PSCLUSTER_REPORT_DIR"


def config_json() -> str | None:
    """The raw ``PSCLUSTER_CONFIG`` value, or None when unset."""
    return os.environ.get(CONFIG) or None


def tf_config_json() -> str | None:
    """The raw ``TF_CONFIG`` value, or None when unset."""
    return os.environ.get(TF_CONFIG) or None


def launch_options() -> dict:
    """The run options ``pscluster launch`` was given (``PSCLUSTER_LAUNCH_OPTIONS``), by name; {} when unset.
    Raises ConfigError when the value is not a JSON object."""
    raw = os.environ.get(LAUNCH_OPTIONS)
    if not raw:
        return {}
    try:
        given = json.loads(raw)
    except ValueError:
        given = None
    if not isinstance(given, dict):
        raise ConfigError(f"{LAUNCH_OPTIONS} is not a JSON object of run options: unset it, or start the script "
                          "with pscluster launch --OPTION VALUE ...")
    return given


def secret() -> tuple[str, str] | None:
    """``(where it came from, the secret)``: ``PSCLUSTER_SECRET``, else the contents of the file
    ``PSCLUSTER_SECRET_FILE`` names; None when neither is set. Raises OSError when the file cannot be read."""
    if os.environ.get(SECRET):
        return SECRET, os.environ[SECRET].strip()
    if os.environ.get(SECRET_FILE):
        with open(os.environ[SECRET_FILE]) as f:
            return f"{SECRET_FILE} ({os.environ[SECRET_FILE]})", f.read().strip()
    return None


def home() -> str:
    """Directory of the run store and the cluster registry."""
    if os.environ.get(HOME):
        return os.environ[HOME]
    import platformdirs

    return platformdirs.user_data_dir("pscluster")


def smoke() -> bool:
    """True when notebooks should run their small, fast size."""
    return os.environ.get(SMOKE, "") not in ("", "0")


def report_dir(default: str) -> str:
    """Directory for notebook JSON reports."""
    return os.environ.get(REPORT_DIR) or default
