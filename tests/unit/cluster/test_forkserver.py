"""The forkserver of this process's local clusters: one for the process, and no request stops it."""

import json
import os
import socket
import time

import pytest

from pscluster.cluster import forkserver


@pytest.fixture(scope="module")
def server_path():
    path = forkserver.socket_path()
    deadline = time.monotonic() + 120
    while not os.path.exists(path):  # listening once its imports are done
        assert time.monotonic() < deadline, "the forkserver did not listen"
        time.sleep(0.1)
    yield path
    forkserver.stop()


def ask(path: str, message: bytes, fds=()) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(path)
        socket.send_fds(s, [message], list(fds))
        return json.loads(s.recv(65536))


def test_one_forkserver_serves_every_cluster_of_the_process(server_path):
    assert forkserver.socket_path() == server_path
    assert oct(os.stat(os.path.dirname(server_path)).st_mode & 0o777) == "0o700"  # its user's alone


@pytest.mark.parametrize("message, fds", [
    (b"\xff not json", (1, 2)),
    (b"[]", (1, 2)),
    (json.dumps({"copies": 1}).encode(), (1, 2)),
    (json.dumps({"copies": 0, "connection_file": "f", "since": 0, "engine_args": [], "env": {}, "cwd": "/"}).encode(),
     (1, 2)),
    (json.dumps({"copies": 1, "connection_file": "f", "since": 0, "engine_args": [], "env": {}, "cwd": "/"}).encode(),
     ()),
    (json.dumps({"copies": "x", "connection_file": "f", "since": 0, "engine_args": [], "env": [], "cwd": "/"}).encode(),
     (1,)),
], ids=["bytes", "a list", "missing fields", "no copies", "no output", "bad types"])
def test_a_request_it_cannot_take_is_answered_and_it_serves_on(server_path, message, fds):
    assert "error" in ask(server_path, message, fds)
    assert "error" in ask(server_path, b"{}", (1, 2))  # still serving


def test_an_asker_that_sends_nothing_holds_it_up_for_a_moment_only(server_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
        silent.connect(server_path)
        assert "error" in ask(server_path, b"{}", (1, 2))  # answered once the silent one's time is up
        assert "error" in json.loads(silent.recv(65536))


def test_its_owner_stops_it_when_no_cluster_asked_for_a_while_and_a_later_cluster_gets_a_new_one(monkeypatch):
    # the owner decides, under the lock it hands the socket out with: a forkserver that timed itself out could end
    # between the owner's look at it and the request of a cluster starting (its engines never came)
    forkserver.stop()
    first = forkserver._running()
    monkeypatch.setattr(forkserver, "IDLE_S", 0.5)
    deadline = time.monotonic() + 30
    # its process ends a moment before the stop that waits for it removes its folder
    while first.process.poll() is None or os.path.exists(first.folder):
        assert time.monotonic() < deadline, "an idle forkserver was not stopped, or its folder was left"
        time.sleep(0.1)
    assert forkserver._running() is not first and forkserver._running().running()
    forkserver.stop()
