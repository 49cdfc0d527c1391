"""ipp_bounds: the sockets a process makes once bound refuse a frame over MAX_FRAME_BYTES; a payload over it is
refused in the kernel in one line."""

import subprocess
import sys

import pytest

from pscluster.cluster import ipp_bounds
from pscluster.cluster.shipping import ship
from pscluster.errors import ConfigError

# in a process of its own: bound_sockets changes every socket the process makes afterwards
BOUNDED = """
import zmq
from pscluster.cluster.ipp_bounds import MAX_FRAME_BYTES, bound_sockets
bound_sockets(); bound_sockets()
made = [zmq.Context.instance().socket(zmq.ROUTER), zmq.Context().socket(zmq.SUB)]
own = zmq.Context(); own.setsockopt(zmq.MAXMSGSIZE, 1024)  # a context's own default stays
tighter = zmq.Context().socket(zmq.DEALER); tighter.setsockopt(zmq.MAXMSGSIZE, 4096)  # and a maker's own bound
assert [s.getsockopt(zmq.MAXMSGSIZE) for s in made] == [MAX_FRAME_BYTES] * 2
assert own.socket(zmq.PUB).getsockopt(zmq.MAXMSGSIZE) == 1024 and tighter.getsockopt(zmq.MAXMSGSIZE) == 4096
print("ok")
"""


def test_every_socket_made_after_bound_sockets_is_bounded():
    done = subprocess.run([sys.executable, "-c", BOUNDED], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def test_a_payload_over_the_bound_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(ipp_bounds, "MAX_FRAME_BYTES", 1 << 20)
    ship(bytes(1 << 19))
    with pytest.raises(ConfigError) as refused:
        ship(bytes(2 << 20))
    message = str(refused.value)
    assert "\n" not in message and "more than the 1 MiB" in message and "reads its samples from files" in message
