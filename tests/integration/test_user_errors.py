"""The user's error first, and the workers' own output, on real engines: a ``train_fn`` that fails raises its error
with the user's frames and source lines first (an IPython cell named as IPython names it), and what it prints
reaches the caller, prefixed by its task."""

import re

import pytest
import torch
from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.testing.globalipapp import start_ipython
from ipykernel.compiler import XCachingCompiler

from pscluster.errors import TrainingError

pytestmark = pytest.mark.integration

NOTEBOOK_CELL = """import torch

def check(step):
    if step == 5:
        return 1 / 0

def train_fn(ctx):
    model = ctx.model(torch.nn.Linear(4, 2))
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(100):
        optimizer.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        check(step)
"""

MAGIC_CELL = """model = ctx.model(torch.nn.Linear(4, 2))
optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(100):
    optimizer.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert step < 5, "diverged"
"""


@pytest.fixture(scope="module")
def cluster(start_cluster):
    return start_cluster(ps=1, workers=2)


@pytest.fixture(scope="module")
def ip(cluster):
    """The process's IPython shell, with the magics following ``cluster``."""
    shell = get_ipython() or start_ipython()  # one shell a process: another module may have made it
    shell.run_cell("import torch")  # as a notebook's first cell does (the cells below use it)
    shell.run_line_magic("load_ext", "pscluster")
    magics = shell.magics_manager.registry["PSClusterMagics"]
    before, magics.cluster = magics.cluster, cluster
    yield shell
    magics.cluster = before


def pointed(lines: list[str], header: str) -> str:
    """The source line IPython points at (``---> 15 check(step)``) in the frame of ``header``."""
    frame = lines[lines.index(header) + 1:]
    return next(re.sub(r"^-+> \d+ +", "", line) for line in frame if line.startswith("-"))


def loop(ctx, *, fail_at=None, steps=100):
    model = ctx.model(torch.nn.Linear(4, 2))
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    print(f"hello from {ctx.worker_index}")
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        if step == fail_at:
            raise ValueError(f"bad batch at step {step}")
    print(f"bye from {ctx.worker_index}", end="")  # its last line, unended, printed as the worker ends


def failing_loop(ctx):
    loop(ctx, fail_at=3)


def printing_loop(ctx):
    loop(ctx, steps=5)


def test_a_loop_of_a_notebook_cell_raises_its_error_with_the_cells_lines_first(ip, cluster, monkeypatch):
    monkeypatch.setattr(ip, "compile", XCachingCompiler())  # a kernel's: cells are /tmp/ipykernel_<pid>/<hash>.py
    cell = ip.execution_count
    assert ip.run_cell(NOTEBOOK_CELL, store_history=True).success
    run = cluster.run(ip.user_ns["train_fn"], steps=50)
    with pytest.raises(TrainingError) as raised:
        run.wait(verbose=False)
    lines = str(raised.value).splitlines()
    assert lines[0] == f"ZeroDivisionError: division by zero (at Cell In[{cell}], line 5 in check) on workers 0, 1"
    assert lines[2] == f"Cell In[{cell}], line 14, in train_fn(ctx)"  # the user's frames first, outermost first
    assert pointed(lines, lines[2]) == "check(step)"
    assert pointed(lines, f"Cell In[{cell}], line 5, in check(step)") == "return 1 / 0"
    assert re.fullmatch(r"… called by \d+ frames of .*pscluster.*", lines[-1])
    # what IPython shows of it: the message, not the controller's frames that raised it
    assert raised.value._render_traceback_()[0] == f"{type(raised.value).__name__}: {lines[0]}"
    assert "run.py" not in "\n".join(raised.value._render_traceback_())
    # the engine's traceback, with the cell's lines under its file's name, which only the notebook's kernel knows
    assert "Cell In[" not in run.error and re.search(r"ipykernel_\d+/\d+\.py:5, in check\(step\)", run.error)
    assert "----> 5         return 1 / 0" in run.error


def test_a_loop_of_a_module_names_its_file_and_shows_its_line(cluster):
    run = cluster.run(failing_loop, steps=50)
    with pytest.raises(TrainingError) as raised:
        run.wait(verbose=False)
    lines = str(raised.value).splitlines()
    assert re.fullmatch(r"ValueError: bad batch at step 3 \(at File .*test_user_errors\.py:\d+ in loop\) "
                        r"on workers 0, 1", lines[0])
    assert lines[2].startswith("File ") and lines[2].endswith(", in failing_loop(ctx)")
    assert pointed(lines, lines[2]) == "loop(ctx, fail_at=3)"
    assert pointed(lines, next(line for line in lines if line.endswith(", in loop(ctx, fail_at, steps)"))) == \
        'raise ValueError(f"bad batch at step {step}")'


def test_what_each_worker_prints_reaches_the_caller_once_prefixed_by_its_task(cluster, capsys):
    run = cluster.run(printing_loop, steps=5).wait()
    out = capsys.readouterr().out.splitlines()
    assert not [line for line in out if line.startswith("hello")]  # train_fn never ran in this process
    for i in range(2):
        assert out.count(f"[worker:{i}] hello from {i}") == 1
        assert out.count(f"[worker:{i}] bye from {i}") == 1
        assert out.index(f"[worker:{i}] hello from {i}") < out.index(f"[worker:{i}] bye from {i}")
    assert run.logs.count("[worker:1] hello from 1") == 1


def test_a_pscluster_run_cell_that_fails_shows_one_line_and_the_cells_lines(ip):
    cell = ip.execution_count
    with pytest.raises(UsageError) as raised:
        ip.run_cell_magic("pscluster", "run --steps 50 --wait", MAGIC_CELL)
    lines = str(raised.value).splitlines()
    assert lines[0] == f"AssertionError: diverged (at Cell In[{cell}], line 8 in train_fn) on workers 0, 1"
    assert lines[2] == f"Cell In[{cell}], line 8, in train_fn(ctx)"  # line 1 is the magic's
    assert pointed(lines, lines[2]) == 'assert step < 5, "diverged"'
