"""The benchmark entry point (`make bench`) at its tiny size, so that it cannot rot: every benchmark runs,
writes its JSON with the machine, the load and its rows, and the README's tables are regenerated between
their markers with the hand-written text around them kept. Not timed: tiny sizes measure nothing.

It runs with ``make bench-check`` (PSCLUSTER_BENCH_CHECK=1, in CI after the suite), not in ``make test``: about two
minutes on 2 cores, a tenth of the suite, spent on the benchmarks rather than on pscluster."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import report
from benchmarks.run import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_tiny_run_writes_every_result_and_the_tables(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "benchmarks" / "README.md", readme)
    before = readme.read_text()
    hand_written = before[:before.index(report.BEGIN)] if report.BEGIN in before else before
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.run", "--tiny", "--out", str(out), "--readme", str(readme)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]

    for name in BENCHMARKS:
        data = json.loads((out / f"{name}.json").read_text())
        assert data["name"] == name and data["tiny"] is True
        assert {"cores", "cpu", "gpu", "memory_gib"} <= set(data["machine"])
        assert len(data["load_before"]) == 3 and len(data["load_after"]) == 3
        if name == "gpu" and not torch.cuda.is_available():
            assert data["skipped"] == "no CUDA GPU on this machine" and not data["rows"]
            continue
        assert data["rows"], f"{name} measured nothing"
        for row in data["rows"]:
            for side in ("a", "b", "ratio"):
                assert row[side]["n"] >= 1 and row[side]["median"] > 0, (name, row["case"], side)
            if row["target"] is not None:
                assert {"goal", "met", "margin"} <= set(row["target"])
    overlapped = json.loads((out / "overlap.json").read_text())["extra"]["overlapped_pushes"]
    assert overlapped and all(n > 0 for n in overlapped)  # the worker processes pushed during backward
    targets = {row["case"] for name in ("hidden", "peers", "memory", "overheads")
               for row in json.loads((out / f"{name}.json").read_text())["rows"] if row["target"]}
    assert {"784-256-10 MLP, batch 128, SGD, sync", "784-256-10 MLP, batch 128, SGD, async, pipelined",
            "sync vs DDP", "async vs RPC ps", "sync vs bare ZeroMQ ps", "async pipelined vs DDP",
            "start to ready", "training with the live dashboard"} <= targets

    text = readme.read_text()
    assert text.startswith(hand_written)
    generated = text[text.index(report.BEGIN):text.index(report.END)]
    for name in BENCHMARKS:
        assert f"### {name}: " in generated and f"{name}.json" in generated
    assert "tiny size" in generated
