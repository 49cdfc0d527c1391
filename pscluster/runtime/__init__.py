"""Everything that runs on engines (layer 1): the ps server, the worker loop, the wire format and the training
contract (plan, steps, optimizer, data).

This package imports only itself and the base modules (errors, environ, spec, footprint), and no IPython,
Jupyter, ipyparallel or plotly: a process can join a cluster from the ``PSCLUSTER_CONFIG`` environment variable
alone (``python -m pscluster.runtime`` serves a ps task that way).
"""
