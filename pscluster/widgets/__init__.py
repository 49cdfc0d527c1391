"""Views (layer 3): the live dashboard of a run (``show``, ``Dashboard``), its figures (``figures``), the placement
plan (``placement_plan``). They read the run store and the objects handed to them, never the runtime nor the
control plane.
"""

from .dashboard import Dashboard, show

__all__ = ["Dashboard", "show"]
