"""A worker's membership of a run (``runtime.member``): the chief's start barrier."""

import threading

import torch

from pscluster.runtime import member


def test_a_run_stopped_during_the_chiefs_start_barrier_is_not_held_by_it(start_run, monkeypatch):
    monkeypatch.setattr(member, "START_WAIT_S", 3600.0)  # a barrier that only the run's stop can end
    run = start_run({"w": torch.zeros(3)}, num_workers=2)
    run.client().stop()  # stopped before any worker pulled (Run.stop() right after train())
    chief, left = run.client(0), threading.Event()
    threading.Thread(target=lambda: (member._wait_for_workers(chief, 2, lambda *_, **__: None), left.set()),
                     daemon=True).start()
    assert left.wait(60), "the chief still waits for the workers of a stopped run"
