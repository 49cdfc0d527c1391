"""Every listening socket of every cluster process refuses a frame that declares 1 GiB (issue 35): ipyparallel's own
(the controller's hub, heart monitor and schedulers; the engines' heartbeat monitor before it was turned off) as
well as pscluster's (the ps tasks' data plane, the kernel's control socket)."""

import contextlib
import os
import socket

import psutil
import pytest
import torch

from pscluster.cluster import reaper

from .conftest import mlp

pytestmark = pytest.mark.integration
DECLARED = 1 << 30  # what each frame says it holds
SENT = 96 << 20  # what follows its header, as long as the peer reads it: an unbounded socket grows by this much
GROWTH_MIB = 64  # what any process may grow by, all ports together
# the socket type each socket type of ZeroMQ accepts as a peer (ZMTP 3 checks it in the handshake)
PEER = {b"ROUTER": b"DEALER", b"DEALER": b"DEALER", b"REP": b"REQ", b"REQ": b"REP", b"SUB": b"PUB",
        b"XSUB": b"PUB", b"PUB": b"SUB", b"XPUB": b"SUB", b"PULL": b"PUSH", b"PUSH": b"PULL", b"PAIR": b"PAIR"}


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = s.recv(n - len(data))
        if not more:
            raise ConnectionError("closed by the peer")
        data += more
    return data


def _peer_type(s: socket.socket) -> bytes:
    """The Socket-Type of the ZeroMQ socket at the other end, from its greeting and READY command."""
    _read(s, 64)  # its greeting (signature, version, NULL mechanism)
    flags = _read(s, 1)[0]
    size = int.from_bytes(_read(s, 8 if flags & 0x02 else 1), "big")
    body = _read(s, size)
    assert body.startswith(b"\x05READY"), body[:16]
    at = 6
    while at < len(body):
        name = body[at + 1:at + 1 + body[at]]
        at += 1 + body[at]
        length = int.from_bytes(body[at:at + 4], "big")
        if name == b"Socket-Type":
            return body[at + 4:at + 4 + length]
        at += 4 + length
    raise AssertionError("no Socket-Type in the peer's READY")


def send_declared_frame(stack: contextlib.ExitStack, port: int) -> str:
    """Open a ZMTP 3 connection to ``port`` as a socket its own accepts, then send a frame that declares
    ``DECLARED`` bytes and ``SENT`` bytes of it while the peer reads; the connection stays open on ``stack`` (a
    reset one would make the peer drop what it took). Returns the peer's socket type."""
    s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32))
    peer = _peer_type(s)
    ours = PEER[peer]
    ready = b"\x05READY" + b"\x0bSocket-Type" + len(ours).to_bytes(4, "big") + ours
    chunk = bytes(1 << 20)
    try:
        s.sendall(b"\x04" + bytes([len(ready)]) + ready + b"\x02" + DECLARED.to_bytes(8, "big"))
        for _ in range(SENT >> 20):
            s.sendall(chunk)
    except OSError:  # dropped by the peer: what a bounded socket does
        pass
    return peer.decode()


def test_a_frame_declaring_a_gibibyte_to_every_port_grows_no_process(start_cluster, digits_train):
    c = start_cluster(ps=1, workers=1)
    processes = {p: psutil.Process(p) for p in reaper.with_descendants(list(c.pids) + [os.getpid()])}
    ports = sorted({n.laddr.port for n in psutil.net_connections("tcp") if n.status == psutil.CONN_LISTEN
                    and n.pid in processes and n.laddr.ip in ("127.0.0.1", "0.0.0.0")})
    assert len(ports) >= 15  # ipyparallel's controller alone listens on 15 or more
    before = {p: proc.memory_info().rss for p, proc in processes.items()}
    with contextlib.ExitStack() as stack:
        peers = {port: send_declared_frame(stack, port) for port in ports}
        grown = {p: (proc.memory_info().rss - before[p]) >> 20 for p, proc in processes.items()}
    grew = ", ".join(f"pid {p} ({' '.join(processes[p].cmdline()[1:3])}) +{g} MiB"
                     for p, g in sorted(grown.items(), key=lambda item: -item[1]) if g >= GROWTH_MIB)
    assert not grew, f"{grew}; the ports and their socket types: {peers}"
    run = c.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), lr=0.1, mode="sync", steps=20, batch_size=32,
                  checkpoint_secs=None)
    run.wait(timeout=120, verbose=False)
    assert run.status == "finished" and run.global_step == 20 and run.error is None
