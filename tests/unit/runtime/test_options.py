"""Every option of a run has one definition (``pscluster.runtime.options``): each way into a run takes the same
names with the same defaults from it (the API's keywords, the magics' and ``pscluster launch``'s flags, a script's
loop), carries them in one value (``RunOptions``) to the workers and the ps tasks, stores and shows them, and a bad
value is the same one-line error wherever it is given."""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pscluster.cluster.handle import Cluster
from pscluster.cluster.script_run import train_from_environment
from pscluster.errors import ConfigError
from pscluster.magics.parsers import parsers
from pscluster.runtime import options
from pscluster.runtime.options import OPTIONS, PLAN, RunOptions
from pscluster.runtime.plan import PsConfig, TrainPlan

MAGIC_ONLY = {"wait", "lr", "momentum", "opt", "step_fn", "scheduler", "scheduler_opt", "reuse", "help"}

# A process in which the table has one more option, ``probe_level``, added before anything else reads it (as if
# it were written in options.py): every entry takes it, the plan carries it to a worker (the JSON an engine gets)
# and to a real ps (its INIT), the store keeps it and the side panel's service shows it. Prints what each saw.
PROBE = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    import torch
    from pscluster.runtime import options as o
    o.OPTIONS["probe_level"] = o.Option("probe_level", 3, "a probe", o.EVERY, int, least=0, shown=True)
    import inspect
    from pscluster import launch
    from pscluster.cluster import run_records
    from pscluster.cluster.handle import Cluster
    from pscluster.cluster.script_run import train_from_environment
    from pscluster.labserver.service import _hyperparameters
    from pscluster.magics.parsers import parsers
    from pscluster.metrics.store import RunStore
    from pscluster.runtime.client import PSClient
    from pscluster.runtime.context import loop_plan
    from pscluster.runtime.optim import OptimizerSpec
    from pscluster.runtime.plan import PsConfig, TrainPlan, training_plan
    from pscluster.runtime.ps import ParameterServer
    from pscluster.spec import ClusterSpec, TaskSpec

    seen = {}
    for entry in (Cluster.train, Cluster.session, train_from_environment):
        seen[entry.__qualname__] = inspect.signature(entry).parameters["probe_level"].default
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    plan = training_plan(model, data, {"probe_level": 5, "lr": 0.1}, entry=o.TRAIN, of=Cluster.train, num_ps=1,
                         num_workers=1).plan
    seen["train plan"] = plan.probe_level
    for entry in (o.RUN, o.SESSION, o.SCRIPT):
        given = o.RunOptions.take(entry, {"probe_level": 6}, caller="f()")
        seen[entry] = loop_plan(model, ("Linear",), [OptimizerSpec("SGD", {"lr": 0.1})], given, num_ps=1,
                                num_workers=1).probe_level
    for command in ("train", "run"):
        seen["%%pscluster " + command] = o.from_flags(parsers()[command].parse_args(["--probe-level", "7"]),
                                                      o.TRAIN if command == "train" else o.RUN)["probe_level"]
    seen["pscluster launch"] = launch.typed_options(["--probe-level", "8", "script.py"])["probe_level"]
    seen["worker"] = TrainPlan.from_json(plan.to_json()).probe_level
    spec = ClusterSpec(ps=(TaskSpec("ps", 0),), workers=(TaskSpec("worker", 0),))
    server = ParameterServer(spec.key).start()
    try:
        spec = spec.with_ps_ports([server.port])
        with PSClient(spec, run_id=plan.run_id, timeout=30) as client:
            client.init(plan.run_id, {0: ([0, 1], [t.detach() for t in model.state_dict().values()])},
                        [PsConfig.for_ps(plan, 0).to_dict()])
            seen["ps"] = client.stats()[0]["options"]["probe_level"]
    finally:
        server.shutdown()
    store = RunStore(Path(tempfile.mkdtemp()) / "runs.sqlite")
    recorded, _ = run_records.create_run(store, plan, name="probe", cluster="c", spec={}, code=None,
                                         default_dir=lambda run_id: Path(store.path).parent / str(run_id))
    config = store.run(recorded.run_id)["config"]
    seen["stored"] = config["probe_level"]
    seen["shown"] = _hyperparameters(config).get("probe_level")
    print(json.dumps(seen))
""")


def test_an_option_added_to_the_table_reaches_every_entry_the_worker_the_ps_the_store_and_the_views(tmp_path):
    env = {**os.environ, "PSCLUSTER_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"Cluster.train": 3, "Cluster.session": 3, "train_from_environment": 3, "train plan": 5,
                    options.RUN: 6, options.SESSION: 6, options.SCRIPT: 6, "%%pscluster train": 7,
                    "%%pscluster run": 7, "pscluster launch": 8, "worker": 5, "ps": 5, "stored": 5, "shown": 5}


@pytest.mark.parametrize("entry, function", [(options.TRAIN, Cluster.train), (options.SESSION, Cluster.session),
                                             (options.TRAIN_SCRIPT, train_from_environment)],
                         ids=["Cluster.train", "Cluster.session", "train_from_environment"])
def test_an_entry_s_keywords_are_its_options_with_their_defaults_and_help(entry, function):
    parameters = inspect.signature(function).parameters  # a session's optimizer argument is not the option
    listed = {name: p.default for name, p in parameters.items()
              if name in OPTIONS and p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert listed == {name: OPTIONS[name].default_for(entry) for name in options.names(entry)}
    assert all(OPTIONS[name].help in function.__doc__ for name in listed)


@pytest.mark.parametrize("entry", [options.RUN, options.SCRIPT], ids=["Cluster.run", "pscluster.init"])
def test_a_user_s_loop_takes_its_options_by_name_with_their_defaults(entry):
    taken = RunOptions.take(entry, {"steps": 7}, caller="f()")
    assert dict(taken) == {**{name: OPTIONS[name].default_for(entry) for name in options.names(entry)}, "steps": 7}
    assert taken.steps == 7 and taken.of(PLAN).keys() <= {n for n, o in OPTIONS.items() if o.scope == PLAN}
    with pytest.raises(ConfigError, match=r"^f\(\) got unknown option 'step': did you mean 'steps'\?$"):
        RunOptions.take(entry, {"step": 7}, caller="f()")
    with pytest.raises(ConfigError, match=r"^f\(\) got unknown option 'batch_size'"):
        RunOptions.take(entry, {"batch_size": 7}, caller="f()")
    with pytest.raises(AttributeError, match="use replace"):
        taken.steps = 8


@pytest.mark.parametrize("command, entry", [("train", options.TRAIN), ("run", options.RUN)])
def test_a_magic_s_flags_are_its_entry_s_options_with_their_defaults(command, entry):
    parser = parsers()[command]
    flags = {a.dest: a.default for a in parser._actions if a.dest not in MAGIC_ONLY}
    assert sorted(flags) == sorted(options.names(entry))
    for name, default in flags.items():
        expected = [] if OPTIONS[name].flag.many else OPTIONS[name].default_for(entry)  # repeated flags collect a list
        assert default == expected, name
    parsed = options.from_flags(parser.parse_args([]), entry)
    assert parsed == {name: OPTIONS[name].default_for(entry) for name in options.names(entry)}


def test_flags_give_each_kind_of_option():
    parser = parsers()["train"]
    args = parser.parse_args(["--mode", "ssp", "--steps", "30", "--max-grad-norm", "0.5", "--no-overlap",
                              "--pin-memory", "--resume", "--partition", "emb=2", "--partition", "head=3",
                              "--placement", "greedy", "--checkpoint-secs", "60"])
    given = options.from_flags(args, options.TRAIN)
    assert (given["mode"], given["steps"], given["max_grad_norm"], given["overlap"], given["pin_memory"],
            given["resume"], given["partition"], given["placement"], given["checkpoint_secs"]) == \
        ("ssp", 30, 0.5, False, True, "latest", {"emb": 2, "head": 3}, "greedy", 60.0)
    with pytest.raises(ConfigError, match=r"^--staleness-bound -1: use an integer >= 0"):
        options.from_flags(parser.parse_args(["--staleness-bound", "-1"]), options.TRAIN)
    with pytest.raises(ConfigError, match="invalid choice: 'bsp'"):
        parser.parse_args(["--mode", "bsp"])


def test_the_plan_carries_every_option_its_tasks_read_at_its_default_or_as_given():
    plan = TrainPlan.of(run_id=1, optimizer="SGD", num_workers=3, seed=4)
    assert set(plan.options) == {name for name, o in OPTIONS.items() if o.scope == PLAN}
    assert plan.seed == 4 and plan.replicas_to_aggregate == 3  # one gradient per worker unless given
    assert all(plan.options[name] == o.default for name, o in OPTIONS.items()
               if o.scope == PLAN and name not in ("seed", "replicas_to_aggregate"))
    config = PsConfig.for_ps(plan, 0)
    assert PsConfig.from_dict(json.loads(json.dumps(config.to_dict()))).options == config.options
    with pytest.raises(ValueError, match="carries the run options the ps tasks and workers read, not"):
        TrainPlan.of(run_id=1, optimizer="SGD", name="a")  # the run's start reads it, not the tasks


@pytest.mark.parametrize("name, bad, says", [
    ("mode", "bsp", "mode='bsp': use 'sync', 'async' or 'ssp'"),
    ("steps", 0, "steps=0: use a number of global steps >= 1, or None"),
    ("steps", True, "steps=True: use a number of global steps >= 1"),
    ("seed", 1.5, "seed=1.5: use an integer"),
    ("request_timeout", -1, "request_timeout=-1: use a number of seconds > 0"),
    ("checkpoint_secs", -5, "checkpoint_secs=-5: use a number of seconds, or 0 or None for none"),
    ("keep_checkpoints", 0, "keep_checkpoints=0: use an integer >= 1"),
    ("restore", "yes", "restore='yes': use True or False"),
    ("max_grad_norm", 0, "max_grad_norm=0: use a positive number"),
    ("precision", "fp8", "precision='fp8': use 'fp32', 'bf16' or 'fp16'"),
    ("checkpoint_dir", 3, "checkpoint_dir=3: use a folder's path"),
])
def test_a_bad_value_is_one_line_naming_the_fix(name, bad, says):
    with pytest.raises(ConfigError) as e:
        options.check(**{name: bad})
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    options.check(**{name: OPTIONS[name].default})  # every default is a value its option takes


def test_every_option_has_help_and_an_entry():
    for o in OPTIONS.values():
        assert o.help and o.entries <= {options.TRAIN, options.RUN, options.SESSION, options.SCRIPT,
                                        options.TRAIN_SCRIPT}, o.name
