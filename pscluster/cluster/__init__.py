"""The control plane: engines on ipyparallel, roles, runs."""
