"""The benchmark entry point's bookkeeping (`make bench`): the README's tables replaced between their markers only, a
result measured elsewhere kept, a result in part replacing the earlier one. The tiny run of every benchmark is
``test_tiny_run.py``."""

from __future__ import annotations

import json

from benchmarks import report
from benchmarks.common import Result, compare, run_benchmark


def test_update_readme_replaces_only_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nhand-written\n")
    report.update_readme(readme, "table one")
    report.update_readme(readme, "table two")
    text = readme.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written\n")
    assert "table two" in text and "table one" not in text
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1


def test_a_benchmark_this_machine_cannot_run_keeps_the_result_measured_elsewhere(tmp_path):
    def measured(tiny, out_dir):
        result = Result("gpu", "on a GPU", tiny)
        result.rows.append(compare("case", "a", [2.0], "b", [4.0], "samples/s"))
        return result

    def no_gpu(tiny, out_dir):
        return Result("gpu", "on a GPU", tiny, skipped="no CUDA GPU on this machine")

    def broken(tiny, out_dir):
        raise RuntimeError("the benchmark itself broke")

    first = run_benchmark("gpu", measured, False, tmp_path)
    assert run_benchmark("gpu", no_gpu, False, tmp_path) == first
    assert json.loads((tmp_path / "gpu.json").read_text())["rows"][0]["ratio"]["median"] == 0.5
    failed = run_benchmark("gpu", broken, False, tmp_path)  # a failure is news: it replaces the result
    assert json.loads((tmp_path / "gpu.json").read_text()) == failed and failed["extra"]["failed"]


def test_a_benchmark_run_in_part_replaces_the_earlier_result_and_says_what_it_left_out(tmp_path):
    def measured(median):
        def run(tiny, out_dir):  # as exchange without Ray: its own rows, and the Ray step not run
            result = Result("exchange", "exchange", tiny, skipped="Ray step: Ray is not installed")
            result.rows.append(compare("case", "a", [median], "b", [4.0], "GB/s"))
            return result
        return run

    run_benchmark("exchange", measured(2.0), False, tmp_path)
    again = run_benchmark("exchange", measured(3.0), False, tmp_path)
    assert json.loads((tmp_path / "exchange.json").read_text()) == again
    assert again["rows"][0]["ratio"]["median"] == 0.75
    assert "Not run: Ray step: Ray is not installed" in report.table(again, "results")
