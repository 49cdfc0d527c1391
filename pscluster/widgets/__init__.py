"""Notebook views of runs: the live dashboard (``show``, ``Dashboard``); the figures are in ``figures``."""

from .dashboard import Dashboard, show

__all__ = ["Dashboard", "show"]
