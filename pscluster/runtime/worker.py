"""The worker loop: pull parameters, compute gradients on a batch, push them.

Worker 0 is the chief: it builds the model, sends the initial values and the
run's configuration to every ps (INIT) before anyone trains; the other workers
wait for that (state "waiting for chief"), polling with a backoff, never a fixed
sleep. Each step is one fused push-then-pull round trip to every ps at once.
"""

from __future__ import annotations

import copy
import os
import time
from collections import Counter

import torch

from ..errors import ConfigError, RuntimeTimeout
from ..spec import ClusterSpec, TaskSpec
from .client import PSClient
from .data import sharded_batches
from .metrics import MetricsEmitter
from .plan import TrainPlan
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
    """The model's parameters grouped by home ps, in plan order."""

    def __init__(self, model: torch.nn.Module, plan: TrainPlan, num_ps: int):
        params = dict(model.named_parameters())
        expected = {v.name: v for v in plan.variables}
        if set(params) != set(expected) or any(tuple(params[n].shape) != expected[n].shape for n in expected):
            raise ConfigError("the model built on this worker differs from the planned one: "
                              "make model_fn deterministic (same layers and shapes every call)")
        self.ids = {i: [v.id for v in plan.variables_on(i)] for i in range(num_ps)}
        self.params = {i: [params[v.name] for v in plan.variables_on(i)] for i in range(num_ps)}
        self.by_id = {v.id: params[v.name] for v in plan.variables}

    def values(self) -> dict:
        return {i: (self.ids[i], [p.detach() for p in ps]) for i, ps in self.params.items()}

    def grads(self) -> dict:
        return {i: (self.ids[i], [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
                for i, ps in self.params.items()}

    @torch.no_grad()
    def load(self, reply) -> None:
        for msg in reply.messages:
            for vid, t in zip(msg.ids, msg.tensors):
                self.by_id[vid].copy_(t)


def _ps_config(plan: TrainPlan, ps: int) -> dict:
    return {"mode": plan.mode, "steps": plan.steps, "replicas_to_aggregate": plan.replicas_to_aggregate,
            "num_workers": plan.num_workers, "metrics_address": plan.metrics_address,
            "optimizer": plan.optimizer, "optimizer_kwargs": plan.optimizer_kwargs,
            "names": [v.name for v in plan.variables_on(ps)]}


def _wait_for_chief(client: PSClient, timeout: float, emit):
    emit("state", state="waiting for chief")
    deadline = time.monotonic() + timeout
    delay = 0.01
    while (reply := client.pull()) is None:
        if time.monotonic() > deadline:
            raise RuntimeTimeout(f"the chief did not initialize the variables within {timeout:.0f}s: "
                                 "see worker 0's error")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    return reply


def run_worker(spec: ClusterSpec, index: int, plan: TrainPlan, model_fn, dataset, loss_fn,
               *, log=None) -> dict:
    """Train as worker ``index`` until the run reaches its step target or is stopped.

    Returns a summary: local steps, last global step, dropped pushes, timings.
    """
    task = spec.task("worker", index)
    device = local_device(task)
    model = build_model(model_fn, plan.seed).to(device)
    shards = _Shards(model, plan, len(spec.ps))
    emitter = MetricsEmitter(plan.metrics_address, f"worker:{index}")
    started = time.time()
    client = PSClient(spec, task=index, run_id=plan.run_id, timeout=plan.request_timeout)
    try:
        if task.is_chief:
            emitter.emit("state", state="initializing")
            client.init(plan.run_id, shards.values(), [_ps_config(plan, i) for i in range(len(spec.ps))])
            reply = client.pull()
        else:
            reply = _wait_for_chief(client, plan.request_timeout, emitter.emit)
        shards.load(reply)
        emitter.emit("state", state="training")

        batches = sharded_batches(dataset, index, plan.num_workers, plan.batch_size, plan.seed)
        local_step, samples, dropped = 0, 0, 0
        compute_s = comm_s = wait_s = window_s = 0.0
        staleness = Counter()
        loss_value, accuracy = float("nan"), None
        while not (reply.flags & Flag.STOPPED) and reply.step < plan.steps:
            t0 = time.perf_counter()
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            model.zero_grad(set_to_none=True)
            output = model(x)
            loss = loss_fn(output, y)
            loss.backward()
            t1 = time.perf_counter()
            computed_on = reply.step
            sent, received = client.bytes_sent, client.bytes_received
            reply = client.push_pull(computed_on, shards.grads())
            shards.load(reply)
            t2 = time.perf_counter()

            local_step += 1
            samples += len(y)
            step_wait = min(reply.wait_s, t2 - t1)
            compute_s += t1 - t0
            wait_s += step_wait
            comm_s += t2 - t1 - step_wait
            window_s += t2 - t0
            was_dropped = bool(reply.flags & Flag.DROPPED)
            dropped += was_dropped
            if not was_dropped:
                staleness[reply.value] += 1
            loss_value = loss.item()
            accuracy = batch_accuracy(output.detach(), y)
            emitter.emit("step", local_step=local_step, global_step=reply.step, loss=loss_value,
                         accuracy=accuracy, compute_s=t1 - t0, wait_s=step_wait, comm_s=t2 - t1 - step_wait,
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
