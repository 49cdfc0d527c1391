"""After a lost ps: the checkpoint assembled from the survivors' shards and the workers' copies."""

from pathlib import Path

import torch

from pscluster.runtime import checkpoint, rescue
from pscluster.runtime.plan import VariableSpec

RUN_ID, ATTEMPT = 7, 0
# a whole weight on each ps, and a table split by rows across both
VARIABLES = [VariableSpec(id=0, name="w0", shape=(4, 3), dtype="float32", ps=0),
             VariableSpec(id=1, name="w1", shape=(3,), dtype="float32", ps=1),
             VariableSpec(id=2, name="table/part_0", variable="table", shape=(5, 2), dtype="float32", ps=0),
             VariableSpec(id=3, name="table/part_1", variable="table", shape=(3, 2), dtype="float32", ps=1, start=5)]


def values(seed: float) -> dict[str, torch.Tensor]:
    return {v.name: torch.full(v.shape, seed + v.id) for v in VARIABLES}


def write_own_shard(directory, ps: int, step: int, seed: float, *, attempt=ATTEMPT):
    names = [v.name for v in VARIABLES if v.ps == ps]
    params = [values(seed)[n] for n in names]
    states = [{"exp_avg": torch.full_like(p, -seed), "step": 3} for p in params]
    checkpoint.write_shard(directory, step, ps, checkpoint.shard_tensors(names, params, states), run_id=RUN_ID,
                           attempt=attempt)


def assemble(directory):
    return rescue.assemble(directory, num_ps=2, run_id=RUN_ID, attempt=ATTEMPT, variables=VARIABLES,
                           optimizer="adam", optimizer_kwargs={"lr": 0.01}, keep=5)


def test_a_lost_ps_and_the_survivor_come_back_from_one_step_never_a_mix(tmp_path):
    write_own_shard(tmp_path, 0, 600, 50.0)
    write_own_shard(tmp_path, 1, 600, 50.0)
    checkpoint.commit_ready(tmp_path, num_ps=2, run_id=RUN_ID, attempt=ATTEMPT, variables=VARIABLES,
                            optimizer="adam", optimizer_kwargs={})
    write_own_shard(tmp_path, 0, 705, 100.0)  # the survivor, stopped at 705
    rescue.write_copy(tmp_path, 0, 703, values(200.0), run_id=RUN_ID, attempt=ATTEMPT)
    rescue.write_copy(tmp_path, 1, 704, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)
    rescue.write_copy(tmp_path, 2, 900, values(400.0), run_id=RUN_ID, attempt=ATTEMPT - 1)  # another attempt's

    assembled = assemble(tmp_path)

    # the lost ps has no source of step 705: both come from the newest step each has, 704, the freshest copy;
    # each with its own newest optimizer state: the survivor's of 705, the lost ps's of its checkpoint of 600
    assert assembled.step == 704
    assert {(s.ps, s.origin, s.step, s.state_step) for s in assembled.sources} == {
        (0, "worker 1", 704, 705), (1, "worker 1", 704, 600)}
    ckpt = checkpoint.latest(tmp_path)
    assert ckpt.step == 704
    restored, states = checkpoint.reshard(ckpt, VARIABLES)
    for v in VARIABLES:
        assert torch.equal(restored[v.id], values(300.0)[v.name])
        assert torch.equal(states[v.id]["exp_avg"], torch.full(v.shape, -100.0 if v.ps == 0 else -50.0)), v.name
        assert states[v.id]["step"] == 3


def test_a_survivor_keeps_its_optimizer_state_when_its_own_shard_is_of_the_rescued_step(tmp_path):
    write_own_shard(tmp_path, 0, 705, 100.0)
    rescue.write_copy(tmp_path, 1, 705, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)
    assembled = assemble(tmp_path)
    assert assembled.step == 705
    assert {(s.ps, s.origin) for s in assembled.sources} == {(0, "ps 0"), (1, "worker 1")}
    restored, states = checkpoint.reshard(checkpoint.latest(tmp_path), VARIABLES)
    assert torch.equal(restored[0], values(100.0)["w0"])  # the survivor's own values
    assert torch.equal(restored[1], values(300.0)["w1"])
    assert torch.equal(states[0]["exp_avg"], torch.full((4, 3), -100.0))
    assert states[1] == {}
    # the lost ps left no state: a table split across the survivor and it restarts its state whole, not in part
    assert states[2] == {} and states[3] == {}


def write_state_copy(directory, ps: int, step: int, seed: float, *, run_id=RUN_ID):
    held = [v for v in VARIABLES if v.ps == ps]
    state = {f"{v.name}#{slot}": t for v in held
             for slot, t in checkpoint.encode_state({"exp_avg": torch.full(v.shape, -seed), "step": step}).items()}
    rescue.write_state_copy(directory, ps, step, state, {v.name: list(v.shape) for v in held}, run_id=run_id,
                            attempt=ATTEMPT)


def test_a_lost_ps_takes_its_optimizer_state_from_its_newest_state_copy_or_shard(tmp_path):
    write_own_shard(tmp_path, 1, 500, 5.0, attempt=ATTEMPT - 1)  # a shard of an earlier attempt of the run
    write_state_copy(tmp_path, 1, 690, 69.0)  # the lost ps's copy of its state, a few steps before its loss
    write_own_shard(tmp_path, 0, 705, 100.0)
    rescue.write_copy(tmp_path, 0, 705, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)

    assembled = assemble(tmp_path)

    assert {(s.ps, s.origin, s.state_step) for s in assembled.sources} == {(0, "ps 0", 705), (1, "worker 0", 690)}
    restored, states = checkpoint.reshard(checkpoint.latest(tmp_path), VARIABLES)
    assert torch.equal(restored[1], values(300.0)["w1"])  # its values of the rescued step, its state of 690
    assert torch.equal(states[1]["exp_avg"], torch.full((3,), -69.0)) and states[1]["step"] == 690
    # the table's two parts both carry a state now: joined, each part's rows its own ps's
    assert torch.equal(states[2]["exp_avg"], torch.full((5, 2), -100.0))
    assert torch.equal(states[3]["exp_avg"], torch.full((3, 2), -69.0))


def test_a_damaged_state_copy_or_another_runs_is_passed_over_for_an_older_shard(tmp_path):
    write_own_shard(tmp_path, 1, 500, 5.0)
    write_state_copy(tmp_path, 1, 690, 69.0)
    with open(tmp_path / "copies" / "ps-1.tensors", "r+b") as f:  # a bit flipped on disk
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    write_own_shard(tmp_path, 0, 705, 100.0)
    rescue.write_copy(tmp_path, 0, 705, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)
    assert {(s.ps, s.state_step) for s in assemble(tmp_path).sources} == {(0, 705), (1, 500)}

    other = tmp_path / "other"
    write_state_copy(other, 1, 690, 69.0, run_id=RUN_ID + 1)
    write_own_shard(other, 0, 705, 100.0)
    rescue.write_copy(other, 0, 705, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)
    assert {(s.ps, s.state_step) for s in assemble(other).sources} == {(0, 705), (1, None)}


def test_a_lost_ps_with_a_sparse_table_rolls_every_ps_back_to_its_own_newest_shard(tmp_path):
    sparse = [VariableSpec(**{**v.__dict__, "sparse": v.name == "table/part_1"}) for v in VARIABLES]
    for ps in (0, 1):
        write_own_shard(tmp_path, ps, 800, 1.0)
    write_own_shard(tmp_path, 0, 913, 2.0)  # the survivor, stopped at 913; ps 1 was lost at 913
    rescue.write_copy(tmp_path, 0, 912, values(3.0), run_id=RUN_ID, attempt=ATTEMPT)

    assembled = rescue.assemble(tmp_path, num_ps=2, run_id=RUN_ID, attempt=ATTEMPT, variables=sparse,
                                optimizer="adam", optimizer_kwargs={})

    # the lost ps's table is only in its step-800 shard: every ps comes back from step 800, with its own state
    assert assembled.step == 800
    assert {(s.ps, s.origin) for s in assembled.sources} == {(0, "ps 0"), (1, "ps 1")}
    restored, states = checkpoint.reshard(checkpoint.latest(tmp_path), sparse)
    for v in sparse:
        assert torch.equal(restored[v.id], values(1.0)[v.name])
        assert torch.equal(states[v.id]["exp_avg"], torch.full(v.shape, -1.0))


def test_nothing_is_assembled_when_the_committed_checkpoint_is_as_new(tmp_path):
    write_own_shard(tmp_path, 0, 700, 0.0)
    write_own_shard(tmp_path, 1, 700, 0.0)
    checkpoint.commit_ready(tmp_path, num_ps=2, run_id=RUN_ID, attempt=ATTEMPT, variables=VARIABLES,
                            optimizer="adam", optimizer_kwargs={})
    rescue.write_copy(tmp_path, 0, 699, values(1.0), run_id=RUN_ID, attempt=ATTEMPT)
    assert assemble(tmp_path) is None
    assert checkpoint.committed_steps(tmp_path) == [700]


def test_a_lost_ps_that_held_a_sparse_table_is_not_rebuilt_from_worker_copies(tmp_path):
    sparse = [VariableSpec(**{**v.__dict__, "sparse": v.name.startswith("table")}) for v in VARIABLES]
    write_own_shard(tmp_path, 0, 705, 1.0)
    rescue.write_copy(tmp_path, 0, 704, {k: t for k, t in values(2.0).items() if not k.startswith("table")},
                      run_id=RUN_ID, attempt=ATTEMPT)
    assert rescue.assemble(tmp_path, num_ps=2, run_id=RUN_ID, attempt=ATTEMPT, variables=sparse,
                           optimizer="adam", optimizer_kwargs={}) is None
    assert checkpoint.committed_steps(tmp_path) == []


def reads(monkeypatch) -> list[tuple[str, bool]]:
    """The tensor files read from now on: (name, whether checked against a receipt as it was read)."""
    read, read_tensors = [], checkpoint.read_tensors
    monkeypatch.setattr(checkpoint, "read_tensors",
                        lambda path, receipt=None: read.append((Path(path).name, receipt is not None)) or
                        read_tensors(path, receipt))
    return read


def test_a_rescue_reads_back_one_copy_for_every_ps_it_serves(tmp_path, monkeypatch):
    # the lost ps's recovery waits on this: the workers' copies of one step are alike, one is read, once, and
    # checked as it is read
    for worker in range(3):
        rescue.write_copy(tmp_path, worker, 704, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)
    read = reads(monkeypatch)
    assembled = assemble(tmp_path)
    assert assembled.step == 704 and {s.origin for s in assembled.sources} == {"worker 0"}
    assert read == [("worker-0.tensors", True)]


def test_a_restore_reads_each_shard_once_checked_as_it_is_read(tmp_path, monkeypatch):
    # the restarted run's chief waits on this: it read, hashed and parsed every shard three times
    rescue.write_copy(tmp_path, 0, 704, values(300.0), run_id=RUN_ID, attempt=ATTEMPT)
    assemble(tmp_path)
    read = reads(monkeypatch)
    restored, _ = checkpoint.reshard(checkpoint.latest(tmp_path), VARIABLES)
    assert sorted(read) == [("ps-0.tensors", True), ("ps-1.tensors", True)]
    assert all(torch.equal(restored[v.id], values(300.0)[v.name]) for v in VARIABLES if not v.partitioned)


def test_a_damaged_worker_copy_is_passed_over(tmp_path):
    write_own_shard(tmp_path, 0, 705, 1.0)
    rescue.write_copy(tmp_path, 0, 705, values(2.0), run_id=RUN_ID, attempt=ATTEMPT)
    rescue.write_copy(tmp_path, 1, 702, values(3.0), run_id=RUN_ID, attempt=ATTEMPT)
    damaged = rescue.copies_dir(tmp_path) / "worker-0.tensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assembled = assemble(tmp_path)  # not step 705 from the damaged copy and ps 0's shard: 702, from worker 1's
    assert assembled.step == 702 and {s.ps: s.origin for s in assembled.sources} == {0: "worker 1", 1: "worker 1"}
    restored, _ = checkpoint.reshard(checkpoint.latest(tmp_path), VARIABLES)
    assert torch.equal(restored[0], values(3.0)["w0"]) and torch.equal(restored[1], values(3.0)["w1"])


def test_a_damaged_shard_of_a_survivor_is_passed_over_and_never_linked_into_the_checkpoint(tmp_path):
    write_own_shard(tmp_path, 0, 600, 1.0)
    write_own_shard(tmp_path, 0, 705, 2.0)  # the survivor's shard at its stop, damaged on disk since
    damaged = checkpoint.step_dir(tmp_path, 705) / "ps-0.tensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    rescue.write_copy(tmp_path, 0, 703, values(3.0), run_id=RUN_ID, attempt=ATTEMPT)
    assembled = assemble(tmp_path)
    assert assembled.step == 703 and {s.ps: s.origin for s in assembled.sources} == {0: "worker 0", 1: "worker 0"}
    restored, _ = checkpoint.reshard(checkpoint.latest(tmp_path), VARIABLES)  # it loads: every shard verifies
    assert torch.equal(restored[0], values(3.0)["w0"])
