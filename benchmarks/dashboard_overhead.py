"""Training throughput with the live dashboard attached and refreshing, against without.

    .venv/bin/python benchmarks/dashboard_overhead.py [--trials 3] [--steps 400]

One cluster (1 ps + 2 workers, digits MLP, sync); after a warm-up run, trials
alternate without / with a Dashboard refreshing from the run store at its default
rate in this process (the controller, as in a notebook). Prints samples/s per trial and the ratio of
the medians (with / without); the goal is >= 0.97.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

import pscluster
from pscluster.widgets import Dashboard


def model_fn():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def samples_per_sec(run) -> float:
    """Steady-state speed: global steps per second after the first fifth of the run (start-up skew
    between engines would otherwise dominate), from the run store's per-step metrics, times the samples
    of a global step. Global steps, not row counts, so a metric batch the collector dropped changes nothing."""
    m = run.metrics().sort_values("time")
    steady = m[m["global_step"] >= run.plan.steps // 5]
    first, last = steady.iloc[0], steady.iloc[-1]
    per_step = run.plan.batch_size * run.plan.replicas_to_aggregate
    return (last["global_step"] - first["global_step"]) * per_step / (last["time"] - first["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials of each kind")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="pscluster-bench-") + "/runs.sqlite"
    dataset = pscluster.datasets.digits("train")
    speeds: dict[str, list[float]] = {"without": [], "with": []}
    with pscluster.Cluster(ps=1, workers=2, store=store) as cluster:
        cluster.train(model_fn, dataset, torch.nn.CrossEntropyLoss(), lr=0.1, steps=args.steps,
                      name="warm-up").wait(verbose=False)  # first runs on fresh engines are slower
        for trial in range(2 * args.trials):
            kind = "with" if trial % 2 else "without"
            run = cluster.train(model_fn, dataset, torch.nn.CrossEntropyLoss(), lr=0.1, mode="sync",
                                steps=args.steps, batch_size=64, name=f"{kind}-{trial}")
            dashboard = Dashboard(store, run.id).start() if kind == "with" else None
            run.wait(verbose=False)
            if dashboard is not None:
                dashboard.stop()
            speeds[kind].append(samples_per_sec(run))
            dropped = sum(r["metrics_dropped"] for r in run.results)
            print(f"trial {trial}: dashboard {kind:>7}: {speeds[kind][-1]:8.0f} samples/s "
                  f"({dropped} metric events dropped)")
    ratio = statistics.median(speeds["with"]) / statistics.median(speeds["without"])
    print(f"median with / without: {ratio:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
