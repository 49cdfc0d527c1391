"""pscluster's jupyter-server extension: a REST API under ``/pscluster/api/`` over the cluster
registry and the run store of ``$PSCLUSTER_HOME``, for the JupyterLab side panel.

Enabled on install (``etc/jupyter/jupyter_server_config.d/pscluster.json`` in the wheel).
"""

from __future__ import annotations

from .handlers import routes
from .service import LabService


def _jupyter_server_extension_points():
    return [{"module": "pscluster.labserver"}]


def _load_jupyter_server_extension(server_app) -> None:
    """Add the API's routes to the server."""
    web_app = server_app.web_app
    web_app.add_handlers(".*$", routes(web_app.settings["base_url"], LabService()))
    server_app.log.info("pscluster side panel API at %spscluster/api/", web_app.settings["base_url"])
