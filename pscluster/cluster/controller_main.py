"""The process of a cluster's ipyparallel controller: ipcontroller, its sockets bounded (``ipp_bounds``) before it
makes any, in it and in the processes it forks (the heart monitor, the schedulers).

    python -m pscluster.cluster.controller_main [ipcontroller arguments]
"""

from __future__ import annotations

import sys

from .ipp_bounds import bound_sockets


def command() -> list[str]:
    """The ``controller_cmd`` of ipyparallel's controller launcher (it appends ipcontroller's arguments)."""
    return [sys.executable, "-m", __name__]


def main() -> None:
    bound_sockets()
    from ipyparallel.controller.app import main as controller

    controller()


if __name__ == "__main__":
    main()
