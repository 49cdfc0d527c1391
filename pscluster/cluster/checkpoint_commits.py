"""The controller's side of checkpoints: commit what the ps tasks wrote, ask for more on time or on demand.

The ps tasks write their shards themselves (every ``checkpoint_every`` steps, at a step asked for, at the
end); the coordinator commits a step once every ps has written its shard of it, records it in the run
store, and keeps the newest ``keep``.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import CheckpointError, ConfigError, RuntimeTimeout, TrainingError
from ..metrics.store import RunStore
from ..runtime import checkpoint, rescue
from ..runtime.client import PSClient
from ..runtime.options import DEFAULTS, check
from ..runtime.plan import TrainPlan
from ..runtime.ps import PASSED
from ..runtime.waiting import wait_until
from ..spec import ClusterSpec

REQUEST_ATTEMPTS = 6  # steps ahead: 1, 4, 16, ... 1024
START_POLL_S = 0.05  # how often a request asks whether every ps holds a run that is starting


class CheckpointCoordinator:
    """Commits the checkpoints of one run (see the module docstring); every ``every_s`` seconds asks the
    ps tasks for one more."""

    def __init__(self, store: RunStore, *, every_s: float | None = None, keep: int = DEFAULTS.keep_checkpoints):
        check(checkpoint_secs=every_s, keep_checkpoints=keep)
        self.store = store
        self.every_s = every_s or None
        self.keep = keep
        self._last_request = time.monotonic()

    def commit(self, plan: TrainPlan, num_ps: int, *, prune: bool = True) -> list[Path]:
        """Commit every complete step of the current attempt; each is recorded as a 'checkpoint' event. Then
        the newest ``keep`` are kept (``prune=False``: not yet; the caller reads the new ones first and calls
        ``prune``)."""
        if not plan.checkpoint_dir:
            return []
        written = checkpoint.commit_ready(plan.checkpoint_dir, num_ps=num_ps, run_id=plan.run_id,
                                          attempt=plan.attempt, variables=plan.variables,
                                          optimizer=plan.optimizer, optimizer_kwargs=plan.optimizer_kwargs,
                                          keep=self.keep if prune else None, state_keys=plan.state_keys)
        for step, path in written.items():
            self.store.add_event(plan.run_id, "controller", "checkpoint", {"step": step, "path": str(path)})
        return list(written.values())

    def prune(self, plan: TrainPlan) -> None:
        """Keep the newest ``keep`` committed checkpoints (after a ``commit(prune=False)``)."""
        if plan.checkpoint_dir:
            checkpoint.prune(plan.checkpoint_dir, self.keep)

    def rescue(self, plan: TrainPlan, num_ps: int) -> rescue.Assembled | None:
        """After a ps was lost: commit the newest state of the failed attempt (the survivors' shards, the
        workers' copies, see ``rescue``) when it is newer than the newest checkpoint; recorded as a
        'checkpoint' event that names each shard's source."""
        if not plan.checkpoint_dir:
            return None
        try:
            assembled = rescue.assemble(plan.checkpoint_dir, num_ps=num_ps, run_id=plan.run_id, attempt=plan.attempt,
                                        variables=list(plan.variables), optimizer=plan.optimizer,
                                        optimizer_kwargs=plan.optimizer_kwargs, keep=self.keep,
                                        state_keys=plan.state_keys)
        except CheckpointError as e:  # a copy of diverged values: the run goes back to its latest checkpoint
            self.store.add_event(plan.run_id, "controller", "checkpoint_refused", {"error": str(e)})
            return None
        if assembled is not None:
            self.store.add_event(plan.run_id, "controller", "checkpoint",
                                 {"step": assembled.step, "path": str(assembled.path),
                                  "rescued": [s.to_dict() for s in assembled.sources]})
        return assembled

    def latest_step(self, plan: TrainPlan) -> int | None:
        steps = checkpoint.committed_steps(plan.checkpoint_dir) if plan.checkpoint_dir else []
        return steps[-1] if steps else None

    def due(self) -> bool:
        return self.every_s is not None and time.monotonic() - self._last_request >= self.every_s

    def request(self, spec: ClusterSpec, plan: TrainPlan, *, timeout: float = 10.0, start_s: float = 0.0) -> int:
        """Ask every ps to write its shard of a coming global step (or of the last one, at the step target);
        returns that step. The step is chosen from the ps tasks' steps a moment ago: when a ps has passed it
        meanwhile (a fast async run), it is asked again further ahead, ``REQUEST_ATTEMPTS`` times at most (a ps
        that took the passed step writes a shard no manifest commits). A ps that does not hold the run yet (it is
        starting: ``run.checkpoint()`` right after ``train()``) is waited for up to ``start_s`` s."""
        if not plan.checkpoint_dir:
            raise ConfigError("this run has no checkpoint directory: train with checkpoint_dir=...")
        self._last_request = time.monotonic()
        deadline = time.monotonic() + start_s
        ahead, passed = 1, 0
        while True:
            with PSClient(spec, run_id=plan.run_id, timeout=timeout) as client:
                held = client.stats()
                if all(s.get("run_id") == plan.run_id for s in held):
                    steps = [s["step"] for s in held]
                    step = max(steps) + ahead if plan.steps is None else min(max(steps) + ahead, plan.steps)
                    if step <= max(steps):
                        return step
                    try:
                        if client.checkpoint(step):
                            return step
                    except TrainingError as e:
                        passed += 1
                        if PASSED not in str(e) or passed == REQUEST_ATTEMPTS:
                            raise
                        ahead *= 4
                        continue
            if time.monotonic() >= deadline:
                raise RuntimeTimeout(f"run {plan.run_id} had not started on every ps within {start_s:.0f}s: no "
                                     "checkpoint asked; see the run's events (run.events())")
            time.sleep(START_POLL_S)

    def wait_for(self, plan: TrainPlan, step: int, timeout: float, done) -> Path:
        """The manifest of ``step`` once committed (``done()``: the run ended, stop waiting)."""
        path = checkpoint.manifest_path(plan.checkpoint_dir, step)
        if not wait_until(lambda: path.exists() or done(), timeout) or not path.exists():
            raise RuntimeTimeout(f"no checkpoint of step {step} within {timeout:.0f}s: "
                                 "see the run's events (run.events())")
        return path
