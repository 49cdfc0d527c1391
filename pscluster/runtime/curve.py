"""Optional ZeroMQ CURVE encryption of the data plane (``ClusterSpec.encrypt``).

Every ps of a cluster is a CURVE server whose key pair is derived from the cluster secret, so
that secret (handed to the engines through ipyparallel's authenticated channel) is the only key
material to distribute; each client draws a fresh key pair of its own. CURVE encrypts, and its
handshake proves the server holds the secret key; who may send requests is still decided by the
HMAC signature of every message (``protocol``).
"""

from __future__ import annotations

import hashlib
import hmac

import zmq
from zmq.utils import z85


def server_keys(key: bytes) -> tuple[bytes, bytes]:
    """The (public, secret) Z85 CURVE keys of the ps tasks of the cluster whose secret is ``key``."""
    secret = z85.encode(hmac.new(key, b"pscluster data plane CURVE server", hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def make_server(sock: zmq.Socket, key: bytes) -> None:
    """Make ``sock`` (not bound yet) a CURVE server: it accepts CURVE clients only."""
    public, secret = server_keys(key)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def make_client(sock: zmq.Socket, key: bytes) -> None:
    """Make ``sock`` (not connected yet) a CURVE client of the ps tasks of the cluster of ``key``."""
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_keys(key)[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret
