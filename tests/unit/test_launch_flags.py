"""``pscluster launch``'s run options: only the flags typed travel to the tasks, checked, in the one variable
``pscluster.init()`` reads."""

import json
import os

import pytest

from pscluster import environ
from pscluster.errors import ConfigError
from pscluster.launch import parser, task_env, typed_options
from pscluster.runtime import options


def test_only_the_flags_typed_travel_even_at_their_default():
    typed = typed_options(["--mode", "sync", "--seed", "3", "--partition", "emb=2", "--partition", "out=3",
                           "--no-restore", "train.py", "--steps", "7"])
    # --mode sync is the default, typed: it goes (over an init() default, under init()'s own argument); --steps
    # after the script is the script's own
    assert typed == {"mode": "sync", "seed": 3, "partition": {"emb": 2, "out": 3}, "restore": False}
    assert typed_options(["train.py"]) == {}


def test_every_option_of_a_script_s_loop_is_a_flag():
    shown = parser().format_help()
    assert all(options.OPTIONS[name].flag_name in shown for name in options.names(options.SCRIPT)), shown


def test_the_options_variable_is_a_json_object(monkeypatch):
    monkeypatch.setenv(environ.LAUNCH_OPTIONS, json.dumps({"mode": "async"}))
    assert environ.launch_options() == {"mode": "async"}
    monkeypatch.setenv(environ.LAUNCH_OPTIONS, "[1]")
    with pytest.raises(ConfigError, match="PSCLUSTER_LAUNCH_OPTIONS is not a JSON object"):
        environ.launch_options()
    monkeypatch.delenv(environ.LAUNCH_OPTIONS)
    assert environ.launch_options() == {}


def test_each_task_gets_its_share_of_the_cores_as_torch_threads_unless_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert task_env(3, {})["OMP_NUM_THREADS"] == str(max(1, cores // 3))
    assert task_env(1, {})["OMP_NUM_THREADS"] == str(cores)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's own setting stands
    assert task_env(3, {"mode": "async"})["OMP_NUM_THREADS"] == "5"
    assert json.loads(task_env(3, {"mode": "async"})[environ.LAUNCH_OPTIONS]) == {"mode": "async"}
