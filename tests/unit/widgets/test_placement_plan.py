"""Cluster.plan: the placement a run would get, on a cluster that is never started."""

import math
import subprocess
import sys

import plotly.graph_objects as go
import pytest
import torch

import pscluster
from pscluster.widgets import live
from pscluster.widgets.placement_plan import PlacementPlan, compare_placements
from pscluster.errors import ConfigError

WIDGET = "application/vnd.jupyter.widget-view+json"


def unequal():
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 10), torch.nn.Linear(10, 10))


MODEL_BYTES = 4 * (512 * 512 + 512 + 512 * 10 + 10 + 10 * 10 + 10)


@pytest.fixture(scope="module")
def cluster():
    return pscluster.Cluster(ps=2, workers=1)


def test_plan_needs_no_running_cluster(cluster):
    plan = cluster.plan(unequal)
    assert isinstance(plan, PlacementPlan) and not cluster.running and cluster.pids == []
    assert [v.name for v in plan.shards] == [n for n, _ in unequal().named_parameters()]
    assert plan.lines[:2] == ["0.weight: /job:ps/task:0", "0.bias: /job:ps/task:1"]  # round-robin by default
    assert plan.label == "round_robin"


def test_greedy_beats_round_robin_on_unequal_layers(cluster):
    rr, greedy = cluster.plan(unequal), cluster.plan(unequal, placement="greedy")
    assert max(greedy.bytes_per_ps) < max(rr.bytes_per_ps) and greedy.imbalance < rr.imbalance
    # greedy: the big weight alone on one ps, everything else on the other
    assert [v.ps for v in greedy.shards] == [0, 1, 1, 1, 1, 1]
    table = compare_placements({"round-robin": rr, "greedy": greedy})
    assert list(table["placement"]) == ["round-robin", "greedy"]
    assert list(table["max bytes per ps"]) == [max(rr.bytes_per_ps), max(greedy.bytes_per_ps)]
    assert table["imbalance (max/mean)"].iloc[0] > table["imbalance (max/mean)"].iloc[1] >= 1.0
    assert list(compare_placements([rr, greedy])["placement"]) == ["round_robin", "greedy"]
    with pytest.raises(ConfigError, match="takes PlacementPlans"):
        compare_placements({"a": "round_robin"})


class Seed004(torch.nn.Module):
    """The TF 1.x talk's example of load balancing (seed 004): four variables in creation order."""

    def __init__(self):
        super().__init__()
        self.weights_1 = torch.nn.Parameter(torch.zeros(784, 100))
        self.biases_1 = torch.nn.Parameter(torch.zeros(100))
        self.weights_2 = torch.nn.Parameter(torch.zeros(100, 10))
        self.biases_2 = torch.nn.Parameter(torch.zeros(10))


def test_the_tensorflow_talks_example_places_as_replica_device_setter_and_its_greedy_strategy_do():
    cluster = pscluster.Cluster(ps=3, workers=1)
    assert cluster.plan(Seed004).lines == ["weights_1: /job:ps/task:0", "biases_1: /job:ps/task:1",
                                           "weights_2: /job:ps/task:2", "biases_2: /job:ps/task:0"]
    # GreedyLoadBalancingStrategy: "each of the weight matrices is put on a separate PS task"
    assert cluster.plan(Seed004, placement="greedy").lines == [
        "weights_1: /job:ps/task:0", "biases_1: /job:ps/task:1", "weights_2: /job:ps/task:2",
        "biases_2: /job:ps/task:1"]
    # the optimizer's slots live beside their variable, listed as TF's device log lists weights_1/Adam
    assert cluster.plan(Seed004, placement="greedy", optimizer="adam").lines[:4] == [
        "weights_1: /job:ps/task:0", "weights_1/exp_avg: /job:ps/task:0", "weights_1/exp_avg_sq: /job:ps/task:0",
        "biases_1: /job:ps/task:1"]


@pytest.mark.parametrize("optimizer, kwargs, slots", [("sgd", {}, 0), ("SGD", {"momentum": 0.9}, 1),
                                                       ("Adam", {}, 2), (torch.optim.Adagrad, {}, 1)])
def test_table_totals_are_the_model_bytes_times_one_plus_slots(cluster, optimizer, kwargs, slots):
    plan = cluster.plan(unequal, placement="greedy", optimizer=optimizer, **kwargs)
    table = plan.table
    assert list(table.columns) == ["ps", "variables", "parameters", "bytes", "optimizer bytes", "total bytes",
                                   "share (%)"]
    assert list(table["ps"]) == [0, 1] and table["variables"].sum() == 6
    assert plan.slots == slots and table["bytes"].sum() == MODEL_BYTES
    assert table["parameters"].sum() == MODEL_BYTES // 4
    assert table["optimizer bytes"].sum() == MODEL_BYTES * slots
    assert table["total bytes"].sum() == MODEL_BYTES * (1 + slots) == sum(plan.bytes_per_ps)
    assert table["share (%)"].sum() == pytest.approx(100)


def test_the_figure_stacks_predicted_bytes_per_ps_with_optimizer_state(cluster):
    plan = cluster.plan(unequal, partition={"0.weight": 2}, optimizer="adam")
    per_ps = {}
    for trace in plan.figure.data:
        per_ps[trace.x[0]] = per_ps.get(trace.x[0], 0) + trace.y[0]
    assert per_ps == {f"ps:{i}": b for i, b in enumerate(plan.bytes_per_ps)}
    assert [t.name for t in plan.figure.data][:2] == ["0.weight/part_0", "0.weight/part_1"]
    go.Figure(plan.figure.to_dict())  # built unvalidated: must pass validation


def test_partitioned_lines_show_rows_and_size(cluster):
    plan = cluster.plan(unequal, partition={"0": 2})  # a prefix: 0.weight and 0.bias
    assert plan.lines[:4] == ["0.weight/part_0: /job:ps/task:0 (rows 0-255, 512.0 KB)",
                              "0.weight/part_1: /job:ps/task:1 (rows 256-511, 512.0 KB)",
                              "0.bias/part_0: /job:ps/task:0 (rows 0-255, 1.0 KB)",
                              "0.bias/part_1: /job:ps/task:1 (rows 256-511, 1.0 KB)"]
    assert list(plan.frame["part"].iloc[:4]) == [0, 1, 0, 1] and plan.frame["part"].iloc[4:].isna().all()
    assert plan.label == "round_robin + 0=2"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"placement": "best"}, "unknown placement 'best'"),
    ({"partition": {"embedding": 2}}, "partition names ['embedding'], which match no variable"),
    ({"placement": {"fc.weight": 0}}, "explicit placement names ['fc.weight']"),
    ({"placement": {"0.weight": 5}}, "use a ps task in 0..1"),
    ({"partition": {"0.weight": 0}}, "shards=0: use an integer >= 1"),
    ({"optimizer": "nope"}, "unknown optimizer 'nope'"),
], ids=["strategy", "partition", "explicit-name", "explicit-ps", "shards", "optimizer"])
def test_bad_input_is_a_one_line_config_error(cluster, kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        cluster.plan(unequal, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_models_are_refused(cluster):
    with pytest.raises(ConfigError, match="must be a torch.nn.Module"):
        cluster.plan(42)
    with pytest.raises(ConfigError, match="no parameters"):
        cluster.plan(torch.nn.ReLU())


def test_displays_table_lines_and_a_figure_that_loads_plotlyjs(cluster):
    plan = cluster.plan(unequal, placement="greedy", partition={"0.weight": 2})
    html = plan._repr_html_()
    assert "plotly.js v" not in html and html.count(live.STATIC_CALL) == 1 and "loadPlotly()" in html
    assert "total bytes" in html and "0.weight/part_1: /job:ps/task:1 (rows 256-511, 512.0 KB)" in html
    assert html.index("<table") < html.index(live.STATIC_CALL)  # table and lines, then the figure
    bundle = plan._repr_mimebundle_()
    assert WIDGET in bundle and bundle["text/html"].count(live.STATIC_CALL) == 1
    assert "imbalance" in repr(plan) and plan.lines[0] in repr(plan)


def test_public_placement_module():
    assert pscluster.placement.greedy is pscluster.placement.resolve_strategy("greedy")
    assert pscluster.placement.largest_first is pscluster.placement.resolve_strategy("largest-first")
    assert pscluster.placement.PlacementPlan is PlacementPlan
    assert pscluster.placement.compare_placements is compare_placements
    for name in pscluster.placement.__all__:
        assert getattr(pscluster.placement, name) is not None
    shards = pscluster.placement.shard_map([pscluster.placement.Variable("e.weight", (10, 4))], 2,
                                           partition={"e": pscluster.placement.fixed_shards(2)})
    assert [s.placement for s in shards] == ["e.weight/part_0: /job:ps/task:0 (rows 0-4, 80 B)",
                                             "e.weight/part_1: /job:ps/task:1 (rows 5-9, 80 B)"]
    assert pscluster.placement.bytes_per_ps(shards, 2, 1) == [160, 160]
    assert math.isclose(sum(pscluster.placement.bytes_per_ps(shards, 2)), 160)


def test_the_placement_module_loads_no_plotting_or_notebook_modules():
    probe = ("import sys, pscluster.placement; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'plotly', 'IPython', 'ipywidgets', "
             "'ipyparallel'}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
