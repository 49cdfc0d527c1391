"""``python -m pscluster.runtime``: serve the ps task named in PSCLUSTER_CONFIG."""

import sys

from ..errors import PSClusterError
from .standalone import serve_ps

try:
    serve_ps()
except PSClusterError as e:
    sys.exit(f"pscluster: {e}")
