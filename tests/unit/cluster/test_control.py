"""The kernel's control socket (what the side panel's Stop, Kill and Restart go through) against hostile local
traffic: it answers every request, keeps serving after any of them, and never holds a large frame.

The server runs in a process of its own, as in a kernel, so that its memory can be measured; its cluster is a
stopped one, so a well-formed request gets a real answer ("already stopped") without engines."""

import contextlib
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from pscluster.cluster import control

from ...fuzz import ENCODINGS, JSON_VALUES, NESTED, encoded, fuzz_settings

SERVER = """
import json, sys, time
from types import SimpleNamespace
from pscluster.cluster.control import ControlServer
server = ControlServer(SimpleNamespace(name="c", running=False))
print(json.dumps({"address": server.address, "token": server.token}), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def served():
    """(the registry entry of a cluster whose control server runs in a child process, that process)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield {"name": "c", "control": json.loads(proc.stdout.readline())}, proc
    finally:
        proc.kill()
        proc.wait(10)


def still_serves(entry) -> None:
    with pytest.raises(control.ControlError, match="already stopped"):
        control.request(entry, "stop_cluster", timeout=10)


def ask(entry, frames: list[bytes]) -> dict:
    """Send ``frames`` as one request and return the reply."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(entry["control"]["address"])
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        return sock.recv_json()
    finally:
        sock.close()


@pytest.mark.parametrize("frames, kind", [
    ([json.dumps({"token": "tøken", "action": "stop_cluster"}).encode()], "forbidden"),  # non-ASCII token
    ([json.dumps({"token": 7, "action": "stop_cluster"}).encode()], "forbidden"),
    ([b"\xff\xfe not utf-8"], "invalid"),
    ([b"[1, 2]"], "forbidden"),
    ([b"{}", b"a second frame"], "invalid"),  # multipart
])
def test_bad_requests_are_refused_and_the_socket_keeps_serving(served, frames, kind):
    entry, _ = served
    reply = ask(entry, frames)
    assert reply["ok"] is False and reply["kind"] == kind
    still_serves(entry)


def test_arguments_that_are_not_an_object_are_refused(served):
    entry, _ = served
    token = entry["control"]["token"]
    reply = ask(entry, [json.dumps({"token": token, "action": "stop_run", "args": [1]}).encode()])
    assert reply["kind"] == "invalid" and "JSON object" in reply["error"]
    still_serves(entry)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@contextlib.contextmanager
def zmtp_frame_declaring(port: int, size: int, sent: int):
    """A ZMTP 3.0 connection opened as a REQ socket would, that sends a frame declaring ``size`` bytes and then
    ``sent`` bytes of it, as long as the server takes them; open while the caller measures (a socket closed
    with the server's handshake unread would be reset, and the server would drop what it had not read)."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
    ready = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"REQ"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready + b"\x02" + size.to_bytes(8, "big"))
        chunk = bytes(1 << 20)
        try:
            for _ in range(sent >> 20):
                s.sendall(chunk)
        except OSError:  # the server dropped the connection: what it should do
            pass
        time.sleep(0.5)  # what was sent is read by now
        yield


def test_a_frame_declaring_a_gibibyte_is_dropped_unread(served):
    entry, proc = served
    still_serves(entry)
    before = rss_mib(proc.pid)
    port = int(entry["control"]["address"].rsplit(":", 1)[1])
    with zmtp_frame_declaring(port, 1 << 30, sent=256 << 20):
        assert rss_mib(proc.pid) - before < 64  # 256 MiB more without ZeroMQ's MAXMSGSIZE
    still_serves(entry)


def test_a_message_without_an_envelope_leaves_the_socket_serving_and_closable():
    # what a DEALER (or a port scanner speaking ZMTP) sends: no empty frame before the request, which a REP socket
    # drops when it is read, after its poll said that a message had come
    server = control.ControlServer(SimpleNamespace(name="c", running=False))
    entry = {"name": "c", "control": {"address": server.address, "token": server.token}}
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(server.address)
        for _ in range(2):
            dealer.send(b"no envelope")
            time.sleep(0.5)  # the server has polled it by now
            still_serves(entry)
        dealer.send(b"no envelope")
        time.sleep(0.5)
    finally:
        dealer.close()
        began = time.monotonic()
        server.close()
    assert not server._thread.is_alive(), "the control thread outlived close()"
    assert time.monotonic() - began < 2


@pytest.fixture(scope="module")
def one_server():
    """The registry entry of one control server in a child process, for every example of a fuzz test."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield {"name": "c", "control": json.loads(proc.stdout.readline())}
    finally:
        proc.kill()
        proc.wait(10)


# requests as the token holder would send them, with any action and arguments ("token" is replaced by the real one)
TOKENED = st.builds(lambda action, args: {"token": "token", "action": action, "args": args},
                    st.sampled_from(list(control.ACTIONS)) | st.text(max_size=12), JSON_VALUES)
REQUESTS = st.one_of(
    st.lists(st.binary(max_size=512), min_size=1, max_size=3),  # any frames
    NESTED.map(lambda doc: [doc]),  # nesting past the JSON parser's depth (a RecursionError once stopped the socket)
    st.builds(lambda value, encoding: [encoded(value, encoding)], JSON_VALUES | TOKENED, ENCODINGS),  # encodings
    TOKENED.map(lambda request: [request]),
)


@pytest.mark.fuzz
@fuzz_settings(examples=150)
@given(frames=REQUESTS)
def test_no_request_stops_the_control_socket(one_server, frames):
    token = one_server["control"]["token"]
    frames = [json.dumps({**f, "token": token}).encode() if isinstance(f, dict) else f for f in frames]
    reply = ask(one_server, frames)
    assert reply["ok"] is False and reply["kind"] in {"invalid", "forbidden", "conflict", "not_found"}, reply
    still_serves(one_server)
