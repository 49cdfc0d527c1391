"""The benchmark suite's entry point (``make bench``): runs every benchmark, writes ``results/<name>.json``
for each and regenerates the tables of ``README.md``.

    python -m benchmarks.run [--tiny] [--only NAME ...] [--out DIR] [--readme PATH]

``--tiny``: every benchmark at a tiny size with one repetition, to check that it runs (its numbers mean
nothing), their children forked from one process that has imported torch and one cluster shared by those that
train on one (``procs.tiny_run``). The tables list every JSON file in ``--out``, so ``--only`` updates some and
keeps the others.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import (convnet, dashboard_scale, exchange, floor, gpu, hidden, input_pipeline, live_page, memory, overheads,
               overlap, peers, procs, ps_state, recovery, report, run_view, scaling, user_loop)
from .common import run_benchmark

BENCHMARKS = {"exchange": exchange.run, "hidden": hidden.run, "overlap": overlap.run, "peers": peers.run,
              "floor": floor.run, "convnet": convnet.run,
              "scaling": scaling.run, "overheads": overheads.run, "memory": memory.run,
              "input_pipeline": input_pipeline.run, "dashboard_scale": dashboard_scale.run, "recovery": recovery.run,
              "ps_state": ps_state.run, "run_view": run_view.run, "live_page": live_page.run, "gpu": gpu.run,
              "user_loop": user_loop.run}
HERE = Path(__file__).parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, one repetition: checks that it runs")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON results go")
    parser.add_argument("--readme", type=Path, default=HERE / "README.md", help="the file whose tables to regenerate")
    args = parser.parse_args(argv)
    failed = []
    with procs.tiny_run(args.tiny):
        for name in args.only:
            began = time.monotonic()
            print(f"{name}...", flush=True)
            data = run_benchmark(name, BENCHMARKS[name], args.tiny, args.out)
            if data["extra"].get("failed"):
                failed.append(name)
                print(f"  {data['skipped']}", flush=True)
            for row in data["rows"]:
                verdict = "" if not row["target"] else " met" if row["target"]["met"] else " MISSED"
                print(f"  {row['case']}: {row['ratio'].get('median', float('nan')):.3f}{verdict}", flush=True)
            print(f"  ({time.monotonic() - began:.0f} s)", flush=True)
    report.update_readme(args.readme, report.render(args.out, args.readme))
    print(f"results in {args.out}, tables in {args.readme}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see their JSON)")


if __name__ == "__main__":
    main()
