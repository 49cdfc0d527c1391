"""The TensorBoard files of a run on a real small tmpfs that is full (issue 54, "nothing fails silently"): the run
goes on without them, and the user reads why in one warning, not in a writer thread's traceback on stderr. Runs
with ``make faults`` (it mounts a tmpfs: root)."""

import logging
import os
import threading
import time

import pytest
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from pscluster.metrics.tensorboard import POINT_S, EventWriter

from ..disks import fill, mounted


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs."""
    with mounted(tmp_path / "disk", size="2m") as disk:
        yield disk


def steps(first: int, n: int) -> list[dict]:
    """``n`` steps of two workers and their ps, each step charted (``POINT_S`` apart)."""
    return [event for i in range(first, first + n) for event in (
        {"kind": "step", "task": "worker:0", "time": 1000.0 + i * POINT_S, "local_step": i, "global_step": 2 * i,
         "loss": 1.0 / i, "accuracy": 0.5, "metrics": {"auc": 0.7}, "staleness": i % 3},
        {"kind": "step", "task": "worker:1", "time": 1000.0 + i * POINT_S, "local_step": i,
         "global_step": 2 * i + 1, "loss": 1.0 / i, "accuracy": 0.5, "staleness": 0},
        {"kind": "ps", "task": "ps:0", "time": 1000.0 + i * POINT_S, "step": 2 * i, "applied": 2 * i, "lr": 0.1})]


@pytest.mark.parametrize("when", ["mid-run", "from the start"])
def test_a_full_disk_is_one_warning_and_the_lost_events_a_count(small_disk, when, capfd, caplog, monkeypatch):
    # the default hook, as in a kernel: pytest's own would turn a writer thread's traceback into a warning of its own
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    caplog.set_level(logging.WARNING)
    logdir = small_disk / "tensorboard" / "run-1"
    writer = EventWriter(logdir)
    if when == "mid-run":
        writer.add_events(steps(1, 20))
        fill(small_disk, leave=64 << 10)  # room for a few hundred more events, then none
    else:
        fill(small_disk)
    started, i = time.monotonic(), 21
    while not writer.errors:  # events until the disk is full
        assert time.monotonic() - started < 10, "64 KiB took more than 10 s to fill"
        writer.add_events(steps(i, 100))
        i += 100
    for _ in range(5):  # and more, of the folders open and of one opened after the fault
        writer.add_events(steps(i, 100))
        writer.add_evaluation(2 * i, 0.5, 0.9)
        i += 100
        time.sleep(0.05)  # time for a writer thread to fail, and say it
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"TensorBoard files under {logdir} could not be written: [Errno 28] No space left on device; "
                    "the run goes on without them"]
    lost = writer.errors
    assert lost > 1500  # every event after the fault counted, none of them said
    caplog.clear()
    started = time.monotonic()
    writer.close()
    writer.close()  # a second close (the supervisor's release after a failed end) is nothing
    assert time.monotonic() - started < 5
    # the count said once, where the run's other warnings go (the run's logger, as the collector's count)
    assert [r.getMessage() for r in caplog.records] == [
        f"{writer.errors} TensorBoard events in all could not be written under {logdir}"]
    assert all(r.name == "pscluster.metrics" for r in caplog.records) and writer.errors >= lost
    caplog.clear()
    closed = writer.errors
    writer.add_events(steps(i, 1))  # a late batch after the end: counted too, never raised nor said
    assert writer.errors == closed + 3 and not caplog.records
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr
    # what was written before the fault is still there for TensorBoard to read
    os.unlink(small_disk / "filler")
    events = EventMultiplexer().AddRunsFromDirectory(str(logdir))
    events.Reload()
    if when == "mid-run":
        assert len(events.Scalars("worker_0", "loss")) >= 20
