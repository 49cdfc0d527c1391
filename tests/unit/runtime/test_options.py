"""Every option of a run has one definition (``pscluster.runtime.options``): each way into a run takes the same
names with the same defaults from it (the API's signatures, the magics' flags, a script's loop), and a bad value
is the same one-line error wherever it is given."""

import ast
import inspect
import textwrap
from dataclasses import fields

import pytest

from pscluster.cluster.handle import Cluster
from pscluster.cluster.script_run import train_from_environment
from pscluster.errors import ConfigError
from pscluster.magics.parsers import parsers
from pscluster.runtime import options
from pscluster.runtime.options import OPTIONS
from pscluster.runtime.plan import PLAN_OPTIONS, TrainPlan
from pscluster.runtime.standalone import script_plan

MAGIC_ONLY = {"wait", "lr", "momentum", "opt", "step_fn", "scheduler", "scheduler_opt", "reuse", "help"}


def option_defaults(*functions) -> dict:
    """The options among the keyword parameters of ``functions``, with their defaults (a required argument of the
    same name, as a session's optimizer, is not the option)."""
    found = {}
    for function in functions:
        for name, p in inspect.signature(function).parameters.items():
            if name in OPTIONS and p.default is not inspect.Parameter.empty:
                found[name] = p.default
    return found


@pytest.mark.parametrize("entry, functions", [
    (options.TRAIN, (Cluster.train,)),
    (options.SESSION, (Cluster.session,)),
    (options.TRAIN_SCRIPT, (train_from_environment, script_plan)),
], ids=["Cluster.train", "Cluster.session", "train_from_environment"])
def test_an_entry_s_signature_has_its_options_with_their_defaults(entry, functions):
    found = option_defaults(*functions)
    assert sorted(found) == sorted(options.names(entry))
    assert {name: OPTIONS[name].default for name in found} == found


@pytest.mark.parametrize("function", [Cluster.train, Cluster.session, Cluster.plan, train_from_environment,
                                      script_plan], ids=lambda f: f.__qualname__)
def test_an_entry_s_defaults_are_named_not_written_again(function):
    """``seed: int = DEFAULTS.seed``, never ``seed: int = 0``: a default changed in the definition changes here."""
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    arguments = node.args.args + node.args.kwonlyargs
    defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + node.args.kw_defaults
    written = [a.arg for a, d in zip(arguments, defaults) if a.arg in OPTIONS and d is not None and not (
        isinstance(d, ast.Attribute) and isinstance(d.value, ast.Name) and d.value.id == "DEFAULTS" and d.attr == a.arg)]
    assert not written, f"defaults written again: {written}"


@pytest.mark.parametrize("entry, call", [(options.RUN, Cluster.run), (options.SCRIPT, None)], ids=["Cluster.run",
                                                                                                  "pscluster.init"])
def test_a_user_s_loop_takes_its_options_by_name_with_their_defaults(entry, call):
    if call is not None:  # its options are all taken by name (``options.take``): none in the signature
        assert not option_defaults(call)
    taken = options.take(entry, {"steps": 7}, caller="f()")
    assert taken == {**{name: OPTIONS[name].default for name in options.names(entry)}, "steps": 7}
    with pytest.raises(ConfigError, match=r"^f\(\) got unknown option 'step': did you mean 'steps'\?$"):
        options.take(entry, {"step": 7}, caller="f()")
    with pytest.raises(ConfigError, match=r"^f\(\) got unknown option 'batch_size'"):
        options.take(entry, {"batch_size": 7}, caller="f()")


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


def test_the_plan_s_options_default_and_check_as_defined():
    plan_fields = {f.name: f.default for f in fields(TrainPlan)}
    # replicas_to_aggregate: the plan holds the number resolved from the workers (see loop_plan, train)
    for name in set(PLAN_OPTIONS) - {"mode", "steps", "batch_size", "optimizer", "replicas_to_aggregate"}:
        assert plan_fields[name] == OPTIONS[name].default, name


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
