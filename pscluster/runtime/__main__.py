"""``python -m pscluster.runtime``: serve the ps task named in PSCLUSTER_CONFIG."""

import sys

from ..errors import PSClusterError
from .optim import preload_in_background
from .standalone import serve_ps

preload_in_background()  # for the first INIT's optimizer, while the ps waits for it
try:
    serve_ps()
except PSClusterError as e:
    sys.exit(f"pscluster: {e}")
