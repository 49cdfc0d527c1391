"""The supervisor never fails silently: a run store that cannot be written, or any exception of its own thread,
ends the run ``failed`` with the true cause, stops its workers and wakes every ``wait()`` (issue 54, items 1-2).
Real parts: in-process ps servers, workers in threads on the library's loop, a real SQLite store on a real tmpfs."""

import contextlib
import os
import threading
import time

import pytest
import torch

from pscluster.cluster.supervisor import Supervisor
from pscluster.metrics.store import RunStore
from pscluster.runtime.waiting import wait_until
from pscluster.runtime.worker import run_worker

from ...disks import fill, mounted
from ..runtime.test_worker_inprocess import dataset, make_plan, mlp  # noqa: F401

ENDED_S = 10  # the bound: from the failure to every wait() woken


class WorkerThread:
    """A worker of the library's loop in a thread, followed as the supervisor follows an engine's result."""

    def __init__(self, spec, index, plan, data):
        self.summary, self.error = None, None
        self._thread = threading.Thread(target=self._work, args=(spec, index, plan, data), daemon=True)
        self._thread.start()

    def _work(self, spec, index, plan, data):
        try:
            self.summary = run_worker(spec, index, plan, mlp, data, torch.nn.CrossEntropyLoss())
        except BaseException as e:  # noqa: BLE001 - the supervisor reads it through get()
            self.error = e

    def ready(self) -> bool:
        return not self._thread.is_alive()

    def successful(self) -> bool:
        return self.ready() and self.error is None

    def get(self, timeout=None):
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.summary


@contextlib.contextmanager
def supervised_run(local_ps, data, store_path, **changes):
    """A run of 2 workers without a step target, under its supervisor, training (``changes``: to its plan)."""
    spec = local_ps.start(num_ps=1, num_workers=2)
    store = RunStore(str(store_path))
    run_id = store.create_run(name="faulty", cluster="c", mode="async", config={}, spec={})
    plan = make_plan(spec, steps=10**6, mode="async", log_every=1).replace(run_id=run_id, **changes)
    supervisor = Supervisor(spec, plan, store)
    workers = []
    try:
        supervisor.start(lambda s: workers.extend(WorkerThread(spec, i, s.plan, data) for i in range(2)) or workers)
        assert wait_until(lambda: supervisor.latest_step >= 5, 30), "the run did not train"
        yield supervisor
        assert wait_until(lambda: all(w.ready() for w in workers), ENDED_S), "a worker trained on"
    finally:
        supervisor.stop()
        supervisor.ended.wait(30)
        store.close()


def test_an_exception_in_the_supervisor_s_thread_fails_the_run_with_it_and_wakes_wait(local_ps, dataset, tmp_path):
    with supervised_run(local_ps, dataset, tmp_path / "runs.sqlite") as supervisor:
        def broken():
            raise RuntimeError("injected into the monitor")

        def close_fails():
            raise OSError(28, "No space left on device", "events.out")

        supervisor.event_files.close = close_fails  # its release fails too: every wait() still wakes
        supervisor.commit_checkpoints = broken
        assert supervisor.ended.wait(ENDED_S), "wait() was not woken"
        assert supervisor.status == "failed"
        assert supervisor.error_line == "faulty lost its supervisor: RuntimeError: injected into the monitor"
    with RunStore(str(tmp_path / "runs.sqlite")) as store:
        row = store.run(supervisor.id)
    assert row["status"] == "failed" and "injected into the monitor" in row["failure"]["cause"]


def test_a_collector_whose_thread_dies_fails_the_run_with_its_exception(local_ps, dataset, tmp_path):
    with supervised_run(local_ps, dataset, tmp_path / "runs.sqlite") as supervisor:
        def broken(frames):
            raise RuntimeError("injected into the collector")

        supervisor.collector._receiver.open = broken
        assert supervisor.ended.wait(ENDED_S), "wait() was not woken"
        assert supervisor.status == "failed"
        assert supervisor.error_line == "faulty lost its metrics collector: RuntimeError: injected into the collector"


def test_a_store_removed_while_the_run_trains_fails_it(local_ps, dataset, tmp_path):
    # SQLite itself goes on writing into the removed file, where nobody can read the run
    path = tmp_path / "runs.sqlite"
    with supervised_run(local_ps, dataset, path) as supervisor:
        os.unlink(path)
        assert supervisor.ended.wait(ENDED_S), "wait() was not woken"
        assert supervisor.status == "failed"
        assert f"its run store {path} was removed while it trained" in supervisor.error_line


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs."""
    with mounted(tmp_path / "disk", size="4m") as disk:
        yield disk


def test_a_full_disk_under_the_run_store_fails_the_run_naming_the_store(local_ps, dataset, small_disk):
    path = small_disk / "runs.sqlite"
    with supervised_run(local_ps, dataset, path) as supervisor:
        fill(small_disk)
        began = time.monotonic()
        assert supervisor.ended.wait(ENDED_S), "wait() was not woken"
        assert time.monotonic() - began < ENDED_S
        assert supervisor.status == "failed"
        assert f"its run store {path} cannot be written" in supervisor.error_line
        assert "SQLITE_FULL" in supervisor.error_line and "free space there" in supervisor.error_line


def test_tensorboard_files_that_cannot_be_written_are_said_once_and_the_run_trains_on(local_ps, dataset, tmp_path):
    """Its TensorBoard folder cannot be created (a file where the folder goes): one event and one log line name the
    folder and the cause, and the run goes on recording its steps in the store."""
    blocked = tmp_path / "tensorboard"
    blocked.write_text("not a folder")
    with supervised_run(local_ps, dataset, tmp_path / "runs.sqlite") as supervisor:
        reached = supervisor.latest_step
        assert wait_until(lambda: supervisor.latest_step >= reached + 20, 30), "the run stopped training"
        assert supervisor.failure is None and supervisor.event_files.errors > 0
        supervisor.stop()
    assert supervisor.status == "stopped"
    with RunStore(str(tmp_path / "runs.sqlite")) as store:
        events = store.events(supervisor.id)
    said = events[events["kind"] == "tensorboard_failed"]
    assert len(said) == 1 and said.iloc[0]["detail"]["folder"].startswith(str(blocked))
    assert "Not a directory" in said.iloc[0]["detail"]["error"] or "File exists" in said.iloc[0]["detail"]["error"]
    lines = [line for line in supervisor.logs if "TensorBoard files under" in line]
    assert len(lines) == 1 and lines[0].endswith("the run trains on without them")
