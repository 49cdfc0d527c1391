"""Handler tests: a real jupyter server in this process (pytest-jupyter), with the pscluster
extension, over a real run store and registry in a fresh PSCLUSTER_HOME."""

import json
import subprocess
import sys

import pytest
from tornado.httpclient import HTTPClientError

# pytest-jupyter's fixtures and hooks for this folder only (its autouse fixtures would touch every test)
from pytest_jupyter.jupyter_core import *  # noqa: E402, F403
from pytest_jupyter.jupyter_server import *  # noqa: E402, F403


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"pscluster.labserver": True}}}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh PSCLUSTER_HOME for one test."""
    monkeypatch.setenv("PSCLUSTER_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def api(jp_fetch):
    """``await api("GET", "runs")`` -> (status, decoded JSON body or text), errors included. A list of values is the
    query argument repeated: ``run=["1", "2"]`` asks ``?run=1&run=2``."""

    async def call(method: str, *path: str, headers=None, **params):
        query = [(k, v) for k, values in params.items() for v in (values if isinstance(values, list) else [values])]
        kwargs = {"method": method, "params": query, "headers": headers}
        if method == "POST":
            kwargs["body"] = b""
        try:
            response = await jp_fetch("pscluster", "api", *path, **kwargs)
        except HTTPClientError as e:
            response = e.response
        try:
            return response.code, json.loads(response.body)
        except ValueError:  # refused before our handler: tornado's own page
            return response.code, response.body.decode()

    return call


@pytest.fixture
def dead_pid():
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
