"""The magics on real engines: start, a train cell, bad input that loses nothing, stop."""

import json
import time
import urllib.request

import pytest
from IPython.core.error import UsageError
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

from pscluster.cluster.reaper import alive
from pscluster.widgets import figures

pytestmark = pytest.mark.integration

TRAIN_CELL = """
import torch, pscluster
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
loss_fn = torch.nn.CrossEntropyLoss()
dataset = pscluster.datasets.digits("train")
"""

# a %%pscluster run cell: the body of train_fn(ctx), seeing the notebook's names (dataset, from TRAIN_CELL)
LOOP_CELL = """
net = ctx.model(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
optimizer = ctx.optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
for x, y in ctx.endless_shard(dataset, batch_size=32):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    ctx.log(loss=loss.item())
    if ctx.should_stop():
        break
"""


def wait_for(read, timeout: float = 60.0):
    """``read()`` once it returns something (TensorBoard loads the event files after it starts)."""
    deadline = time.monotonic() + timeout
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


@pytest.fixture(scope="module")
def ip():
    shell = get_ipython() or start_ipython()  # one shell a process: another module (tests/docs, unit) may have made it
    shell.run_line_magic("load_ext", "pscluster")
    yield shell
    magics = shell.magics_manager.registry["PSClusterMagics"]
    if magics.cluster is not None:
        magics.cluster.stop()


def test_magic_session(ip, capsys):
    cluster = ip.run_line_magic("pscluster", "start --ps 1 --workers 2")
    pids = cluster.pids
    with pytest.raises(UsageError, match="already running: %pscluster stop it first"):
        ip.run_line_magic("pscluster", "start --ps 1 --workers 1")
    with pytest.raises(UsageError, match="defines no `model`"):
        ip.run_cell_magic("pscluster", "train --steps 10", "loss_fn = None")
    with pytest.raises(UsageError, match="unrecognized arguments: --bogus"):
        ip.run_cell_magic("pscluster", "train --bogus", TRAIN_CELL)
    run = ip.run_cell_magic("pscluster", "train --mode sync --steps 40 --batch-size 32 --lr 0.1 --log-every 20 "
                            "--wait", TRAIN_CELL)
    assert run.global_step == 40 and run.local_steps == [40, 40]
    out = capsys.readouterr().out
    assert "[worker:1] After 20 training steps (20 global steps), loss" in out
    # the cell again with --resume: it goes on from the first run's final checkpoint, to 60 global steps
    resumed = ip.run_cell_magic("pscluster", f"train --mode sync --steps 60 --batch-size 32 --lr 0.1 --name {run.name} "
                                "--resume --wait", TRAIN_CELL)
    assert resumed.global_step == 60 and resumed.local_steps == [20, 20]
    assert resumed.events().query("kind == 'restored'")["detail"].tolist()[0]["step"] == 40
    # the run's event files, through TensorBoard's own API: each worker's and each ps's charts
    board = ip.run_line_magic("pscluster", "tensorboard")
    assert f"TensorBoard: {board.url}" in capsys.readouterr().out
    folder = f"run-{run.id}"  # an unnamed run's folder: its default name, run-<id>
    assert run.name == folder
    tags = {}

    def charted():  # TensorBoard loads each event file in its own time: one folder's tags may come first
        tags.update(json.loads(urllib.request.urlopen(board.url + "data/plugin/scalars/tags").read()))
        worker, ps = tags.get(f"{folder}/worker_0", {}), tags.get(f"{folder}/ps_0", {})
        return {"loss", "accuracy"} <= set(worker) and "lr" in ps

    assert wait_for(charted), f"TensorBoard's scalar tags: {tags}"
    # and the model's graph, traced on a batch of the dataset, in the chief's folder
    graphs = wait_for(lambda: json.loads(urllib.request.urlopen(board.url + "data/plugin/graphs/info").read()).get(
        f"{folder}/worker_0"))
    assert graphs["run_graph"] is True
    ip.run_line_magic("pscluster", "tensorboard --stop")
    assert not board.running
    with pytest.raises(UsageError, match="unknown optimizer 'nope'"):
        ip.run_cell_magic("pscluster", "train --optimizer nope", TRAIN_CELL)
    with pytest.raises(UsageError, match="pipeline=True with mode='sync': use mode='async'"):
        ip.run_cell_magic("pscluster", "train --pipeline", TRAIN_CELL)
    pipelined = ip.run_cell_magic("pscluster", "train --mode async --pipeline --steps 40 --batch-size 32 --lr 0.1 "
                                  "--wait", TRAIN_CELL)
    assert pipelined.plan.pipeline and pipelined.global_step == 40
    staleness = pipelined.staleness()
    assert sum(staleness.values()) == 40 and staleness.get(0, 0) <= 2  # only each worker's first push was fresh
    own = ip.run_cell_magic("pscluster", "run --mode async --steps 30 --log-every 10 --wait", LOOP_CELL)
    assert own.status == "finished" and own.global_step == 30 and own.plan.modules == ("Sequential",)
    assert own.metrics()["loss"].notna().all() and "nothing" not in ip.user_ns  # the cell's names are its own
    with pytest.raises(UsageError, match="does not parse: .* \\(line 3 of the cell\\)"):  # the magic's is line 1
        ip.run_cell_magic("pscluster", "run --steps 5", "x = 1\nfor")
    with pytest.raises(UsageError, match="train_fn reached no training step"):
        ip.run_cell_magic("pscluster", "run --steps 5", "nothing = ctx.model(torch.nn.Linear(2, 2))")
    plain = ip.run_cell_magic("pscluster", "train --no-overlap --steps 10 --batch-size 32 --lr 0.1 --wait", TRAIN_CELL)
    assert run.plan.overlap and not plain.plan.overlap and plain.global_step == 10
    assert ip.run_line_magic("pscluster", "status") is cluster and all(alive(p) for p in pids)
    assert run.evaluate(ip.user_ns["dataset"])["accuracy"] is not None  # still there after the errors
    ip.run_line_magic("pscluster", "stop")
    assert [p for p in pids if alive(p)] == []
    with pytest.raises(UsageError, match="run %pscluster start first"):
        ip.run_cell_magic("pscluster", "train", TRAIN_CELL)


def test_placement_magic_lists_shards_and_a_cell_that_does_not_wait_shows_its_run_s_end(ip, capsys):
    cluster = ip.run_line_magic("pscluster", "start --ps 2 --workers 1 --spares 1")
    try:
        # the start said what it did, stage by stage: 3 engines and the spare, roles, each ps serving
        stages = [line.split(": ", 2)[2].rsplit(" (", 1)[0] for line in capsys.readouterr().out.splitlines()
                  if line.startswith(f"{cluster.name}: 2 ps + 1 workers on local engines: ")]
        assert stages[0] == "starting the controller" and stages[-5:] == [
            "engines up 4 of 4, asking where each runs", "roles assigned, starting 2 ps", "ps serving 1 of 2",
            "ps serving 2 of 2", "ready"], stages
        counts = [int(s.split()[2]) for s in stages[1:-5]]
        assert stages[1:-5] == [f"engines up {n} of 4" for n in counts] and counts == sorted(counts), stages
        # a train cell without --wait: its value, the Run, says it trains, and shows its summary once it ends
        with capture_output() as shown:
            ip.run_cell("%%pscluster train --steps 30 --batch-size 16\n" + TRAIN_CELL)
            started = cluster.runs[-1]
            started.wait(timeout=120, verbose=False)
        of_run = ("is training", f">{started.name}</td>")  # the Run's line while it trains, its table after
        outputs = [o for o in shown.outputs if any(mark in o.data.get("text/html", "") for mark in of_run)]
        assert "is training" in outputs[0].data["text/html"] and not outputs[0].update
        assert outputs[-1].update and outputs[-1].transient == outputs[0].transient, outputs  # the same output
        assert "finished" in outputs[-1].data["text/html"] and ">30<" in outputs[-1].data["text/html"]
        run = ip.run_cell_magic("pscluster", "train --steps 4 --batch-size 16 --log-every 2 --placement greedy "
                                "--partition 0.weight=2 --wait", TRAIN_CELL)
        assert run.global_step == 4
        capsys.readouterr()
        # the dashboard's final update came before train --wait returned, never into a later cell's output
        time.sleep(1)
        ip.run_line_magic("pscluster", "placement")
        lines = capsys.readouterr().out.splitlines()
        assert lines == cluster.placement() and len(lines) == 5  # 0.weight in two shards, 0.bias, 2.*
        assert [line.split(" (")[0] for line in lines[:2]] == ["0.weight/part_0: /job:ps/task:0",
                                                               "0.weight/part_1: /job:ps/task:1"]
        assert "(rows 0-15, 4.0 KB)" in lines[0] and "(rows 16-31, 4.0 KB)" in lines[1]
        stored = cluster.store.placement(run.id)  # the run store keeps the shards' rows: the dashboard's lines
        assert figures.placement_lines(stored) == lines and list(stored["part"].iloc[:2]) == [0, 1]
    finally:
        ip.run_line_magic("pscluster", "stop")
