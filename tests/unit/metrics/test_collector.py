"""A run's metrics collector (its supervisor's, recording into a real run store and TensorBoard files) against any
frames and any signed events: no batch stops it, a malformed event is skipped (never the batch it came in), and a
valid batch sent after each is recorded."""

import itertools
import secrets
import time

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from pscluster.cluster.supervisor import Supervisor
from pscluster.metrics.store import RunStore
from pscluster.runtime.emitter import sign_batch
from pscluster.runtime.plan import TrainPlan
from pscluster.runtime.protocol import mac
from pscluster.runtime.waiting import wait_until

from ...fuzz import JSON_VALUES, NESTED, fuzz_settings
from ..conftest import make_spec

EMITTER = secrets.token_bytes(8)
sequence = itertools.count(1)


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    """(a run's supervisor, a PUSH socket connected to its collector) for every example."""
    spec = make_spec(num_ps=1, num_workers=2)
    store = RunStore(str(tmp_path_factory.mktemp("collector") / "runs.sqlite"))
    run_id = store.create_run(name="fuzzed", cluster="c", mode="sync", config={}, spec={})
    plan = TrainPlan.of(run_id=run_id, mode="sync", steps=10**6, batch_size=8, optimizer="sgd")
    supervisor = Supervisor(spec, plan, store)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(supervisor.collector.address)
    try:
        yield supervisor, push
    finally:
        push.close()
        supervisor.collector.close()
        supervisor.event_files.close()


def signed(supervisor, events) -> list[bytes]:
    return sign_batch(events, supervisor.spec.key, EMITTER, next(sequence), supervisor.id)


# what a signed event may hold: a known kind (or any text), the worker's task name (or anything), any fields
FIELD_VALUES = JSON_VALUES | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
EVENTS = st.lists(st.fixed_dictionaries(
    {"kind": st.sampled_from(["step", "ps", "done", "left", "log", "state", "nonfinite"]) | st.text(max_size=8)},
    optional={"task": st.sampled_from(["worker:0", "worker:1", "ps:0"]) | FIELD_VALUES, "time": FIELD_VALUES,
              "global_step": FIELD_VALUES, "local_step": FIELD_VALUES, "loss": FIELD_VALUES,
              "metrics": FIELD_VALUES, "line": FIELD_VALUES, "attempt": FIELD_VALUES,
              "samples": FIELD_VALUES, "compute_s": FIELD_VALUES}), max_size=6)
BATCHES = st.one_of(
    st.lists(st.binary(max_size=256), min_size=1, max_size=4).map(lambda frames: ("raw", frames)),  # unsigned
    EVENTS.map(lambda events: ("events", events)),
    st.lists(JSON_VALUES, max_size=4).map(lambda events: ("events", events)),  # not even objects
    NESTED.map(lambda doc: ("document", doc)),  # a signed batch nested past the JSON parser's depth
)


@pytest.mark.fuzz
@fuzz_settings(examples=120)
@given(batch=BATCHES)
def test_no_batch_stops_the_collector_and_the_next_valid_one_is_recorded(supervised, batch):
    supervisor, push = supervised
    unrecorded = supervisor.collector.rejected["unrecorded"]
    what, body = batch
    if what == "raw":
        push.send_multipart(body)
    elif what == "events":
        push.send_multipart(signed(supervisor, body))
    else:
        header = signed(supervisor, [])[0]
        push.send_multipart([header, body, mac(supervisor.spec.key, [header, body])])
    marker = f"still recording {next(sequence)}"
    push.send_multipart(signed(supervisor, [{"kind": "log", "task": "worker:0", "time": time.time(), "line": marker}]))
    assert wait_until(lambda: f"[worker:0] {marker}" in supervisor.logs, 10), "the collector stopped recording"
    assert supervisor.collector._thread.is_alive()
    assert supervisor.collector.rejected["unrecorded"] == unrecorded, "a batch was lost for an event in it"
