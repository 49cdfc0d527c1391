"""A run has one owner: its ``Supervisor`` alone changes its spec, plan, workers and outcome (recovery and
scaling decide, and ask it to); ``Run`` only reads them. Checked over every assignment in ``pscluster/`` and on
a ``Run``'s attributes."""

import ast
import inspect
from pathlib import Path

import pytest

import pscluster
from pscluster.cluster.engines import EngineSet
from pscluster.cluster.run import Run

PACKAGE = Path(pscluster.__file__).resolve().parent
# what the supervisor owns of a run
OWNED = {"spec", "plan", "worker_results", "retired_results", "closed", "stop_requested", "results", "ps_stats",
         "error", "error_line", "finished", "state_dict", "started"}
NOT_RUNS = {"self", "cluster"}  # a cluster keeps a spec of its own; other classes own attributes of these names


def targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return node.targets
    return []


def changed_attributes(path: Path) -> list[tuple[str, str, int]]:
    """``(object, attribute, line)`` of each assignment (or ``del``) to an attribute, or to an item of one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for target in targets(node):
            for t in ast.walk(target):
                if isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                    found.append((t.value.id, t.attr, node.lineno))
    return found


def test_only_the_supervisor_changes_what_it_owns_of_a_run():
    trespass = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name == "cluster/supervisor.py":
            continue
        for obj, attribute, line in changed_attributes(path):
            if attribute in OWNED and obj not in NOT_RUNS:
                trespass.append(f"{name}:{line} {obj}.{attribute}")
    assert not trespass, f"changed outside the run's supervisor: {trespass}"


def test_the_run_handle_assigns_nothing_the_supervisor_owns():
    run_module = PACKAGE / "cluster" / "run.py"
    changed = {attribute for obj, attribute, _ in changed_attributes(run_module) if obj == "self"}
    assert not changed & OWNED, f"Run assigns {sorted(changed & OWNED)}: the supervisor owns them"


@pytest.mark.parametrize("attribute", sorted(OWNED - {"worker_results", "retired_results", "closed",
                                                       "stop_requested", "state_dict"}))
def test_a_runs_handle_cannot_change_its_run(attribute):
    with pytest.raises(AttributeError):
        setattr(Run.__new__(Run), attribute, None)


# Processes are signalled where the engines' pids are kept, and by the launchers that started them (which alone
# know how one of theirs is killed: by pid, through its nanny, by cancelling its job), nowhere else: the rest of the
# package names a task by its engine (EngineSet.kill, .lost, .remove_engines), whatever host it runs on. The
# forkserver local engines come from, and the launched process standing for them, signal what they forked.
SIGNALLERS = {"cluster/engines.py", "cluster/reaper.py", "launch.py",  # launch.py: the processes it started itself
              "cluster/forkserver.py", "cluster/fork_request.py",
              *(f"cluster/launchers/{m}.py" for m in ("base", "local", "ssh", "mpi", "slurm", "ipp"))}
SIGNALLING_CALLS = {("os", "kill"), ("os", "killpg"), ("reaper", "kill_all"), ("psutil", "Process")}


def signalling_calls(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else None
            if (name, node.func.attr) in SIGNALLING_CALLS or node.func.attr in ("send_signal", "terminate"):
                found.append((f"{name}.{node.func.attr}", node.lineno))
    return found


def test_only_the_engine_set_signals_the_processes_of_a_cluster():
    offenders = [f"{path.relative_to(PACKAGE)}:{line} {call}"
                 for path in sorted(PACKAGE.rglob("*.py")) if str(path.relative_to(PACKAGE)) not in SIGNALLERS
                 for call, line in signalling_calls(path)]
    assert not offenders, f"signal processes through the EngineSet (engines.py): {offenders}"
    assert signalling_calls(PACKAGE / "cluster/engines.py"), "the check no longer sees the EngineSet's kill"
    for method in (EngineSet.lost, EngineSet.kill, EngineSet.remove_engines):  # callers name engines, not pids
        assert "pid" not in inspect.signature(method).parameters, method
