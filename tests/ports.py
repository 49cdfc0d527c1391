"""Loopback port ranges for tests that give a cluster ``ports=(lo, hi)``."""
import socket

from pscluster.runtime.network import ephemeral_ports


def quiet_port_range(n: int) -> tuple[int, int]:
    """``n`` consecutive loopback ports, each free now, outside the kernel's ephemeral range: any outgoing
    connection may take a port of that range between a check and a bind, which made a nearly full range
    of 43100-43104 flaky in CI."""
    low, high = ephemeral_ports()
    for lo in [*range(20000, low - n, n), *range(high + 1, 65536 - n, n)]:  # windows below it, then above
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
