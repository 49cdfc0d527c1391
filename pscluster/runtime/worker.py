"""The worker loop: pull parameters, compute gradients on a batch, push them.

Worker 0 is the chief: it builds the model, sends the initial values and the
run's configuration to every ps (INIT) before anyone trains; the other workers
wait for that (state "waiting for chief"), polling with a backoff, never a fixed
sleep. Each step is one fused push-then-pull round trip to every ps at once, during which the next batch is
read; the dense values go through shared memory to a ps on the same host (``PSClient.share``).
"""

from __future__ import annotations

import copy
import os
import time
from collections import Counter
from typing import NamedTuple

import torch

from ..errors import ConfigError, RuntimeTimeout
from ..spec import ClusterSpec, TaskSpec
from . import checkpoint
from .client import PSClient
from .data import sharded_batches
from .metrics import MetricsEmitter
from .plan import TrainPlan, VariableSpec, sparse_modules
from .protocol import Flag


def build_model(model_fn, seed: int) -> torch.nn.Module:
    """A fresh model: a copy of ``model_fn`` if it is a module, else ``model_fn()`` under ``seed``."""
    torch.manual_seed(seed)
    if isinstance(model_fn, torch.nn.Module):
        return copy.deepcopy(model_fn)
    model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model_fn returned {type(model).__name__}: it must build a torch.nn.Module")
    return model


def local_device(task: TaskSpec) -> torch.device:
    """The torch device of a worker: its one visible GPU, or the CPU."""
    if not task.device.startswith("cuda"):
        return torch.device("cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", task.device.split(":")[1])
    return torch.device("cuda:0")


def batch_accuracy(output: torch.Tensor, target: torch.Tensor) -> float | None:
    """Fraction of correct predictions for classification outputs, None when not a classifier."""
    if output.dim() == 2 and output.shape[1] > 1 and target.dim() == 1 and not target.is_floating_point():
        return (output.argmax(1) == target).float().mean().item()
    if output.shape == target.shape or (output.dim() == 2 and output.shape[1] == 1):
        return ((output.reshape(-1) > 0).float() == target.reshape(-1).float()).float().mean().item()
    return None


def log_line(local_step: int, global_step: int, loss: float, accuracy: float | None, sec_per_batch: float) -> str:
    """The familiar progress line of TF's distributed examples."""
    acc = "" if accuracy is None else f", accuracy {accuracy:.3f}"
    return (f"After {local_step} training steps ({global_step} global steps), "
            f"loss {loss:.3f}{acc} ({sec_per_batch:.3f} sec/batch)")


class _Shards:
    """The model's dense variables (whole parameters or row shards of them) grouped by home ps, in
    plan order; sparse variables are left to ``_SparseRows``."""

    def __init__(self, model: torch.nn.Module, plan: TrainPlan, num_ps: int):
        params = dict(model.named_parameters())
        expected = {v.parameter: v for v in plan.variables}
        if set(params) != set(expected) or any(params[v.parameter].shape[1:] != v.shape[1:] or
                                                v.stop > (params[v.parameter].shape or [1])[0]
                                                for v in plan.variables):
            raise ConfigError("the model built on this worker differs from the planned one: "
                              "make model_fn deterministic (same layers and shapes every call)")
        self.params = params
        self.on_ps = {i: plan.variables_on(i) for i in range(num_ps)}
        self.dense = {i: [v for v in vs if not v.sparse] for i, vs in self.on_ps.items()}
        self.by_id = {v.id: v for v in plan.variables}

    def view(self, v: VariableSpec, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """The part of ``tensor`` (default: the parameter) that variable ``v`` holds."""
        t = self.params[v.parameter].detach() if tensor is None else tensor
        return t[v.start:v.stop] if v.partitioned else t

    def values(self) -> dict:
        """Every variable's current value (sparse ones too), by ps: what the chief's INIT sends."""
        return {i: ([v.id for v in vs], [self.view(v) for v in vs]) for i, vs in self.on_ps.items()}

    def grads(self) -> dict:
        out = {}
        for i, vs in self.dense.items():
            grads = []
            for v in vs:
                g = self.params[v.parameter].grad
                grads.append(self.view(v, g) if g is not None else torch.zeros(v.shape, dtype=getattr(torch, v.dtype)))
            out[i] = ([v.id for v in vs], grads)
        return out

    @torch.no_grad()
    def load(self, reply) -> None:
        for msg in reply.messages:
            for vid, t in zip(msg.ids, msg.tensors):
                self.view(self.by_id[vid]).copy_(t)


class _SparseRows:
    """Sparse embeddings: before each forward of an ``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True``, pull the rows its input touches (each once) from the ps tasks that hold them; after
    backward, the (rows, values) of its sparse gradient go with the push, split by shard."""

    def __init__(self, model: torch.nn.Module, plan: TrainPlan, client: PSClient):
        self.client = client
        self.shards: dict[str, list[VariableSpec]] = {}
        for v in plan.variables:
            if v.sparse:
                self.shards.setdefault(v.parameter, []).append(v)
        self.params = dict(model.named_parameters())
        for name, module in sparse_modules(model).items():
            module.register_forward_pre_hook(self._pull_hook(name))

    def _pull_hook(self, name: str):
        def pull(module, args):
            self.pull(name, args[0])
        return pull

    @torch.no_grad()
    def pull(self, name: str, indices: torch.Tensor) -> None:
        """Fetch the current values of the rows of parameter ``name`` in ``indices`` into it."""
        rows = torch.unique(indices.detach().reshape(-1).cpu())
        per_ps: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        wanted = []
        for v in self.shards[name]:
            mine = rows[(rows >= v.start) & (rows < v.stop)]
            ids, tensors = per_ps.setdefault(v.ps, ([], []))
            ids.append(v.id)
            tensors.append(mine - v.start)
            wanted.append(mine)
        reply = self.client.pull_rows(per_ps)
        values = {vid: t for m in reply.messages for vid, t in zip(m.ids, m.tensors)}
        weight = self.params[name]
        for v, mine in zip(self.shards[name], wanted):
            weight.index_copy_(0, mine.to(weight.device), values[v.id].to(weight.device))

    def grads(self) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        """Per ps: (ids, tensors) of the sparse gradients, two entries per variable: rows, values."""
        out: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        for name, shards in self.shards.items():
            grad = self.params[name].grad
            if grad is None:
                rows, values = torch.empty(0, dtype=torch.int64), torch.empty((0, *shards[0].shape[1:]))
            else:
                grad = grad.coalesce()
                rows, values = grad.indices()[0].cpu(), grad.values().cpu()
            for v in shards:
                keep = (rows >= v.start) & (rows < v.stop)
                ids, tensors = out.setdefault(v.ps, ([], []))
                ids += [v.id, v.id]
                tensors += [rows[keep] - v.start, values[keep]]
        return out


def _merge(dense: dict, sparse: dict) -> dict:
    """Per ps, the dense (ids, tensors) followed by the sparse ones (a ps reads them by id)."""
    merged = {}
    for i in set(dense) | set(sparse):
        ids, tensors = [], []
        for part in (dense.get(i), sparse.get(i)):
            if part:
                ids += part[0]
                tensors += part[1]
        merged[i] = (ids, tensors)
    return merged


class _Computed(NamedTuple):
    """One batch's forward and backward: the gradients are in the model's ``.grad``."""

    loss: torch.Tensor
    output: torch.Tensor
    target: torch.Tensor
    step: int  # the global step of the parameters they were computed on


def _gradients(model: torch.nn.Module, loss_fn, batch, device: torch.device, step: int) -> _Computed:
    x, y = batch[0].to(device), batch[1].to(device)
    model.zero_grad(set_to_none=True)  # fresh .grad tensors: the last ones may still be in flight
    output = model(x)
    loss = loss_fn(output, y)
    loss.backward()
    return _Computed(loss, output, y, step)


def _ps_config(plan: TrainPlan, ps: int) -> dict:
    return {"mode": plan.mode, "steps": plan.steps, "replicas_to_aggregate": plan.replicas_to_aggregate,
            "num_workers": plan.num_workers, "metrics_address": plan.metrics_address,
            "optimizer": plan.optimizer, "optimizer_kwargs": plan.optimizer_kwargs,
            "staleness_bound": plan.staleness_bound, "checkpoint_dir": plan.checkpoint_dir,
            "checkpoint_every": plan.checkpoint_every, "attempt": plan.attempt,
            "names": [v.name for v in plan.variables_on(ps)], "sparse": [v.sparse for v in plan.variables_on(ps)]}


def _initialize(client: PSClient, plan: TrainPlan, shards: "_Shards", emit) -> None:
    """The chief's duty before anyone trains: INIT every ps with the model's initial values, or with the
    latest checkpoint's values, optimizer state and step (re-cut to this run's placement) when the plan
    says restore and one passes its checks. Refused checkpoints are reported and the previous is tried."""
    values = shards.values()
    configs = [_ps_config(plan, i) for i in range(len(values))]
    ckpt = None
    if plan.restore and plan.checkpoint_dir:
        emit("state", state="restoring")
        ckpt = checkpoint.latest(plan.checkpoint_dir,
                                 on_refused=lambda error: emit("checkpoint_refused", error=error))
    if ckpt is not None:
        restored, states = checkpoint.reshard(ckpt, plan.variables)
        for i, (ids, _) in values.items():
            slots = [(vid, key, t) for vid in ids for key, t in checkpoint.encode_state(states[vid]).items()]
            values[i] = (ids + [vid for vid, _, _ in slots], [restored[vid] for vid in ids] + [t for *_, t in slots])
            configs[i].update(step=ckpt.step, state=[key for _, key, _ in slots])
    else:
        emit("state", state="initializing")
    client.init(plan.run_id, values, configs)
    if ckpt is not None:
        emit("restored", step=ckpt.step, path=str(ckpt.path))


def _wait_for_chief(client: PSClient, timeout: float, attempt: int, emit):
    emit("state", state="waiting for chief")
    deadline = time.monotonic() + timeout
    delay = 0.01
    while (reply := client.pull(attempt)) is None:
        if time.monotonic() > deadline:
            raise RuntimeTimeout(f"the chief did not initialize the variables within {timeout:.0f}s: "
                                 "see worker 0's error")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    return reply


def run_worker(spec: ClusterSpec, index: int, plan: TrainPlan, model_fn, dataset, loss_fn,
               *, log=None, join: bool = False) -> dict:
    """Train as worker ``index`` until the run reaches its step target or is stopped.

    ``join``: this worker replaces a lost one in a running run: it starts from the current parameters
    (a chief that joins does not initialize again). Returns a summary: local steps, last global step,
    dropped pushes, timings.
    """
    task = spec.task("worker", index)
    device = local_device(task)
    model = build_model(model_fn, plan.seed).to(device)
    shards = _Shards(model, plan, len(spec.ps))
    emitter = MetricsEmitter(plan.metrics_address, f"worker:{index}", spec.key)
    started = time.time()
    client = PSClient(spec, task=index, run_id=plan.run_id, timeout=plan.request_timeout)
    try:
        if task.is_chief and not join:
            _initialize(client, plan, shards, emitter.emit)
            reply = client.pull()
        else:
            reply = _wait_for_chief(client, plan.request_timeout, plan.attempt, emitter.emit)
        shards.load(reply)
        if plan.shared_memory:
            client.share(reply)
        sparse = _SparseRows(model, plan, client)
        emitter.emit("state", state="training")

        batches = sharded_batches(dataset, index, plan.num_workers, plan.batch_size, plan.seed)
        batch = next(batches)
        ahead = None  # pipeline: the gradients of the next batch, computed while the last push-pull was in flight
        local_step, samples, dropped = 0, 0, 0
        compute_s = comm_s = wait_s = window_s = 0.0
        staleness = Counter()
        loss_value, accuracy = float("nan"), None
        while not (reply.flags & Flag.STOPPED) and reply.step < plan.steps:
            t0 = time.perf_counter()
            sent, received = client.bytes_sent, client.bytes_received  # the whole step: rows pulled in forward too
            computed = ahead if ahead is not None else _gradients(model, loss_fn, batch, device, reply.step)
            t1 = time.perf_counter()
            answer = client.start_push_pull(computed.step, _merge(shards.grads(), sparse.grads()))
            sent_at = time.perf_counter()
            # while the ps applies the push (hidden behind the round trip): the step's numbers, the next batch,
            # and with pipeline its gradients, on the parameters this worker has now
            loss_value = computed.loss.item()
            accuracy = batch_accuracy(computed.output.detach(), computed.target)
            batch = next(batches)
            ahead = _gradients(model, loss_fn, batch, device, reply.step) if plan.pipeline else None
            overlapped = time.perf_counter() - sent_at
            reply = answer()
            shards.load(reply)
            t2 = time.perf_counter()

            local_step += 1
            samples += len(computed.target)
            step_compute = t1 - t0 + overlapped
            step_wait = min(reply.wait_s, t2 - t1 - overlapped)
            step_comm = t2 - t1 - overlapped - step_wait
            compute_s += step_compute
            wait_s += step_wait
            comm_s += step_comm
            window_s += t2 - t0
            was_dropped = bool(reply.flags & Flag.DROPPED)
            dropped += was_dropped
            if not was_dropped:
                staleness[reply.value] += 1
            emitter.emit("step", local_step=local_step, global_step=reply.step, loss=loss_value,
                         accuracy=accuracy, compute_s=step_compute, wait_s=step_wait, comm_s=step_comm,
                         bytes_sent=client.bytes_sent - sent, bytes_received=client.bytes_received - received,
                         staleness=None if was_dropped else reply.value, dropped=was_dropped)
            if local_step % plan.log_every == 0:
                line = log_line(local_step, reply.step, loss_value, accuracy, window_s / plan.log_every)
                window_s = 0.0
                emitter.emit("log", line=line)
                if log is not None:
                    log(line)
        summary = {"task": index, "local_steps": local_step, "global_step": reply.step,
                   "dropped": dropped, "samples": samples, "wall_s": time.time() - started,
                   "compute_s": compute_s, "wait_s": wait_s, "comm_s": comm_s, "final_loss": loss_value,
                   "final_accuracy": accuracy, "staleness": dict(staleness),
                   "bytes_sent": client.bytes_sent, "bytes_received": client.bytes_received,
                   "metrics_dropped": emitter.dropped}
        emitter.emit("done", **{k: v for k, v in summary.items() if k not in ("task", "staleness")})
        return summary
    finally:
        emitter.close()
        client.close()
