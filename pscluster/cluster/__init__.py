"""The control plane (layer 4): the Cluster and its engines, roles, runs, checkpoint commits, recovery and scaling,
the registry and control socket. Imports the layers below it; the views only lazily (``Run.dashboard``,
``Cluster.plan``)."""
