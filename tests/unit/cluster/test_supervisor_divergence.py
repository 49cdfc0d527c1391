"""A run whose loss diverges is marked so in its record, its logs and ``pscluster.runs()``, and stopped or failed
where its ``on_divergence`` says (issue 54, item 3). Real parts: the supervisor's collector fed signed step events
that explode; for a run that ends, in-process ps servers and workers in threads on the library's loop besides
them. (The rule on the losses of real training: ``tests/unit/metrics/test_divergence.py``.)"""

import secrets
import time

import pytest
import zmq

from pscluster.cluster.run import Run
from pscluster.cluster.supervisor import Supervisor
from pscluster.metrics.divergence import PATIENCE
from pscluster.metrics.store import RunStore
from pscluster.runtime.emitter import sign_batch
from pscluster.runtime.plan import TrainPlan
from pscluster.runtime.waiting import wait_until

from ..conftest import make_spec
from ..runtime.test_worker_inprocess import dataset  # noqa: F401
from .test_supervisor_faults import ENDED_S, supervised_run

RISEN_AT = 21  # the first step of the fed losses far above the start's


def send_steps(supervisor: Supervisor, losses: list[float], *, first_step: int = 1, chunk: int = 50) -> None:
    """``losses`` at global steps from ``first_step`` on, as the step events of 2 workers taking turns, in signed
    batches of ``chunk``, as workers send them."""
    events = [{"kind": "step", "task": f"worker:{step % 2}", "time": time.time(), "local_step": (step + 1) // 2,
               "global_step": step, "loss": loss} for step, loss in enumerate(losses, first_step)]
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(supervisor.collector.address)
    emitter = secrets.token_bytes(8)
    try:
        for sequence, first in enumerate(range(0, len(events), chunk), 1):
            push.send_multipart(sign_batch(events[first:first + chunk], supervisor.spec.key, emitter, sequence,
                                           supervisor.id))
    finally:
        push.close()


def test_a_diverging_loss_is_recorded_said_and_listed_and_the_run_goes_on(tmp_path):
    store = RunStore(str(tmp_path / "runs.sqlite"))
    calm = store.create_run(name="calm", cluster="c", mode="sync", config={}, spec={})
    run_id = store.create_run(name="exploding", cluster="c", mode="sync", config={}, spec={})
    run = Run(Supervisor(make_spec(), TrainPlan.of(run_id=run_id, mode="sync", steps=10**6, batch_size=8,
                                                optimizer="sgd"), store))
    supervisor = run.supervisor
    try:
        send_steps(supervisor, [2.3] * (RISEN_AT - 1))
        assert wait_until(lambda: supervisor.latest_step == RISEN_AT - 1, 10), "steps not received"
        assert "diverging" not in repr(run)
        send_steps(supervisor, [2.3e4] * (PATIENCE + 20), first_step=RISEN_AT)
        assert wait_until(lambda: supervisor.latest_step == RISEN_AT - 1 + PATIENCE + 20, 10), "steps not received"
        found = supervisor.divergence.found
        assert found is not None and found.since_step == RISEN_AT and found.reference == 2.3
        events = store.events(run_id)
        diverging = events[events["kind"] == "diverging"]
        assert list(diverging["task"]) == ["controller"]  # once, however long it stays up
        assert diverging.iloc[0]["detail"] == {"since_step": RISEN_AT, "loss": found.loss, "reference": 2.3,
                                               "threshold": found.threshold}
        assert store.divergence(run_id) == found and store.divergence(calm) is None
        assert supervisor.logs.count(f"[controller] {found.line()}") == 1
        runs = store.runs().set_index("id")
        assert runs.loc[run_id, "diverging_since"] == RISEN_AT and runs.loc[calm, "diverging_since"] is None
        assert repr(run).startswith(f"<Run exploding sync training, diverging since step {RISEN_AT}: global step")
        assert supervisor.failure is None and not supervisor.stop_requested  # flag, the default: it trains on
    finally:
        supervisor.collector.close()
        supervisor.event_files.close()
        store.close()


@pytest.mark.parametrize("on_divergence, status", [("stop", "stopped"), ("fail", "failed")])
def test_a_run_whose_loss_diverges_ends_as_on_divergence_says(local_ps, dataset, tmp_path, on_divergence, status):
    with supervised_run(local_ps, dataset, tmp_path / "runs.sqlite", on_divergence=on_divergence) as supervisor:
        # the workers' first losses set the reference; these come after them, however their batches interleave
        send_steps(supervisor, [2.3e4] * (PATIENCE + 20), first_step=supervisor.latest_step + 1)
        assert wait_until(lambda: supervisor.divergence.found is not None, 10), "the loss did not diverge"
        assert supervisor.ended.wait(ENDED_S), "the run went on"
        assert supervisor.status == status
    found = supervisor.divergence.found
    with RunStore(str(tmp_path / "runs.sqlite")) as store:
        record, events = store.run(supervisor.id), store.events(supervisor.id)
        assert record["status"] == status and store.divergence(supervisor.id) == found
    if on_divergence == "stop":
        assert record["failure"] is None
        assert events[events["kind"] == "stopping"].iloc[0]["detail"] == {"reason": found.words()}
    else:
        assert record["failure"]["cause"] == (f"faulty failed: {found.line()}: lower the learning rate (or clip with "
                                              "max_grad_norm=...) and train again; on_divergence='flag' trains on")
        assert record["failure"]["task"] == "controller" and record["failure"]["step"] >= found.since_step
