"""Loopback port ranges for tests that give a cluster ``ports=(lo, hi)``."""
import os
import socket

from pscluster.runtime.network import ephemeral_ports


def quiet_port_range(n: int) -> tuple[int, int]:
    """``n`` consecutive loopback ports, each free now, outside the kernel's ephemeral range: any outgoing
    connection may take a port of that range between a check and a bind, which made a nearly full range
    of 43100-43104 flaky in CI. The search starts at a window of this process's own (by its pid), so that two
    test processes at once (``pytest -n``) do not both check the same free window and then bind it."""
    low, high = ephemeral_ports()
    windows = [*range(20000, low - n, n), *range(high + 1, 65536 - n, n)]  # below the ephemeral range, above
    first = os.getpid() % len(windows)
    for lo in windows[first:] + windows[:first]:
        if all(_free(p) for p in range(lo, lo + n)):
            return lo, lo + n - 1
    raise RuntimeError(f"no {n} free ports outside {low}-{high}")


def _free(port: int) -> bool:
    with socket.socket() as s:  # a plain socket: ZeroMQ closes its own in the background
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
