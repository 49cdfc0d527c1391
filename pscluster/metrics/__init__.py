"""Metric events on the controller side: the collector."""
