"""Data-plane throughput: fused push-pull round trips against 1 and 2 ps tasks, side by side.

    .venv/bin/python benchmarks/dataplane.py [--mb 16] [--rounds 30]

Prints one row per configuration and the 2-ps / 1-ps speed ratio (the gain of
sending to several ps before awaiting any reply). The ps tasks run in threads of
this process; on 2 cores they compete with the client for CPU, so read ratios,
not absolute numbers.
"""

from __future__ import annotations

import argparse
import time

import torch

from pscluster.runtime.client import PSClient
from pscluster.runtime.ps import ParameterServer
from pscluster.spec import ClusterSpec, TaskSpec


def measure(num_ps: int, megabytes: float, rounds: int) -> float:
    """Seconds per push-pull round trip of ``megabytes`` of float32 gradients split over ``num_ps``."""
    spec = ClusterSpec(ps=tuple(TaskSpec("ps", i) for i in range(num_ps)), workers=(TaskSpec("worker", 0),))
    servers = [ParameterServer(spec.key, index=i).start() for i in range(num_ps)]
    spec = spec.with_ps_ports([s.port for s in servers])
    numel = int(megabytes * 2**20 / 4 / num_ps)
    per_ps = {i: ([i], [torch.randn(numel)]) for i in range(num_ps)}
    configs = [{"mode": "async", "steps": 10**9, "replicas_to_aggregate": 1, "optimizer": "SGD",
                "optimizer_kwargs": {"lr": 0.0}, "names": [f"v{i}"]} for i in range(num_ps)]
    try:
        with PSClient(spec, task=0) as client:
            client.init(1, per_ps, configs)
            step = client.pull().step
            for _ in range(3):
                step = client.push_pull(step, per_ps).step
            start = time.perf_counter()
            for _ in range(rounds):
                step = client.push_pull(step, per_ps).step
            return (time.perf_counter() - start) / rounds
    finally:
        for s in servers:
            s.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0, help="gradient megabytes per step")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"{'ps':>3} {'MB/step':>8} {'ms/round trip':>14} {'MB/s (both ways)':>17}")
    times = {}
    for num_ps in (1, 2):
        t = times[num_ps] = measure(num_ps, args.mb, args.rounds)
        print(f"{num_ps:>3} {args.mb:>8.1f} {t * 1000:>14.1f} {2 * args.mb / t:>17.0f}")
    print(f"speed ratio 2 ps / 1 ps: {times[1] / times[2]:.2f}")


if __name__ == "__main__":
    main()
