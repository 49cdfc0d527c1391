"""A damaged run store (truncated, or overwritten with other bytes) is refused at open with one line that names
its path and what to do, by every way in: the writer, a reader, ``pscluster.runs()``; never a raw SQLite or
pandas error. A whole store still opens, and so does an empty file."""

import os

import pytest

import pscluster
from pscluster.errors import DamagedStore
from pscluster.metrics.store import RunStore


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> bytes:
    """The bytes of a store of 20 runs of 300 steps each (a few MB)."""
    path = tmp_path_factory.mktemp("whole") / "runs.sqlite"
    with RunStore(str(path)) as store:
        for i in range(20):
            run = store.create_run(name=f"r{i}", cluster="c", mode="sync", config={"steps": 300}, spec={})
            store.add_batch(run, [{"kind": "step", "task": "worker:0", "time": 1.0 + s, "local_step": s,
                                   "global_step": s, "loss": 0.5} for s in range(1, 301)])
    return path.read_bytes()


DAMAGES = {"truncated": lambda b: b[:len(b) // 2], "overwritten": lambda b: os.urandom(len(b)),
           "a short file": lambda b: b[:40], "text": lambda b: b"runs of yesterday\n" * 100}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_store_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, whole, damage):
    path = tmp_path / "runs.sqlite"
    path.write_bytes(DAMAGES[damage](whole))
    monkeypatch.setenv("PSCLUSTER_HOME", str(tmp_path))
    for open_it in (lambda: RunStore(str(path)), lambda: RunStore(str(path), readonly=True), pscluster.runs):
        with pytest.raises(DamagedStore) as refused:
            open_it()
        message = str(refused.value)
        assert str(path) in message and "move it aside" in message and "\n" not in message, message


def test_a_whole_store_and_an_empty_file_open(tmp_path, whole):
    path = tmp_path / "runs.sqlite"
    path.write_bytes(whole)
    with RunStore(str(path), readonly=True) as store:
        assert len(store.runs()) == 20
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with RunStore(str(empty)) as store:
        assert store.runs().empty
