"""Numbers and names a hostile or careless client sends the side panel's API: each refused with a 400 that names
the parameter (never a 500), and names written to a CSV so that no spreadsheet runs them as formulas."""

import io

import pandas as pd
import pytest

from pscluster.metrics.store import RunStore

from .test_api import new_run, steps


@pytest.fixture
def run(home) -> int:
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, steps(0, 1, 5))
    return run


@pytest.mark.parametrize("path,params,named", [
    (("runs", "9" * 5000, "series"), {}, "run id"),
    (("runs", "9" * 5000, "metrics.csv"), {}, "run id"),
    (("runs", "9" * 5000, "figures"), {}, "run id"),
    (("compare",), {"run": ["1", "9" * 5000 + ":runs.sqlite"]}, "run id"),
    (("runs", "9" * 5000, "stop"), {}, "run id"),
    (("runs", "99999999999999999999", "series"), {}, "run id"),
    (("clusters", "c", "tasks", "worker", "9" * 5000, "kill"), {}, "task index"),
])
async def test_an_id_too_large_for_any_run_is_refused_by_name(api, run, path, params, named):
    status, body = await api("POST" if path[-1] in ("stop", "kill") else "GET", *path, **params)
    assert status == 400 and named in body["error"] and "\n" not in body["error"], (status, body)


@pytest.mark.parametrize("params,named", [
    ({"start": "nan"}, "start="), ({"stop": "inf"}, "stop="), ({"start": "-Infinity"}, "start="),
    ({"start": "1e308", "stop": "-1e308"}, "start="), ({"stop": "1e999"}, "stop="),
    ({"points": "9" * 5000}, "points="),
])
async def test_a_number_that_is_no_finite_range_is_refused_by_name(api, run, params, named):
    status, body = await api("GET", "runs", str(run), "series", **params)
    assert status == 400 and named in body["error"] and "\n" not in body["error"], (status, body)
    status, body = await api("GET", "runs", str(run), "series", start="1", stop="3")
    assert status == 200 and body["workers"]


async def test_a_csv_never_holds_a_formula(api, run, jp_fetch):
    hostile = ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-2+3", "@SUM(A1)", "\tlead", "plain"]
    with RunStore() as store:
        store.add_batch(run, [{"kind": "step", "task": "worker:0", "time": 2000.0, "local_step": 6,
                               "global_step": 6, "loss": 0.1, "metrics": {name: 1.0 for name in hostile}}])
    response = await jp_fetch("pscluster", "api", "runs", str(run), "metrics.csv")
    header = response.body.decode().splitlines()[0]
    cells = pd.read_csv(io.StringIO(header)).columns
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r")], list(cells)
    assert {"'=HYPERLINK(\"http://x\",\"y\")", "'+1+1", "'@SUM(A1)", "plain"} <= set(cells), list(cells)
