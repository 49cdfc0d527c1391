"""A run's events as TensorBoard event files, read back by TensorBoard's own event reader."""

import json
import math
import socket
import urllib.request

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

from pscluster.errors import ClusterStateError
from pscluster.metrics.tensorboard import HISTOGRAM_STEPS, POINT_S, EventWriter, run_logdir
from pscluster.runtime.steps import traceable_inputs
from pscluster.tensorboard_server import TensorBoard


def read(logdir) -> EventMultiplexer:
    every = {event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0}  # 0: keep all, not a sample
    events = EventMultiplexer(size_guidance=every).AddRunsFromDirectory(str(logdir))
    events.Reload()
    return events


def step(worker: int, i: int, **fields) -> dict:
    return {"kind": "step", "task": f"worker:{worker}", "time": 1000.0 + i / 10, "local_step": i,
            "global_step": 2 * i + worker, "loss": 1.0 / i, "accuracy": 0.5 + worker / 10, "staleness": i % 3,
            **fields}


def test_each_task_is_a_run_of_curves_against_the_global_step(tmp_path):
    writer = EventWriter(tmp_path)
    for i in range(1, HISTOGRAM_STEPS + 21):
        writer.add_events([step(0, i, metrics={"auc": 0.7}), step(1, i),
                           {"kind": "ps", "task": "ps:0", "time": 1000.0 + i / 10, "step": 2 * i, "applied": 2 * i,
                            "bytes_in": 100 * i, "bytes_out": 50 * i, "waiting_for": [1], "lr": 0.1 / i},
                           {"kind": "log", "task": "worker:0", "line": "not charted"}])
        if i % 50 == 1:  # worker 1's loop on ctx.shard: an epoch of 50 steps
            writer.add_events([{"kind": "epoch", "task": "worker:1", "time": 1000.0 + i / 10, "epoch": i // 50 + 1,
                                "batches": 50, "global_step": 2 * i + 1}])
    writer.add_evaluation(240, 0.25, 0.95)
    writer.close()
    events = read(tmp_path)
    runs = events.Runs()
    assert sorted(runs) == ["eval", "ps_0", "worker_0", "worker_1"]
    assert set(runs["worker_0"]["scalars"]) == {"loss", "accuracy", "metrics/auc", "steps_per_s"}
    assert [(e.step, e.value) for e in events.Scalars("worker_1", "epoch")] == [(3, 1), (103, 2), (203, 3)]
    loss = events.Scalars("worker_1", "loss")
    assert [(e.step, e.value) for e in loss[:2]] == [(3, 1.0), (5, 0.5)] and len(loss) == HISTOGRAM_STEPS + 20
    assert events.Scalars("worker_0", "steps_per_s")[0].value == pytest.approx(10.0)  # 1 local step per 0.1 s
    assert events.Scalars("ps_0", "updates_per_s")[0].value == pytest.approx(20.0)
    assert math.isclose(events.Scalars("ps_0", "lr")[-1].value, 0.1 / (HISTOGRAM_STEPS + 20), rel_tol=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("eval", "accuracy")] == [(240, pytest.approx(0.95))]
    # the staleness of every applied gradient: one histogram per HISTOGRAM_STEPS steps, the rest at the end
    histograms = events.Histograms("worker_0", "staleness")
    assert [h.step for h in histograms] == [2 * HISTOGRAM_STEPS, 2 * (HISTOGRAM_STEPS + 20)]
    assert histograms[0].histogram_value.num == HISTOGRAM_STEPS and histograms[1].histogram_value.num == 20
    assert writer.errors == 0


def test_a_fast_workers_steps_are_charted_at_most_one_per_point_s_and_its_last_one_always(tmp_path):
    writer = EventWriter(tmp_path)
    per_s = 1000  # steps per second: 20 times more than charted
    writer.add_events([{"kind": "step", "task": "worker:0", "time": 1000.0 + i / per_s, "local_step": i,
                        "global_step": i, "loss": 1.0 / i, "staleness": 0} for i in range(1, 1001)])
    writer.close()
    events = read(tmp_path)
    steps = [e.step for e in events.Scalars("worker_0", "loss")]
    assert steps[0] == 1 and steps[-1] == 1000 and len(steps) <= 1 / POINT_S + 2
    assert all(b - a >= POINT_S * per_s - 1 for a, b in zip(steps[:-2], steps[1:-1]))
    assert sum(h.histogram_value.num for h in events.Histograms("worker_0", "staleness")) == 1000  # every one


def test_a_malformed_event_is_counted_and_the_rest_written(tmp_path):
    writer = EventWriter(tmp_path)
    writer.add_events([{"kind": "step", "task": "worker:0"}, step(0, 1)])
    writer.close()
    assert writer.errors == 1
    assert [e.value for e in read(tmp_path).Scalars("worker_0", "loss")] == [1.0]


def test_a_runs_folder_is_beside_its_store_named_for_it(tmp_path):
    assert run_logdir(tmp_path / "runs.sqlite", "lr sweep/0.1", 7) == tmp_path / "tensorboard" / "lr_sweep_0.1-7"
    # an unnamed run (its default name says its id already), and one named so by hand for another run
    assert run_logdir(tmp_path / "runs.sqlite", "run-7", 7) == tmp_path / "tensorboard" / "run-7"
    assert run_logdir(tmp_path / "runs.sqlite", "run-7", 9) == tmp_path / "tensorboard" / "run-7-9"


def test_tensorboard_serves_the_folder_and_a_busy_port_is_a_one_line_error(tmp_path):
    board = TensorBoard(tmp_path).start()
    try:
        assert json.loads(urllib.request.urlopen(board.url + "data/runs", timeout=30).read()) == []
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(ClusterStateError) as info:
                TensorBoard(tmp_path, port=taken.getsockname()[1]).start()
        message = str(info.value)
        assert "\n" not in message and "already in use" in message and "pick another port with --port" in message
    finally:
        board.stop()
    assert not board.running


class Residual(torch.nn.Module):
    """A model people train: conv, BatchNorm, a skip connection, two inputs."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 8 * 8 + 3, 10)

    def forward(self, image, extra):
        x = torch.relu(self.norm(self.conv(image))) + image
        return self.head(torch.cat([x.flatten(1), extra], dim=1))


class Untraceable(torch.nn.Module):
    def forward(self, x):
        return {"logits": x, "count": len(x.shape)}  # a dict with a plain int: torch.jit.trace refuses it


def test_the_model_graph_is_traced_on_a_batch_of_the_dataset_where_torch_can(tmp_path):
    batch = ((torch.randn(2, 1, 8, 8), torch.randn(2, 3)), torch.tensor([1, 2]))
    writer = EventWriter(tmp_path)
    assert writer.add_graph(Residual(), traceable_inputs(batch, None))
    assert not writer.add_graph(Untraceable(), (torch.randn(2, 3),)) and writer.errors == 1
    writer.close()
    graph = read(tmp_path).Graph("worker_0")
    ops = {node.op for node in graph.node}
    assert {"aten::_convolution", "aten::batch_norm", "aten::linear"} <= ops, ops
    # traced beside a run: closing the files as soon as the run ends (before the trace is done) waits for it
    later = EventWriter(tmp_path / "short_run")
    later.trace_graph(Residual(), traceable_inputs(batch, None))
    later.close()
    assert {node.op for node in read(tmp_path / "short_run").Graph("worker_0").node} == ops and not later.errors
    # what the default step cannot hand to torch.jit.trace: a step_fn's batch, keyword inputs
    assert traceable_inputs(batch, step_fn=lambda model, b: 0) is None
    assert traceable_inputs(({"x": torch.ones(1)}, torch.ones(1)), None) is None
    assert traceable_inputs((torch.ones(2, 3), torch.ones(2)), None)[0].shape == (2, 3)


def test_a_folder_that_cannot_be_written_is_one_warning_and_its_events_a_count(tmp_path, caplog):
    (tmp_path / "tensorboard").write_text("a file where the run's folder would be")
    logdir = tmp_path / "tensorboard" / "run-1"
    writer = EventWriter(logdir)
    for i in range(1, 11):
        writer.add_events([step(0, i), step(1, i), {"kind": "log", "task": "worker:0", "line": "not charted"}])
    writer.add_evaluation(20, 0.5, 0.9)
    assert [r.getMessage() for r in caplog.records] == [f"TensorBoard files under {logdir} could not be written: "
                                                        "[Errno 20] Not a directory; the run goes on without them"]
    caplog.clear()
    writer.close()  # never raises: the run goes on, and ends, without them
    assert writer.errors == 21  # each step and the evaluation, not the log lines, which are never charted
    assert [r.getMessage() for r in caplog.records] == [
        f"21 TensorBoard events in all could not be written under {logdir}"]


def test_events_after_close_are_counted_not_written_in_a_file_left_open(tmp_path):
    writer = EventWriter(tmp_path)
    writer.add_events([step(0, 1)])
    writer.close()
    files = sorted(tmp_path.rglob("events.out.tfevents.*"))
    writer.add_events([step(0, 2)])  # a batch the collector received as the run ended
    writer.add_evaluation(4, 0.5, 0.9)
    writer.close()
    assert sorted(tmp_path.rglob("events.out.tfevents.*")) == files and writer.errors == 2
    assert [e.step for e in read(tmp_path).Scalars("worker_0", "loss")] == [2]
