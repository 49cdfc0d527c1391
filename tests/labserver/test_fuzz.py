"""The side panel's REST API in a real JupyterLab (a child process) against any request its routes can be sent:
each is answered, never with a 5xx, the API's refusals as a JSON ``{"error": ...}`` (a path no route takes, or a verb
a route has not, gets the server's own page), and the API answers a valid request after it."""

import http.client
import json
import urllib.parse

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pscluster.metrics.store import RunStore

from ..browser.lab import LabServer
from ..fuzz import ENCODINGS, JSON_VALUES, NESTED, encoded, fuzz_settings


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab whose PSCLUSTER_HOME holds a run store with one finished run (id 1)."""
    home = tmp_path_factory.mktemp("home")
    store = RunStore(str(home / "runs.sqlite"))
    run_id = store.create_run(name="one", cluster="c", mode="sync", config={"steps": 10}, spec={})
    store.add_batch(run_id, [{"kind": "step", "task": "worker:0", "time": 1.0, "local_step": 1, "global_step": 1,
                              "loss": 0.5}])
    store.set_status(run_id, "finished", {})
    root = tmp_path_factory.mktemp("lab")
    (root / "files").mkdir()
    server = LabServer(root, env={"PSCLUSTER_HOME": str(home)})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def send(lab, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request with the server's token."""
    connection = http.client.HTTPConnection("127.0.0.1", lab.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers={"Authorization": f"token {lab.token}"})
        answer = connection.getresponse()
        return answer.status, answer.getheader("Content-Type", ""), answer.read()
    finally:
        connection.close()


# ids of any length: past SQLite's integers, and past the 4,300 digits int() takes
LONG_IDS = st.sampled_from([19, 20, 4301, 5000]).map(lambda n: "9" * n)
SEGMENTS = st.text(st.characters(codec="utf-8", exclude_characters="/?#"), max_size=12) | \
    st.integers(-10, 10**30).map(str) | LONG_IDS
PATHS = st.one_of(
    st.just("clusters"), st.just("runs"), st.just("compare"),
    st.builds("clusters/{}/stop".format, SEGMENTS),
    st.builds("clusters/{}/tasks/{}/{}/{}".format, SEGMENTS, st.sampled_from(["ps", "chief", "worker"]) | SEGMENTS,
              st.integers(0, 10**30).map(str) | SEGMENTS, st.sampled_from(["kill", "restart"]) | SEGMENTS),
    st.builds("runs/{}/{}".format, st.integers(0, 10**30).map(str) | LONG_IDS | SEGMENTS,
              st.sampled_from(["series", "figures", "metrics.csv", "metrics.parquet", "stop"]) | SEGMENTS),
)
HOSTILE_NUMBERS = st.sampled_from(["nan", "inf", "-inf", "Infinity", "1e308", "-1e308", "1e999", "9" * 5000])
QUERY_VALUES = st.text(max_size=24) | st.integers().map(str) | st.floats().map(str) | HOSTILE_NUMBERS | \
    st.sampled_from(["step", "time", "loss,accuracy", "/", "/dev/null", "../../etc/passwd", "runs.sqlite", "1:",
                     "1:/dev/null", "9" * 5000 + ":", "dropped_stale"])
QUERIES = st.dictionaries(st.sampled_from(["store", "points", "x", "names", "start", "stop", "run", "metric"]) |
                          st.text(max_size=8),
                          QUERY_VALUES, max_size=4)
BODIES = st.none() | st.binary(max_size=256) | NESTED | st.builds(encoded, JSON_VALUES, ENCODINGS)


@pytest.mark.fuzz
@fuzz_settings(examples=120)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), path=PATHS, query=QUERIES, body=BODIES)
@example(method="GET", path="runs/" + "9" * 5000 + "/series", query={}, body=None)
@example(method="GET", path="runs/1/series", query={"start": "nan", "stop": "inf"}, body=None)
@example(method="GET", path="runs/1/series", query={"start": "1e308", "stop": "-1e308"}, body=None)
@example(method="GET", path="compare", query={"run": "1:/dev/null", "metric": "loss"}, body=None)
@example(method="GET", path="runs/1/figures", query={"store": "/dev/null"}, body=None)
def test_every_request_is_answered_without_a_server_error_and_the_api_goes_on(lab, method, path, query, body):
    url = "/pscluster/api/" + urllib.parse.quote(path) + ("?" + urllib.parse.urlencode(query) if query else "")
    status, kind, answer = send(lab, method, url, body if method != "GET" else None)
    assert status < 500, (status, answer[:300])
    if status >= 400 and "json" in kind:  # the API's refusals (the server's own pages are HTML)
        assert "error" in json.loads(answer), answer[:300]
    status, _, answer = send(lab, "GET", "/pscluster/api/runs")
    assert status == 200 and json.loads(answer)["runs"][0]["name"] == "one"
