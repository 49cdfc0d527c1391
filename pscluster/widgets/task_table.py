"""The dashboard's table of tasks: each task's role, host, device, latest state and speed, from the run store's
record and events."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

FINAL = ("finished", "failed", "stopped")
ROLE_COLUMNS = ["role", "task", "host", "device", "state", "steps/s"]


def task_states(events) -> dict[str, str]:
    """The latest reported state of each task in ``events`` (a run-store answer, or its new rows as
    columns): its last 'state' event, or 'lost' / 'done'. Chunks of events give, one after the other,
    ``states.update(task_states(chunk))``, the same states as all of them at once."""
    states = {}
    for task, kind, detail in zip(events["task"], events["kind"], events["detail"]):
        if kind == "state":
            states[task] = detail.get("state", "?")
        elif kind in ("lost", "done"):
            states[task] = kind
    return states


def roles_frame(record: dict | None, rates: Mapping[int, float], states: Mapping[str, str]) -> pd.DataFrame:
    """The cluster's tasks: role (ps, chief for worker 0, worker), task, host, device, state and steps/s.

    ``rates``: recent steps/s of each worker (``panels.WorkerRates.recent``); ``states``: the latest state
    of each task (``task_states``: "waiting for chief", "training", "lost"...). Once the run is over, a
    task's state is the run's final status, except for tasks that were lost.
    """
    if not record or not record.get("spec"):
        return pd.DataFrame(columns=ROLE_COLUMNS)
    status = record["status"]
    rows = []
    for task in [*record["spec"].get("ps", []), *record["spec"].get("worker", [])]:
        name = f"{task['role']}:{task['index']}"
        is_worker = task["role"] == "worker"
        state = states.get(name) or ("serving" if status == "training" and not is_worker else status)
        if status in FINAL and state != "lost":
            state = status
        rows.append([("chief" if task["index"] == 0 else "worker") if is_worker else task["role"], name,
                     task.get("host", ""), task.get("device", ""), state,
                     rates.get(task["index"], np.nan) if is_worker else np.nan])
    return pd.DataFrame(rows, columns=ROLE_COLUMNS)
