"""Session-wide safety net: no engine, controller or ps process outlives the test run."""

import os
import shutil
import tempfile

import psutil
import pytest

os.environ.setdefault("IPP_NONINTERACTIVE", "1")
# Run stores and registries of the tests go to a fresh directory, never the user's; removed at the end (below: the
# fault matrix's checkpoints alone fill 6 GB a session)
HOME = os.environ["PSCLUSTER_HOME"] = tempfile.mkdtemp(prefix="pscluster-tests-")
# the fault matrix has its own target (make faults): about 15 minutes more than the suite
collect_ignore = [] if os.environ.get("PSCLUSTER_FAULT_MATRIX") else ["faults"]
# the wheel check has its own target too (make wheel-check): it builds a venv from nothing
collect_ignore += [] if os.environ.get("PSCLUSTER_WHEEL") else ["packaging"]
# and the tiny run of every benchmark (make bench-check): the benchmarks' own test, not pscluster's
collect_ignore += [] if os.environ.get("PSCLUSTER_BENCH_CHECK") else ["bench/test_tiny_run.py"]


def _leftovers() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


@pytest.fixture(scope="session", autouse=True)
def reap_leftover_processes():
    """Kill (and report) any child process the tests left behind, then remove the tests' ``PSCLUSTER_HOME``."""
    yield
    from pscluster.cluster import forkserver

    forkserver.stop()  # it serves every local cluster of the session
    left = _leftovers()
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    if left:
        print("\nreaped leftover processes:", ", ".join(f"{p.pid}" for p in left))
    shutil.rmtree(HOME, ignore_errors=True)  # every process that wrote there is gone
