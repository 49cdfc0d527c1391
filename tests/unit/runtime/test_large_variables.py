"""Variables larger than a part (8 MiB) on a ps, against plain torch: a ps that receives a large gradient in parts
applies it as torch's own optimizer does on the whole parameter (async and sync, every optimizer with state),
writes that optimizer's state of the whole variable in its checkpoint, restores it at INIT and goes on as torch
does, and takes a large gradient in half precision as torch takes ``g.half().float()``.

The model: ``emb``, 20 MiB of float32 (payload frames of 8, 8 and 4 MiB), ``w``, 12 MiB (8 and 4 MiB) and a bias of
7 elements, all on one ps; gradients are random, seeded by step and worker. The worker talks to the ps over the
socket (no shared-memory lane: it never asks for one), so each push and each reply travels in parts."""

import pytest
import torch

from pscluster.errors import RuntimeTimeout
from pscluster.runtime import checkpoint, parts
from pscluster.runtime.plan import VariableSpec
from pscluster.runtime.protocol import Flag, Op
from pscluster.runtime.waiting import wait_until

from ..conftest import RUN_ID, ps_config

MB = 2**20
SHAPES = {"emb": (5 * MB // 4, 4), "w": (3 * 2**18, 4), "b": (7,)}  # 20 MiB, 12 MiB, 28 bytes
NAMES = list(SHAPES)
IDS = list(range(len(SHAPES)))
STEPS = 10  # the run's target: never reached here, so the ps never stops on its own
# with rtol=0: the ps's values are torch's to a millionth (the ps builds fused optimizers where torch has them, the
# plain torch here does not: the same arithmetic, up to the last bits; those without a fused kernel agree exactly)
ATOL = 1e-6
ADAM = ("Adam", {"lr": 0.01})
SGD_MOMENTUM = ("SGD", {"lr": 0.1, "momentum": 0.9})

OPTIMIZERS = {  # id: (torch.optim class name, options)
    "adam": ADAM,
    "adamw-decay": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    "adam-amsgrad": ("Adam", {"lr": 0.01, "amsgrad": True}),
    "sgd-nesterov": ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "sgd-dampening-decay": ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "weight_decay": 1e-3}),
    "rmsprop-centered": ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "adagrad-lr-decay": ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}),
    "nadam": ("NAdam", {"lr": 0.01}),
    "radam": ("RAdam", {"lr": 0.01}),
    "adamax": ("Adamax", {"lr": 0.01}),
    "adadelta": ("Adadelta", {"lr": 1.0}),
    "rprop": ("Rprop", {"lr": 0.01}),
}


def initial_values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in SHAPES.values()]


def gradients(step: int, worker: int = 0) -> list[torch.Tensor]:
    """Worker ``worker``'s gradients of ``step``: random, the same on every call."""
    g = torch.Generator().manual_seed(1000 * (step + 1) + worker)
    return [torch.randn(shape, generator=g) for shape in SHAPES.values()]


class Plain:
    """Plain torch: the optimizer over parameters of the initial values, stepped on given gradients."""

    def __init__(self, optimizer: str, options: dict, values: list[torch.Tensor]):
        self.params = [torch.nn.Parameter(v.clone()) for v in values]
        self.optimizer = getattr(torch.optim, optimizer)(self.params, **options)

    def step(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        self.optimizer.step()

    def state(self, i: int) -> dict:
        return self.optimizer.state[self.params[i]]


def start(local_ps, optimizer: str, options: dict, *, workers: int = 1, mode: str = "async", **config):
    """A ps holding the model, INITed by a controller client (``config``: PsConfig fields beside the defaults);
    (spec, server, controller)."""
    spec = local_ps.start(num_workers=workers)
    cfg = ps_config(NAMES, mode=mode, steps=STEPS, replicas=workers, workers=workers, optimizer=optimizer,
                    **options, **config)
    controller = local_ps.client(spec)
    controller.init(RUN_ID, {0: (IDS, initial_values())}, [cfg])
    return spec, local_ps.servers[-1], controller


def values_of(reply) -> list[torch.Tensor]:
    [msg] = reply.messages
    assert msg.ids == IDS
    return list(msg.tensors)


def assert_as_torch(got: list[torch.Tensor], plain: Plain, what: str) -> None:
    assert [tuple(t.shape) for t in got] == list(SHAPES.values()) and all(t.dtype == torch.float32 for t in got)
    for name, a, p in zip(NAMES, got, plain.params):
        torch.testing.assert_close(a, p.detach(), rtol=0, atol=ATOL, msg=lambda m, name=name: f"{name}, {what}: {m}")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def train(worker, server, plain: Plain, steps, *, half: torch.dtype | None = None) -> None:
    """Push-pull the gradients of ``steps`` through ``worker`` (in ``half`` when given) and step ``plain`` on the
    same ones (rounded to ``half`` and back): after each step, the reply's values are torch's parameters. Each
    push goes over the socket, larger than one part."""
    for step in steps:
        g = gradients(step)
        sent = [t.to(half) for t in g] if half else g
        assert sent[0].numel() * sent[0].element_size() > parts.PART_BYTES  # the large gradient alone: in parts
        bytes_in = server.bytes_in
        reply = worker.push_pull(step, {0: (IDS, sent)})
        plain.step([t.float() for t in sent])
        assert server.bytes_in - bytes_in >= nbytes(sent)  # the whole gradient came over the socket...
        assert not reply.flags & (Flag.SHARED | Flag.DROPPED | Flag.STOPPED)  # ...not through a lane, applied
        assert reply.step == step + 1
        assert_as_torch(values_of(reply), plain, f"after step {step}")
    assert sum(server.rejected.values()) == 0 and server.failed_requests == 0 and not server.assembling


@pytest.mark.parametrize("optimizer, options", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_async_updates_of_variables_larger_than_a_part_are_torchs_for_every_optimizer_with_state(
        local_ps, optimizer, options):
    """One worker, async: four push-pulls of gradients that travel in parts each step the variables as torch's
    optimizer steps them, moments, momentum buffers, step counts and decays included."""
    spec, server, _ = start(local_ps, optimizer, options)
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    plain = Plain(optimizer, options, initial_values())
    train(worker, server, plain, range(4))
    assert server.run.applied == 4


def test_sync_applies_the_mean_of_two_large_gradients_as_torchs_adam_does(local_ps):
    """Two workers, sync, two replicas per step: the first worker's push-pull is held until the second's gradient
    arrives; then both get the variables of one Adam step on the mean of the two gradients, as torch computes it."""
    spec, server, _ = start(local_ps, *ADAM, workers=2, mode="sync")
    w0, w1 = (local_ps.client(spec, i, run_id=RUN_ID) for i in range(2))
    plain = Plain(*ADAM, initial_values())
    for step in range(3):
        g0, g1 = gradients(step, 0), gradients(step, 1)
        first = w0.send(Op.PUSH_PULL, {0: (IDS, g0)}, step=step)
        assert wait_until(lambda: server.run.policy.contributors == [0], 10)  # worker 0's gradient is in, whole
        with pytest.raises(RuntimeTimeout):  # ...and its reply waits for worker 1's
            w0.collect(first, timeout=0.2)
        assert server.run.step == step and server.run.waiting_for() == [1]
        second = w1.push_pull(step, {0: (IDS, g1)})
        first = w0.merge(w0.collect(first))
        plain.step([(a + b) / 2 for a, b in zip(g0, g1)])
        for reply in (first, second):
            assert reply.step == step + 1 and not reply.flags & (Flag.SHARED | Flag.DROPPED)
            assert_as_torch(values_of(reply), plain, f"after step {step}")
    assert server.run.applied == 3 and server.run.dropped_stale == 0
    assert sum(server.rejected.values()) == 0 and not server.assembling


SLOTS = {"adam": (ADAM, ("exp_avg", "exp_avg_sq", "step")), "sgd-momentum": (SGD_MOMENTUM, ("momentum_buffer",))}


def read_shard(directory, step: int) -> tuple[dict, dict]:
    """(values by name, optimizer state by name) of ps 0's shard of ``step``."""
    return checkpoint.split_state(checkpoint.read_tensors(checkpoint.step_dir(directory, step) / "ps-0.tensors"))


@pytest.mark.parametrize("optimizer, options, slots", [(*o, s) for o, s in SLOTS.values()], ids=list(SLOTS))
def test_the_checkpoint_of_a_large_variable_holds_torchs_optimizer_state_of_the_whole_variable(
        local_ps, tmp_path, optimizer, options, slots):
    """After three async steps, the shard a ps writes when asked (CHECKPOINT) holds each variable's value and its
    optimizer state as torch's optimizer has them: one tensor of the variable's full shape per slot (Adam's
    moments, SGD's momentum buffer), and Adam's step count."""
    spec, server, controller = start(local_ps, optimizer, options, checkpoint_dir=str(tmp_path))
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    plain = Plain(optimizer, options, initial_values())
    train(worker, server, plain, range(3))
    controller.checkpoint()  # now: at step 3
    values, states = read_shard(tmp_path, 3)
    assert list(values) == NAMES
    assert_as_torch(list(values.values()), plain, "in the checkpoint")
    for i, (name, shape) in enumerate(SHAPES.items()):
        state, torch_state = states[name], plain.state(i)
        assert sorted(state) == sorted(slots) == sorted(torch_state), name
        for slot in slots:
            if slot == "step":
                assert float(state[slot]) == float(torch_state[slot]) == 3, name
                continue
            assert tuple(state[slot].shape) == shape and state[slot].dtype == torch.float32, (name, slot)
            torch.testing.assert_close(state[slot], torch_state[slot], rtol=0, atol=ATOL,
                                       msg=lambda m, name=name, slot=slot: f"{name}#{slot}: {m}")


def restore_init(local_ps, directory, optimizer: str, options: dict):
    """What a chief restoring the run does (``member.initialize``): commit the shard of step 3, take the latest
    checkpoint, cut it to the variables and INIT a fresh ps (attempt 1) with its values, optimizer state and step.
    (spec, server)."""
    variables = [VariableSpec(id=i, name=name, shape=shape, dtype="float32", ps=0)
                 for i, (name, shape) in enumerate(SHAPES.items())]
    committed = checkpoint.commit_ready(directory, num_ps=1, run_id=RUN_ID, attempt=0, variables=variables,
                                        optimizer=optimizer, optimizer_kwargs=options)
    assert list(committed) == [3]
    ckpt = checkpoint.latest(directory)
    restored, states = checkpoint.reshard(ckpt, variables)
    slots = [(vid, key, t) for vid in IDS for key, t in checkpoint.encode_state(states[vid]).items()]
    assert slots, "the checkpoint holds no optimizer state"
    # a slot of another shape would reach the optimizer unchecked (fused Adam then crashes the process): fail here
    assert all(t.dim() == 0 or tuple(t.shape) == SHAPES[NAMES[vid]] for vid, _, t in slots), \
        [(NAMES[vid], key, tuple(t.shape)) for vid, key, t in slots]
    spec = local_ps.start(num_workers=1)
    config = {**ps_config(NAMES, mode="async", steps=STEPS, optimizer=optimizer, **options),
              "attempt": 1, "step": ckpt.step, "state": tuple(key for _, key, _ in slots),
              "schedule_state": ckpt.schedule}
    local_ps.client(spec).init(RUN_ID, {0: (IDS + [vid for vid, _, _ in slots],
                                            [restored[vid] for vid in IDS] + [t for *_, t in slots])}, [config])
    return spec, local_ps.servers[-1]


@pytest.mark.parametrize("optimizer, options", [o for o, _ in SLOTS.values()], ids=list(SLOTS))
def test_a_ps_restored_from_a_checkpoint_of_large_variables_goes_on_as_torch_does(
        local_ps, tmp_path, optimizer, options):
    """A run checkpointed after three async steps, restored on a fresh ps (attempt 1) from that checkpoint's
    values and optimizer state: two more steps there equal torch's optimizer taking two more steps from the state
    it had at step 3 (a ps that restarted its optimizer state would not: Adam's bias correction, SGD's momentum)."""
    spec, server, controller = start(local_ps, optimizer, options, checkpoint_dir=str(tmp_path))
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    plain = Plain(optimizer, options, initial_values())
    train(worker, server, plain, range(3))
    controller.checkpoint()
    spec, server = restore_init(local_ps, tmp_path, optimizer, options)
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    assert worker.pull().step == 3
    train(worker, server, plain, range(3, 5))
    state = server.run.optimizer_state(0)
    for slot, value in plain.state(0).items():  # the state went on from the restored one
        torch.testing.assert_close(state[slot], value, rtol=0, atol=ATOL, msg=lambda m, slot=slot: f"emb#{slot}: {m}")


@pytest.mark.parametrize("precision, half", [("fp16", torch.float16), ("bf16", torch.bfloat16)], ids=["fp16", "bf16"])
def test_large_half_precision_gradients_update_fp32_variables_as_torch_does_with_the_rounded_gradient(
        local_ps, precision, half):
    """Mixed precision: a worker sends every gradient in half precision (the large one still in parts); the ps keeps
    fp32 values and Adam state and steps them as torch's Adam does on ``g.to(half).float()``, for three steps."""
    spec, server, _ = start(local_ps, *ADAM, precision=precision)
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    plain = Plain(*ADAM, initial_values())
    train(worker, server, plain, range(3), half=half)
    state = server.run.optimizer_state(0)
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
