"""Everything that runs on engines: the ps server, the worker loop and the wire format.

This package imports no IPython, Jupyter or ipyparallel: a process can join a
cluster from the ``PSCLUSTER_CONFIG`` environment variable alone
(``python -m pscluster.runtime`` serves a ps task that way).
"""
