"""Training throughput with the live dashboard attached and refreshing, against without.

    PSCLUSTER_HOME=/tmp/bench .venv/bin/python benchmarks/dashboard_overhead.py [--pairs 30] [--window 2] [--control]

One long sync run (1 ps + 2 workers, digits MLP, batch 64). While it trains, a Dashboard in this process
(the controller, as in a notebook) is switched on and off: ``--pairs`` pairs of ``--window``-second
windows, one of each kind, in an order that alternates from pair to pair (without then with, with then
without...), so that a machine getting slower or faster during the run weighs on both kinds alike. The
speed of a window is its global steps per second (from the run store's per-step rows, the first quarter
second of the window left out: the switch itself), times the samples of a global step.

Prints each pair; the median of the per-pair ratios (with / without; goal >= 0.97) with its quartiles
and a 90% bootstrap interval; the ratio of the medians of each kind; the dashboard's refreshes per second
and CPU time per refresh; and the machine, with its load before and after. With ``--control``, the
dashboard stays off in both kinds of window: the spread of the ratios is then the measurement's own.
``make bench`` runs a short version of it (``overheads.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import pscluster
from pscluster.widgets import Dashboard

from benchmarks import procs  # absolute: this file also runs as a script
from benchmarks.common import machine

SETTLE_S = 0.25  # left out at the start of each window: the switch itself


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def window_speed(metrics, begin: float, end: float, samples_per_step: int) -> float:
    """Samples/s in [begin + SETTLE_S, end): global steps reached in that time span, per second."""
    rows = metrics[(metrics["time"] >= begin + SETTLE_S) & (metrics["time"] < end)]
    if len(rows) < 2:
        return float("nan")
    steps = rows["global_step"].max() - rows["global_step"].min()
    return steps * samples_per_step / (rows["time"].max() - rows["time"].min())


def bootstrap_interval(values: np.ndarray, *, draws: int = 5000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of ``values`` resampled with replacement."""
    medians = np.median(np.random.default_rng(seed).choice(values, (draws, len(values))), axis=1)
    return tuple(np.percentile(medians, [5, 95]))


def measure(pairs: int, window: float, *, control: bool = False, warmup_steps: int = 600) -> dict:
    """Samples/s of each window by kind (``with`` / ``without``, one value per pair), and the dashboard's
    ``refreshes`` and ``cpu_s`` over the windows; on a cluster just started (in a tiny run, the one it shares:
    ``procs.started_cluster``) that first trains a warm-up run of ``warmup_steps`` (none with 0)."""
    store = tempfile.mkdtemp(prefix="pscluster-bench-") + "/runs.sqlite"
    dataset = pscluster.datasets.digits("train")
    with procs.started_cluster(store) as started:
        cluster = started.cluster
        if warmup_steps:  # first runs on fresh engines are slower
            cluster.train(model_fn, dataset, torch.nn.CrossEntropyLoss(), lr=0.1, steps=warmup_steps,
                          name="warm-up").wait(verbose=False)
        run = cluster.train(model_fn, dataset, torch.nn.CrossEntropyLoss(), lr=0.1, mode="sync",
                            steps=10**7, batch_size=64, name="dashboard on and off")
        while run.global_step < 200:  # past start-up
            time.sleep(0.1)
        dashboard = Dashboard(cluster.store.path, run.id)
        dashboard.refresh()  # attached: its widgets hold the run so far
        first_refreshes, first_cpu = dashboard.refreshes, dashboard.cpu_s
        windows = []  # (pair, kind, begin, end)
        for pair in range(pairs):
            for kind in ("without", "with") if pair % 2 == 0 else ("with", "without"):
                attached = kind == "with" and not control
                if attached:
                    dashboard.start()
                begin = time.time()
                time.sleep(window)
                if attached:
                    dashboard.stop()
                windows.append((pair, kind, begin, time.time()))
        refreshes, cpu_s = dashboard.refreshes - first_refreshes, dashboard.cpu_s - first_cpu
        run.stop().wait(verbose=False)
        metrics = run.metrics()
        per_step = run.plan.batch_size * run.plan.replicas_to_aggregate
    speeds = {"without": np.full(pairs, np.nan), "with": np.full(pairs, np.nan)}
    for pair, kind, begin, end in windows:
        speeds[kind][pair] = window_speed(metrics, begin, end, per_step)
    return {"with": speeds["with"], "without": speeds["without"], "refreshes": refreshes, "cpu_s": cpu_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30, help="pairs of windows, one of each kind (at least 5)")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per window")
    parser.add_argument("--control", action="store_true", help="the dashboard off in both kinds of window")
    args = parser.parse_args()
    if args.pairs < 5 or args.window <= 2 * SETTLE_S:
        parser.error(f"give --pairs >= 5 and --window > {2 * SETTLE_S} s")
    load_before = os.getloadavg()
    speeds = measure(args.pairs, args.window, control=args.control)
    load_after = os.getloadavg()
    ratios = speeds["with"] / speeds["without"]
    for pair, ratio in enumerate(ratios):
        print(f"pair {pair:2d}: without {speeds['without'][pair]:8.0f}  with {speeds['with'][pair]:8.0f} "
              f"samples/s  ratio {ratio:.3f}")
    ratios = ratios[np.isfinite(ratios)]
    q1, q3 = np.percentile(ratios, [25, 75])
    low, high = bootstrap_interval(ratios)
    of_medians = statistics.median(speeds["with"][np.isfinite(speeds["with"])]) / \
        statistics.median(speeds["without"][np.isfinite(speeds["without"])])
    refreshes, cpu_s = speeds["refreshes"], speeds["cpu_s"]
    print(f"dashboard: {refreshes} refreshes in {args.pairs} windows of {args.window:g} s "
          f"({refreshes / (args.pairs * args.window):.1f} per second), "
          f"{1000 * cpu_s / max(refreshes, 1):.1f} ms CPU per refresh")
    print(f"with / without, median of {len(ratios)} per-pair ratios: {np.median(ratios):.3f} (goal >= 0.97); "
          f"quartiles {q1:.3f}-{q3:.3f}; 90% bootstrap interval {low:.3f}-{high:.3f}")
    print(f"ratio of the medians: {of_medians:.3f}" + (" (control: the dashboard was off all along)" if args.control
                                                       else ""))
    m = machine()
    print(f"machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']:g} GiB, {m['gpu'] or 'CPU only'}, {m['os']}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")


if __name__ == "__main__":
    main()
