"""``pscluster launch``'s run options: only the flags typed travel to the tasks, checked, in the one variable
``pscluster.init()`` reads."""

import json

import pytest

from pscluster import environ
from pscluster.errors import ConfigError
from pscluster.launch import parser, typed_options
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
