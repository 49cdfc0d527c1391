"""The bound on ipyparallel's sockets: in the controller and its children (the hub, the heart monitor, the
schedulers) and in every local engine, each ZeroMQ socket refuses a frame of more than ``MAX_FRAME_BYTES``. ZeroMQ
(``MAXMSGSIZE``) drops the peer that declares one, at its header, before holding any of its bytes: without it a
frame declaring 1 GiB to any port (the engines' heartbeat monitor, the hub's registration) was taken whole. (No
engine listens on a socket of ipyparallel's any more: see ``engines.ENGINE_ARGS``.)

ipyparallel makes its sockets itself, in contexts of its own (the heart's and the schedulers' devices create
theirs), and a listener keeps the options its socket had when it bound: so ``bound_sockets`` sets the option on
every socket a process makes from then on, before ipyparallel makes any (``controller_main``, ``engine_main``).
pscluster's own sockets set their tighter bounds on top (``runtime.router``, ``metrics.collector``,
``cluster.control``).

What pscluster sends through ipyparallel is checked in the kernel against the same bound (``check``): a payload
over it is a one-line ``ConfigError`` naming the fix, never a message that ZeroMQ drops on the way (a hang).
"""

from __future__ import annotations

import functools

import zmq

from ..errors import ConfigError

# The largest frame ipyparallel carries for pscluster: one shipped payload, the cloudpickled (model_fn, dataset,
# loss...) of a run, travels to each worker as one frame, and a session step's batch piece as one. 256 MiB holds
# a dataset kept in memory of the size of MNIST's training set as float32 (188 MB) with room to spare; a larger
# one belongs in files the engines read. It stays well under the 1 GiB frame of issue 35, and any frame declaring
# more than it is refused before a byte is held.
MAX_FRAME_BYTES = 256 << 20


def bound_sockets() -> None:
    """Have every ZeroMQ socket this process (and any process it forks) makes from now on refuse a frame of more
    than ``MAX_FRAME_BYTES``, unless its context or its maker sets a bound of its own. Idempotent."""
    make = zmq.Context.socket
    if getattr(make, "bounded", False):
        return

    @functools.wraps(make)
    def socket(self, *args, **kwargs):
        s = make(self, *args, **kwargs)
        if zmq.MAXMSGSIZE not in self.sockopts:  # a context's own default (Context.setsockopt) stays
            s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        return s

    socket.bounded = True
    zmq.Context.socket = socket


def check(nbytes: int, what: str, fix: str) -> None:
    """A ``ConfigError`` when ``what`` (``nbytes`` long) would not fit one frame of ipyparallel's sockets."""
    if nbytes > MAX_FRAME_BYTES:
        raise ConfigError(f"{what} takes {nbytes / 2**20:,.0f} MiB, more than the {MAX_FRAME_BYTES >> 20} MiB a "
                          f"message to the engines may carry: {fix}")
