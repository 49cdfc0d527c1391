"""What a lost ps's optimizer state is worth: a sync Adam digits run (1 ps + 2 workers) whose ps is SIGKILLed at
step ``KILL_AT``, against the same run undisturbed. The ps comes back from the workers' copies of its values with
its optimizer state (its state copy, a few steps older: ``runtime.rescue``), or, in a third arm, without it (its
state copy deleted as soon as it is killed, before the rescue reads it: the restart of before). Per run: the
training loss over the 50 steps around 50 steps after the restart's step, from the run store."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from pscluster.datasets import digits
from pscluster.runtime import rescue

from . import procs
from .common import Result, compare, repetitions

LR = 0.01
AFTER = 50  # the loss this many steps after the restart (the mean of a window of WINDOW steps around it)
WINDOW = 50
WAIT_S = 180.0


def model_fn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _loss_after(m, from_step: int) -> float:
    """The mean training loss (both workers') in metrics ``m`` over the WINDOW steps centred AFTER steps past
    ``from_step``."""
    first = from_step + AFTER - WINDOW // 2
    m = m[(m["global_step"] > first) & (m["global_step"] <= first + WINDOW)]
    return float(m["loss"].mean())


def one_run(cluster, steps: int, kill_at: int, *, kill: bool = True, drop_state: bool = False) -> dict:
    """A run of ``steps`` whose ps is SIGKILLed once past step ``kill_at`` (unless not ``kill``; ``drop_state``:
    and its state copy deleted): its metrics, the step it restarted from and from what."""
    run = cluster.train(model_fn, digits("train"), torch.nn.CrossEntropyLoss(), optimizer="adam", lr=LR,
                        mode="sync", steps=steps, batch_size=32, log_every=steps, seed=0, checkpoint_secs=None)
    if kill:
        deadline = time.monotonic() + WAIT_S
        while run.global_step < kill_at:
            if run.done or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or stalled at step {run.global_step}: {run.error}")
            time.sleep(0.01)
        cluster.kill("ps:0")
        if drop_state:
            for suffix in ("json", "tensors"):
                (rescue.copies_dir(run.plan.checkpoint_dir) / f"ps-0.{suffix}").unlink(missing_ok=True)
    run.wait(timeout=WAIT_S, verbose=False)
    if run.status != "finished":
        raise RuntimeError(f"run {run.id} {run.status}: {run.error}")
    from_step, sources = None, []
    if kill:
        events = run.events()
        detail = events[events["kind"] == "restarting"]["detail"].iloc[0]
        from_step, sources = detail["from_step"], detail["sources"]
        if any(s["optimizer_state"] == drop_state for s in sources):  # the deletion came after the rescue
            raise RuntimeError(f"the arm {'without' if drop_state else 'with'} state restarted from {sources}")
    return {"from_step": from_step, "metrics": run.metrics(), "sources": sources}


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("ps_state", "A lost ps's optimizer state: the loss 50 steps after a ps kill", tiny)
    kill_at = 150 if tiny else 400
    steps = kill_at + 250  # the window ends past the restart, however late the kill lands
    arms = {"undisturbed": [], "kept": [], "dropped": []}
    with tempfile.TemporaryDirectory() as folder:
        with procs.started_cluster(os.path.join(folder, "runs.sqlite")) as started:  # in a tiny run, the shared one
            for _ in range(repetitions(tiny)):  # the arms alternate: a slower spell of the machine hits all three
                arms["undisturbed"].append(one_run(started.cluster, steps, kill_at, kill=False))
                arms["kept"].append(one_run(started.cluster, steps, kill_at))
                arms["dropped"].append(one_run(started.cluster, steps, kill_at, drop_state=True))
    rows = []  # per killed run: its loss and the undisturbed run's of its repetition, at the same steps
    for arm, label in (("kept", "kept"), ("dropped", "restarted")):
        pairs = [(_loss_after(killed["metrics"], killed["from_step"]), _loss_after(still["metrics"],
                                                                                  killed["from_step"]))
                 for killed, still in zip(arms[arm], arms["undisturbed"])]
        rows.append((arm, label, pairs))
    notes = {"kept": "the ps's values from the workers' copies, its optimizer state from its copy",
             "dropped": "its state copy deleted before the rescue: the restart before state copies"}
    for arm, label, pairs in rows:
        result.rows.append(compare(f"Adam: loss 50 steps after a ps kill, its state {label}", f"state {label}",
                                   [p[0] for p in pairs], "undisturbed", [p[1] for p in pairs], "loss",
                                   note=notes[arm]))
    result.extra.update(losses={arm: pairs for arm, _, pairs in rows},
                        from_steps={arm: [r["from_step"] for r in arms[arm]] for arm in ("kept", "dropped")},
                        sources=[r["sources"] for r in arms["kept"]], kill_at=kill_at, lr=LR)
    lags = [r["from_step"] - s["optimizer_state_step"] for r in arms["kept"] for s in r["sources"]]
    result.notes.append(f"Sync Adam (lr {LR}) on the digits, 1 ps + 2 workers, the ps SIGKILLed at step {kill_at}; "
                        f"the loss is the mean over steps {AFTER - WINDOW // 2 + 1}-{AFTER + WINDOW // 2} after the "
                        f"restart's step. The kept state was {min(lags)}-{max(lags)} steps older than the values "
                        "it restarted with.")
    return result
