"""Training throughput with the live dashboard attached and refreshing, against without.

    .venv/bin/python benchmarks/dashboard_overhead.py [--pairs 12] [--window 3]

One long sync run (1 ps + 2 workers, digits MLP). While it trains, a Dashboard in this process (the
controller, as in a notebook) is switched off and on every ``--window`` seconds: the two kinds of
window alternate, side by side in one run, so a slower or faster phase of the machine weighs on both
alike. The speed of a window is its global steps per second (from the run store's per-step rows, the
first half second of the window left out), times the samples of a global step. Prints each pair, the
ratio of the medians (with / without; goal >= 0.97) and the spread of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

import pscluster
from pscluster.widgets import Dashboard

SETTLE_S = 0.5  # left out at the start of each window: the switch itself


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def window_speed(metrics, begin: float, end: float, samples_per_step: int) -> float:
    """Samples/s in [begin + SETTLE_S, end): global steps reached in that time span, per second."""
    rows = metrics[(metrics["time"] >= begin + SETTLE_S) & (metrics["time"] < end)]
    if len(rows) < 2:
        return float("nan")
    steps = rows["global_step"].max() - rows["global_step"].min()
    return steps * samples_per_step / (rows["time"].max() - rows["time"].min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12, help="windows of each kind")
    parser.add_argument("--window", type=float, default=3.0, help="seconds per window")
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="pscluster-bench-") + "/runs.sqlite"
    dataset = pscluster.datasets.digits("train")
    with pscluster.Cluster(ps=1, workers=2, store=store) as cluster:
        cluster.train(model_fn, dataset, torch.nn.CrossEntropyLoss(), lr=0.1, steps=600,
                      name="warm-up").wait(verbose=False)  # first runs on fresh engines are slower
        run = cluster.train(model_fn, dataset, torch.nn.CrossEntropyLoss(), lr=0.1, mode="sync",
                            steps=10**7, batch_size=64, name="dashboard on and off")
        while run.global_step < 200:  # past start-up
            time.sleep(0.1)
        dashboard = Dashboard(store, run.id)
        windows = []  # (kind, begin, end)
        for i in range(2 * args.pairs):
            kind = "with" if i % 2 else "without"
            if kind == "with":
                dashboard.start()
            begin = time.time()
            time.sleep(args.window)
            if kind == "with":
                dashboard.stop()
            windows.append((kind, begin, time.time()))
        refreshes = dashboard.refreshes
        run.stop().wait(verbose=False)
        metrics = run.metrics()
        per_step = run.plan.batch_size * run.plan.replicas_to_aggregate
    speeds = {"without": [], "with": []}
    for kind, begin, end in windows:
        speeds[kind].append(window_speed(metrics, begin, end, per_step))
    pairs = np.array(speeds["with"]) / np.array(speeds["without"])
    for k, ratio in enumerate(pairs):
        print(f"pair {k:2d}: without {speeds['without'][k]:8.0f}  with {speeds['with'][k]:8.0f} samples/s"
              f"  ratio {ratio:.3f}")
    ratio = statistics.median(speeds["with"]) / statistics.median(speeds["without"])
    q1, q3 = np.nanpercentile(pairs, [25, 75])
    print(f"{refreshes} dashboard refreshes in {args.pairs} windows of {args.window:.0f} s "
          f"({refreshes / (args.pairs * args.window):.1f} per second)")
    print(f"median with / without: {ratio:.3f} (goal >= 0.97); per-pair ratios: median "
          f"{np.nanmedian(pairs):.3f}, quartiles {q1:.3f}-{q3:.3f}")


if __name__ == "__main__":
    main()
