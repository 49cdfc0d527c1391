"""This machine on the network: its address on the route to another host, a free port from a range, a free port
for a server that another process binds later, and the range of ports the kernel gives outgoing connections. Used
on engines (a ps's address and port), by the controller (the addresses engines reach it at, the collector's port),
by ``pscluster launch`` (its ps tasks' ports) and TensorBoard's server."""

from __future__ import annotations

import errno
import random
import socket

import zmq


def route_address(target: str) -> str | None:
    """This machine's address on the route to ``target`` (no packet is sent), or None without a route."""
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def bind_in_range(bind, ports: tuple[int, int]):
    """``bind(port)`` on the ports of ``[lo, hi]`` in random order until one is free (another cluster, or an
    earlier run, may hold some: ``bind`` raises ``EADDRINUSE``, as a ZMQError or an OSError); raises OSError when
    every port is taken."""
    lo, hi = ports
    candidates = list(range(lo, hi + 1))
    random.shuffle(candidates)
    for port in candidates:
        try:
            return bind(port)
        except (zmq.ZMQError, OSError) as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"every port in {lo}-{hi} is taken: give a wider --ports range"
                                    + _outgoing_ports_hint(lo, hi))


# where free_port looks first: below the ephemeral ports (Linux's default begins at 32768), above most fixed services
FIRST_FREE_PORT = 20000
_handed_out: set[int] = set()  # free_port's ports so far: their servers may not have bound them yet


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` free now, for a server that another process binds later (a launched ps,
    TensorBoard), never one this process handed out before. It is outside the kernel's ephemeral ports where there
    is room: any process's outgoing connection may take one of those as its own end before the server binds it
    (``Address already in use`` then, seen in CI); the kernel's pick (port 0) where there is not."""
    def fresh(port: int) -> int:
        if port in _handed_out:
            raise OSError(errno.EADDRINUSE, f"port {port} handed out already")
        with socket.socket() as s:
            s.bind((host, port))  # OSError EADDRINUSE when another process holds it
        _handed_out.add(port)
        return port

    top = (ephemeral_ports() or (FIRST_FREE_PORT + 1, 0))[0] - 1
    if top > FIRST_FREE_PORT:
        return bind_in_range(fresh, (FIRST_FREE_PORT, top))
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's range of ports for outgoing connections (any connection may hold one of them), or None
    where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(p) for p in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def _outgoing_ports_hint(lo: int, hi: int) -> str:
    """Where ``[lo, hi]`` overlaps the ephemeral ports, which outgoing connections may hold."""
    ephemeral = ephemeral_ports()
    if ephemeral is None or lo > ephemeral[1] or hi < ephemeral[0]:
        return ""
    return f" outside {ephemeral[0]}-{ephemeral[1]}, the ports outgoing connections take"
