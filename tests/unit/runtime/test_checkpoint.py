"""Sharded checkpoints: files, commit, refusal of damaged ones, restore onto another number of ps, export."""

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pscluster.cluster import recovery
from pscluster.errors import CheckpointError
from pscluster.runtime import checkpoint
from pscluster.runtime.plan import VariableSpec, assemble
from pscluster.runtime.seeding import build_model
from pscluster.runtime.worker import run_worker

from .test_sparse_inprocess import BagModel, make_plan
from .test_sparse_inprocess import bags as bags  # noqa: F401  (the fixture)
from .test_worker_inprocess import RUN_ID

ADAM = ("adam", {"lr": 0.01})


def test_tensor_files_round_trip_every_dtype_and_shape(tmp_path):
    tensors = {"w": torch.randn(3, 4), "ids": torch.arange(5), "half": torch.ones(2, dtype=torch.bfloat16),
               "flag": torch.tensor([True, False]), "empty": torch.empty(0, 7), "scalar": torch.tensor(2.5)}
    size, sha = checkpoint.write_tensors(tmp_path / "a.tensors", tensors)
    assert size == (tmp_path / "a.tensors").stat().st_size and len(sha) == 64
    back = checkpoint.read_tensors(tmp_path / "a.tensors")
    assert list(back) == list(tensors)
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "without_o_direct"])
def test_large_tensor_files_round_trip_with_their_checksum(tmp_path, monkeypatch, o_direct):
    """Files of several O_DIRECT chunks with a tail that is no whole block, and the same where the system
    has no O_DIRECT (macOS): the page cache path."""
    if not o_direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    tensors = {"w": torch.randn(5_000_001), "bytes": torch.arange(4097, dtype=torch.uint8)}
    path = tmp_path / "big.tensors"
    size, sha = checkpoint.write_tensors(path, tensors)
    data = path.read_bytes()
    assert size == len(data) > 20_000_000 and sha == hashlib.sha256(data).hexdigest()
    back = checkpoint.read_tensors(path)
    assert all(torch.equal(back[key], t) for key, t in tensors.items())
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_tensor_given_in_pieces_is_written_as_the_one_tensor_they_make(tmp_path):
    """The optimizer state of a variable a ps steps in chunks: written from its chunks, read back whole."""
    w = torch.randn(6, 5)
    flat = w.reshape(-1)
    tensors = {"a": torch.ones(2), "w#exp_avg": checkpoint.Pieces((flat[:12], flat[12:24], flat[24:]), (6, 5)),
               "b": torch.arange(3)}
    size, _ = checkpoint.write_tensors(tmp_path / "p.tensors", tensors)
    back = checkpoint.read_tensors(tmp_path / "p.tensors")
    assert list(back) == ["a", "w#exp_avg", "b"] and back["w#exp_avg"].equal(w)
    assert back["a"].equal(torch.ones(2)) and back["b"].equal(torch.arange(3))
    assert size == (tmp_path / "p.tensors").stat().st_size


def test_a_truncated_tensor_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "a.tensors"
    checkpoint.write_tensors(path, {"w": torch.randn(100)})
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=f"{path} is not a readable tensor file"):
        checkpoint.read_tensors(path)


def test_optimizer_state_keeps_plain_numbers(tmp_path):
    state = {"step": 7, "exp_avg": torch.randn(3), "lr": 0.5, "max": torch.tensor(1.0)}
    back = checkpoint.decode_state(checkpoint.encode_state(state))
    assert back["step"] == 7 and isinstance(back["step"], int)
    assert back["lr"] == 0.5 and isinstance(back["lr"], float)
    assert torch.equal(back["exp_avg"], state["exp_avg"]) and torch.equal(back["max"], state["max"])


def train(local_ps, dataset, *, num_ps, partition, steps, directory, every=0, restore=False, attempt=0):
    """One in-process run (one worker, sync) with checkpoints in ``directory``; the manifests it committed
    and the plan."""
    spec = local_ps.start(num_ps=num_ps, num_workers=1)
    plan = make_plan(spec, BagModel, steps=steps, optimizer=ADAM, partition=partition)
    plan = plan.replace(checkpoint_dir=str(directory), checkpoint_every=every, restore=restore, attempt=attempt)
    run_worker(spec, 0, plan, BagModel, dataset, torch.nn.BCEWithLogitsLoss())
    committed = checkpoint.commit_ready(directory, num_ps=num_ps, run_id=RUN_ID, attempt=attempt,
                                        variables=plan.variables, optimizer="adam", optimizer_kwargs={"lr": 0.01},
                                        keep=3)
    params = local_ps.client(spec, run_id=RUN_ID).pull_all()
    return committed, assemble(plan.variables, params.messages), plan


def test_every_n_steps_and_at_the_end_keeping_the_last_k(local_ps, bags, tmp_path):
    committed, final, plan = train(local_ps, bags, num_ps=2, partition={"embedding": 2}, steps=25,
                                   directory=tmp_path, every=5)
    assert list(committed) == [5, 10, 15, 20, 25]
    assert [p.name for p in committed.values()] == [f"step-{s:09d}.manifest.json" for s in committed]
    assert checkpoint.committed_steps(tmp_path) == [15, 20, 25]  # keep=3
    assert sorted(p.name for p in tmp_path.glob("step-*") if p.is_dir()) == \
        ["step-000000015", "step-000000020", "step-000000025"]
    latest = checkpoint.latest(tmp_path)
    assert latest.step == 25 and len(latest.shards) == 2
    for name, value in latest.state_dict().items():  # the final checkpoint holds the final parameters
        assert torch.equal(value, final[name]), name


def test_restore_onto_three_ps_is_bit_identical_and_keeps_optimizer_state(local_ps, bags, tmp_path):
    train(local_ps, bags, num_ps=2, partition={"embedding": 2}, steps=10, directory=tmp_path)
    saved = checkpoint.latest(tmp_path)
    restored = {}
    for num_ps, partition in ((3, {"embedding": 3}), (2, {"embedding": 2})):
        directory = tmp_path / f"on-{num_ps}"
        directory.mkdir()
        for f in tmp_path.glob("step-000000010*"):  # the same checkpoint, in a directory of its own
            subprocess.run(["cp", "-r", str(f), str(directory)], check=True)
        # a target of 10 steps: restored at step 10, nothing to train: the ps hold the checkpoint's values
        _, now, plan = train(local_ps, bags, num_ps=num_ps, partition=partition, steps=10, directory=directory,
                             restore=True, attempt=1)
        assert len(plan.variables) == num_ps + 2  # the shards of the embedding, out.weight, out.bias
        for name, value in saved.state_dict().items():
            assert torch.equal(now[name], value), (num_ps, name)
        slots = saved.tensors()[1]
        for server in local_ps.servers[-num_ps:]:  # each ps holds its rows of the Adam moments
            for v in (v for v in plan.variables if v.ps == server.index):
                state = server.run.optimizer_state(server.run.position[v.id])
                assert state["step"] == slots[v.parameter]["step"] == 10
                for slot in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state[slot], slots[v.parameter][slot][v.start:v.stop]), (v.name, slot)
        # ...and ten more steps from there move both alike: the Adam state came back too
        _, restored[num_ps], _ = train(local_ps, bags, num_ps=num_ps, partition=partition, steps=20,
                                       directory=directory, restore=True, attempt=2)
    for name, value in restored[2].items():
        assert torch.equal(restored[3][name], value), name
    assert (restored[2]["embedding.weight"] - saved.state_dict()["embedding.weight"]).abs().max() > 0


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_previous_is_used(local_ps, bags, tmp_path):
    train(local_ps, bags, num_ps=2, partition=None, steps=20, directory=tmp_path, every=10)
    assert checkpoint.committed_steps(tmp_path) == [10, 20]
    shard = tmp_path / "step-000000020" / "ps-1.tensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit, same size
    shard.write_bytes(bytes(data))
    refused = []
    assert checkpoint.latest(tmp_path, on_refused=refused.append).step == 10
    assert refused == [f"{shard} fails its SHA-256 checksum: it is damaged"]
    manifest = checkpoint.manifest_path(tmp_path, 20)
    set_aside = manifest.with_name(manifest.name + ".refused")
    assert checkpoint.committed_steps(tmp_path) == [10] and set_aside.exists()  # out of the committed set
    assert checkpoint.latest(tmp_path, on_refused=refused.append).step == 10 and len(refused) == 1
    set_aside.rename(manifest)
    shard.write_bytes(bytes(data[:100]))  # truncated
    refused.clear()
    assert checkpoint.latest(tmp_path, on_refused=refused.append).step == 10
    assert refused[0].startswith(f"{shard} has 100 bytes, ")
    # the chief's restore takes the previous one; step 20, written again, is a checkpoint again
    committed, params, _ = train(local_ps, bags, num_ps=2, partition=None, steps=20, directory=tmp_path, every=10,
                                 restore=True, attempt=1)
    assert list(committed) == [20]
    again = checkpoint.latest(tmp_path, on_refused=refused.append)
    assert again.step == 20 and len(refused) == 1
    for name, value in again.state_dict().items():
        assert torch.equal(params[name], value), name


class WiderBags(BagModel):
    """The same layers, the embedding one column wider."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(self.embedding.num_embeddings, self.embedding.embedding_dim + 1,
                                               mode="sum", sparse=True)
        self.out = torch.nn.Linear(self.embedding.embedding_dim, 1)


def test_set_aside_moves_only_the_checkpoint_files_whole_into_a_new_subfolder(tmp_path):
    """What a run from scratch does to the checkpoints of its folder: they move, whole (they restore from the
    subfolder), out of its way; a user's files stay; a folder set aside earlier is never written into."""
    assert checkpoint.set_aside(tmp_path / "absent", "before-run-2") is None
    assert checkpoint.set_aside(tmp_path, "before-run-2") is None and list(tmp_path.iterdir()) == []

    def committed(step):
        checkpoint.commit(tmp_path, step, 1, [], "sgd", {},
                          [checkpoint.write_shard(tmp_path, step, 0, {"w": torch.full((3,), step)}, run_id=1)])

    committed(10)
    committed(20)
    checkpoint.write_shard(tmp_path, 30, 0, {"w": torch.ones(3)}, run_id=1)  # in flight
    checkpoint.manifest_path(tmp_path, 5).with_suffix(".json.refused").write_text("{}")
    (tmp_path / "copies").mkdir()
    (tmp_path / "copies" / "worker-0.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-000000040").write_text("a file, not a step folder")
    (tmp_path / "data").mkdir()
    into = checkpoint.set_aside(tmp_path, "before-run-2")
    assert into == tmp_path / "before-run-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before-run-2", "data", "notes.txt", "step-000000040"]
    assert sorted(p.name for p in into.iterdir()) == [
        "copies", "step-000000005.manifest.json.refused", "step-000000010", "step-000000010.manifest.json",
        "step-000000020", "step-000000020.manifest.json", "step-000000030"]
    assert checkpoint.committed_steps(tmp_path) == checkpoint.uncommitted_steps(tmp_path) == []
    assert checkpoint.committed_steps(into) == [10, 20] and checkpoint.uncommitted_steps(into) == [30]
    latest = checkpoint.latest(into)  # its shards' checksums hold
    assert latest.step == 20 and checkpoint.read_tensors(into / latest.shards[0]["file"])["w"].eq(20).all()
    committed(10)  # the next run's, set aside in turn: into a folder of its own
    again = checkpoint.set_aside(tmp_path, "before-run-2")
    assert again == tmp_path / "before-run-2.2" and checkpoint.committed_steps(again) == [10]
    assert checkpoint.committed_steps(into) == [10, 20] and checkpoint.latest(into).step == 20


def test_a_checkpoint_of_another_model_is_refused_from_its_manifest_alone(local_ps, bags, tmp_path):
    train(local_ps, bags, num_ps=2, partition={"embedding": 2}, steps=5, directory=tmp_path)
    spec = local_ps.start(num_ps=3, num_workers=1)
    for model_fn, partition, fragment in [
            (lambda: torch.nn.Linear(4, 1), None, r"missing \['bias', 'weight'\], unexpected \['embedding.weight'"),
            (WiderBags, {"embedding": 3}, r"holds embedding.weight as \(60, 8\) float32, the model as \(60, 9\)")]:
        variables = make_plan(spec, model_fn, steps=5, partition=partition).variables
        with pytest.raises(CheckpointError, match=fragment):
            checkpoint.reshard(checkpoint.latest(tmp_path), variables)
        with pytest.raises(CheckpointError, match=fragment):
            checkpoint.check_fits(tmp_path, variables)  # what train() checks
    # the same model cut over three ps fits; the shards are not read (check_fits goes by the manifest)
    same = make_plan(spec, BagModel, steps=5, partition={"embedding": 3})
    for shard in tmp_path.glob("step-*/*"):
        shard.write_bytes(b"damaged")
    checkpoint.check_fits(tmp_path, same.variables)


def test_the_export_loads_into_a_fresh_model_with_plain_torch(local_ps, bags, tmp_path):
    train(local_ps, bags, num_ps=2, partition={"embedding": 2}, steps=10, directory=tmp_path)
    ckpt = checkpoint.latest(tmp_path)
    path = checkpoint.export_state_dict(ckpt, tmp_path / "export" / "model.pt")
    expected = {k: v.clone() for k, v in ckpt.state_dict().items()}
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["pscluster"] = None  # importing pscluster now fails: the file must not need it
        import torch
        model = torch.nn.Module()
        model.embedding = torch.nn.EmbeddingBag({BagModel().embedding.num_embeddings},
                                                {BagModel().embedding.embedding_dim}, mode="sum")
        model.out = torch.nn.Linear({BagModel().out.in_features}, 1)
        model.load_state_dict(torch.load({str(path)!r}, weights_only=True))
        expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
        print("loaded", len(expected))
    """)
    out = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded 3"
    assert set(expected) == set(dict(build_model(BagModel, 0).named_parameters()))


def test_a_process_killed_while_writing_leaves_no_checkpoint_that_restore_accepts(tmp_path):
    writer = textwrap.dedent(f"""
        import torch
        from pscluster.runtime import checkpoint
        from pscluster.runtime.plan import VariableSpec
        variables = [VariableSpec(id=0, name="w", shape=(4_000_000,), dtype="float32", ps=0)]
        step = 0
        while True:
            step += 1
            r = checkpoint.write_shard({str(tmp_path)!r}, step, 0, {{"w": torch.full((4_000_000,), float(step))}},
                                       run_id=1)
            checkpoint.commit({str(tmp_path)!r}, step, 1, variables, "sgd", {{}}, [r], keep=2)
            print(step, flush=True)
    """)
    for delay in (0.5, 0.8, 1.1):
        proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # one checkpoint committed
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        ckpt = checkpoint.latest(tmp_path)  # whatever was left: a complete, checked checkpoint
        assert ckpt is not None
        assert torch.equal(ckpt.state_dict()["w"], torch.full((4_000_000,), float(ckpt.step)))
        for leftover in tmp_path.rglob("*"):  # start the next round afresh
            if leftover.is_file():
                leftover.unlink()


def test_a_restart_after_a_lost_ps_names_the_step_it_restores_not_a_damaged_one(local_ps, bags, tmp_path):
    train(local_ps, bags, num_ps=2, partition=None, steps=20, directory=tmp_path, every=10)
    notes = []
    run = SimpleNamespace(plan=SimpleNamespace(checkpoint_dir=str(tmp_path)),
                          note=lambda kind, task, detail: notes.append((kind, task, detail["error"])))
    (tmp_path / "step-000000020" / "ps-0.tensors").write_bytes(b"")
    assert recovery._restorable_step(run) == 10
    assert [(kind, task) for kind, task, _ in notes] == [("checkpoint_refused", "controller")]
    (tmp_path / "step-000000010" / "ps-1.tensors").unlink()
    assert recovery._restorable_step(run) is None  # from the initial values, and said so: not "from step 20"
    assert len(notes) == 2 and "is missing" in notes[1][2]


def test_a_shard_holding_a_nan_or_an_infinity_is_not_written(tmp_path):
    for tensors in ({"w": torch.tensor([1.0, float("nan")])},
                    {"w": torch.ones(2), "w#exp_avg": checkpoint.Pieces((torch.ones(2), torch.tensor([float("inf")])),
                                                                          (3,))}):
        with pytest.raises(CheckpointError, match="ps 0's shard of step 5 was not written: w.* holds NaN or infinite"):
            checkpoint.write_shard(tmp_path, 5, 0, tensors, run_id=RUN_ID)
        assert not list(checkpoint.step_dir(tmp_path, 5).glob("ps-0*"))
    receipt = checkpoint.write_shard(tmp_path, 5, 0, {"w": torch.ones(2), "steps": torch.tensor([3])}, run_id=RUN_ID)
    assert receipt["step"] == 5  # finite floats and integers are written


def test_a_committed_checkpoint_holding_a_nan_is_refused_and_the_previous_is_restored(local_ps, bags, tmp_path):
    # a checkpoint of a diverged run, as a pscluster that did not refuse them wrote it
    train(local_ps, bags, num_ps=2, partition=None, steps=20, directory=tmp_path, every=10)
    manifest_path = checkpoint.manifest_path(tmp_path, 20)
    manifest = json.loads(manifest_path.read_text())
    shard = manifest["shards"][1]
    tensors = checkpoint.read_tensors(tmp_path / shard["file"])
    name = next(k for k, t in tensors.items() if t.is_floating_point())
    tensors[name].view(-1)[0] = float("nan")
    shard["bytes"], shard["sha256"] = checkpoint.write_tensors(tmp_path / shard["file"], tensors)
    manifest_path.write_text(json.dumps(manifest))
    refused = []
    assert checkpoint.latest(tmp_path, on_refused=refused.append).step == 10
    assert refused == [f"checkpoint of step 20 holds NaN or infinite values ({name} in {shard['file']}): a diverged "
                       "state is never restored"]


@pytest.mark.parametrize("elements", [10, 300_000])  # through the page cache, and with O_DIRECT
def test_a_shard_that_fails_leaves_no_step_folder_even_where_nothing_can_be_removed(tmp_path, monkeypatch,
                                                                                    elements):
    # the file system turned read-only mid-write: the shard fails, and so would removing a folder made for it
    def read_only(*_, **__):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "fsync", read_only)
    monkeypatch.setattr(Path, "rmdir", read_only)
    with pytest.raises(CheckpointError, match="EROFS Read-only file system"):
        checkpoint.write_shard(tmp_path, 60, 0, {"w": torch.ones(elements)}, run_id=RUN_ID)
    assert list(tmp_path.iterdir()) == []  # no step folder left empty, nor the shard's temporary file


def test_prune_removes_what_a_ps_killed_mid_write_left_of_an_older_step(tmp_path):
    variables = [VariableSpec(id=0, name="w", shape=(3,), dtype="float32", ps=0)]
    for step in (10, 20):
        checkpoint.write_shard(tmp_path, step, 0, {"w": torch.ones(3)}, run_id=RUN_ID)
        checkpoint.commit_ready(tmp_path, num_ps=1, run_id=RUN_ID, attempt=0, variables=variables, optimizer="SGD",
                                optimizer_kwargs={})
    left, writing = tmp_path / ".step-000000015-ps-0.tensors.99.tmp", tmp_path / ".step-000000030-ps-0.tensors.99.tmp"
    left.write_bytes(b"half a shard")
    writing.write_bytes(b"a shard being written")
    checkpoint.prune(tmp_path, keep=5)
    assert not left.exists() and writing.exists() and checkpoint.committed_steps(tmp_path) == [10, 20]
