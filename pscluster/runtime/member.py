"""A worker as a member of a run: the model's state as the plan's variables (``Shards``, ``SparseRows``), its
way in (``join_run``) and out (``leave``), and its account of its steps (``StepTally``). The worker's context
(``context.WorkerContext``) is built on these; every loop, the library's and a user's, runs in one.

Joining: worker 0 is the chief: it sends the initial values and the run's configuration to every ps (INIT)
before anyone trains; the other workers wait for that (state "waiting for chief"), polling every few ms, never a
fixed sleep. The chief then waits for every worker's first pull (state "waiting for workers", ``START_WAIT_S`` at
most), so that a worker slower to start does not find the run over, as an async run of a few hundred steps would
be.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import replace

import torch

from ..errors import ConfigError, RuntimeTimeout
from ..spec import TaskSpec
from . import checkpoint, rescue
from .client import PSClient
from .lanes import value_set
from .optim import sparse_modules
from .plan import PsConfig, TrainPlan, VariableSpec, model_tensors
from .protocol import Flag


def local_device(task: TaskSpec) -> torch.device:
    """The torch device of a worker: its one visible GPU, or the CPU."""
    if not task.device.startswith("cuda"):
        return torch.device("cpu")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", task.device.split(":")[1])
    return torch.device("cuda:0")


def log_line(local_step: int, global_step: int, loss: float, accuracy: float | None, sec_per_batch: float,
             metrics: dict | None = None) -> str:
    """The familiar progress line of TF's distributed examples (a step_fn's metrics after the loss)."""
    acc = "" if accuracy is None else f", accuracy {accuracy:.3f}"
    acc += "".join(f", {name} {value:.4g}" for name, value in (metrics or {}).items())
    return (f"After {local_step} training steps ({global_step} global steps), "
            f"loss {loss:.3f}{acc} ({sec_per_batch:.3f} sec/batch)")


class Shards:
    """The model's state as the plan's variables (whole tensors or row shards of them) grouped by home ps, in
    plan order. Exchanged every step: trained dense variables (gradients out, values in) and buffers (values
    both ways); frozen parameters are loaded once (``load_frozen``); sparse variables are left to
    ``SparseRows``."""

    def __init__(self, model: torch.nn.Module, plan: TrainPlan, num_ps: int):
        params = {name: t for name, (t, _) in model_tensors(model)[0].items()}
        expected = {v.parameter: v for v in plan.variables}
        if set(params) != set(expected) or any(params[v.parameter].shape[1:] != v.shape[1:] or
                                                v.stop > (params[v.parameter].shape or [1])[0]
                                                for v in plan.variables):
            raise ConfigError("the model built on this worker differs from the planned one: "
                              "make model_fn deterministic (same layers and shapes every call)")
        self.params = params
        self.on_ps = {i: plan.variables_on(i) for i in range(num_ps)}
        self.dense = {i: [v for v in vs if v.exchanged] for i, vs in self.on_ps.items()}
        self.by_id = {v.id: v for v in plan.variables}
        self.has_frozen = any(v.kind == "frozen" for v in plan.variables)
        storages = Counter(t.untyped_storage().data_ptr() for t in params.values())
        # variables whose memory a reply may replace (``spare``): whole, on the CPU, sharing it with no other
        self._swappable = {v.id for v in plan.variables if v.exchanged and not v.partitioned
                           and (t := params[v.parameter]).device.type == "cpu" and t.is_contiguous()
                           and storages[t.untyped_storage().data_ptr()] == 1}
        self._spares: dict[int, torch.Tensor] = {}  # variable id -> the memory its next value may arrive in

    def view(self, v: VariableSpec, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """The part of ``tensor`` (default: the parameter) that variable ``v`` holds."""
        t = self.params[v.parameter].detach() if tensor is None else tensor
        return t[v.start:v.stop] if v.partitioned else t

    def values(self) -> dict:
        """Every variable's current value (sparse ones too), by ps: what the chief's INIT sends."""
        return {i: ([v.id for v in vs], [self.view(v) for v in vs]) for i, vs in self.on_ps.items()}

    @staticmethod
    def on_wire(v: VariableSpec, wire_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype a push carries exchanged variable ``v`` in: a trained fp32 one's gradient in mixed precision's
        ``wire_dtype`` when given, else the variable's own."""
        dtype = getattr(torch, v.dtype)
        return wire_dtype if v.kind == "param" and wire_dtype is not None and dtype == torch.float32 else dtype

    def exchanged(self, v: VariableSpec, wire_dtype: torch.dtype | None = None) -> torch.Tensor:
        """What a push carries for exchanged variable ``v``: a trained one's gradient (zeros when backward gave it
        none), a buffer's value; in ``on_wire``'s dtype."""
        if v.kind == "buffer":
            return self.view(v)
        g = self.params[v.parameter].grad
        g = self.view(v, g) if g is not None else torch.zeros(v.shape, dtype=getattr(torch, v.dtype))
        return g.to(self.on_wire(v, wire_dtype))

    def grads(self, wire_dtype: torch.dtype | None = None, sent=(), staged: dict | None = None) -> dict:
        """Per ps but those in ``sent``: (ids, tensors) of its exchanged variables (``exchanged``), or their
        host copies in ``staged`` (by variable id, see ``staging``)."""
        staged = staged or {}
        return {i: ([v.id for v in vs], [staged[v.id] if v.id in staged else self.exchanged(v, wire_dtype)
                                         for v in vs])
                for i, vs in self.dense.items() if i not in sent}

    def hook_gradients(self, variables, hook) -> dict[int, list[VariableSpec]]:
        """Call ``hook(parameter)`` each time backward has accumulated a gradient of a parameter behind the
        trained ``variables`` (``register_post_accumulate_grad_hook``, once per parameter: a parameter split
        into row shards, or tied, is hooked once). Returns those variables by the id of their parameter."""
        of_param: dict[int, list[VariableSpec]] = {}
        for v in variables:
            param = self.params[v.parameter]
            if id(param) not in of_param:
                param.register_post_accumulate_grad_hook(hook)
            of_param.setdefault(id(param), []).append(v)
        return of_param

    def dense_values(self) -> dict[str, torch.Tensor]:
        """Every dense variable's current value by variable name (a worker holds a sparse one only in part)."""
        return {v.name: self.view(v) for v in self.by_id.values() if not v.sparse}

    def spare(self, vid: int) -> torch.Tensor | None:
        """Memory of variable ``vid``'s shape and dtype that a reply in parts may write its new value into
        (``PSClient.receive_into``), for ``load`` to swap with the variable's own instead of copying; None for a
        variable whose memory is not its alone (a row shard, a GPU tensor, storage another tensor shares). The
        model's values stay those of the last whole reply: a reply cut off midway leaves only the spare torn."""
        if vid not in self._swappable:
            return None
        if vid not in self._spares:
            t = self.params[self.by_id[vid].parameter]
            self._spares[vid] = torch.empty(t.shape, dtype=t.dtype)
        return self._spares[vid]

    def load(self, reply, keep=None) -> dict[int, int]:
        """The reply's values into the model: a value that arrived in its ``spare`` becomes the variable's memory
        (the old memory its next spare), the others are copied; to a GPU without waiting (see ``host_copies``).
        ``keep(variable)``: whether to load it (default: all). Loading all, the values a ps left in its lane
        (``Flag.SHARED``) become the memory of the variables that may swap theirs: returns those lanes' sets of
        values the model holds now, by ps index (for ``PSClient.hold``, so that the ps writes the other set)."""
        held = {}
        for msg in reply.messages:
            lane_set = value_set(msg.flags) if keep is None else None
            for vid, t in zip(msg.ids, msg.tensors):
                if keep is not None and not keep(self.by_id[vid]):
                    continue
                if (lane_set is not None and vid in self._swappable) or t is self._spares.get(vid):
                    v = self.by_id[vid]
                    tensor = self.params[v.parameter]
                    if lane_set is None:
                        self._spares[vid] = tensor.data
                    else:
                        held[v.ps] = lane_set
                    tensor.data = t
                    continue
                value = self.view(self.by_id[vid])  # detached: no autograd record of the copy
                value.copy_(t, non_blocking=value.is_cuda)
        return held


class SparseRows:
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


def merge_pushes(dense: dict, sparse: dict) -> dict:
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


MAX_POLL_S = 0.02  # the longest pause between two polls of a worker waiting to start
START_WAIT_S = 10.0  # how long the chief waits for the other workers' first pull


def initialize(client: PSClient, plan: TrainPlan, shards: Shards, emit) -> None:
    """The chief's duty before anyone trains: INIT every ps with the model's initial values, or with the
    latest checkpoint's values, optimizer state and step (re-cut to this run's placement) when the plan
    says restore and one passes its checks. Refused checkpoints are reported and the previous is tried."""
    values = shards.values()
    configs = [PsConfig.for_ps(plan, i) for i in range(len(values))]
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
            configs[i] = replace(configs[i], step=ckpt.step, state=tuple(key for _, key, _ in slots),
                                 schedule_state=ckpt.schedule)
    else:
        emit("state", state="initializing")
    client.init(plan.run_id, values, [c.to_dict() for c in configs])
    if ckpt is not None:
        emit("restored", step=ckpt.step, path=str(ckpt.path))


def _wait_for_chief(client: PSClient, timeout: float, attempt: int, emit):
    emit("state", state="waiting for chief")
    deadline = time.monotonic() + timeout
    delay = 0.002
    while (reply := client.pull(attempt)) is None:
        if time.monotonic() > deadline:
            raise RuntimeTimeout(f"the chief did not initialize the variables within {timeout:.0f}s: "
                                 "see worker 0's error")
        time.sleep(delay)
        delay = min(delay * 2, MAX_POLL_S)
    return reply


def _wait_for_workers(client: PSClient, num_workers: int, emit) -> None:
    """The chief's start barrier: until every worker has pulled the initial values, or the run is stopped (a
    stop during the start ends it at once: the workers may never pull), ``START_WAIT_S`` at most (a worker that
    never comes is the recovery's business, not a reason to wait)."""
    if num_workers < 2:
        return
    emit("state", state="waiting for workers")
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        stats = client.stats()
        if any(s.get("stopped") for s in stats) or min(len(s.get("pulled", ())) for s in stats) >= num_workers:
            return
        time.sleep(MAX_POLL_S)


def leave(shards: Shards, plan: TrainPlan, index: int, step: int, local_steps: int, emit, error: Exception) -> None:
    """On the way out of a failed attempt: this worker's copy of the parameters it last pulled (of global step
    ``step``), from which recovery rebuilds a lost ps (``rescue``), and a "left" event with the ``local_steps`` it
    took in the attempt and that ``global_step``, so that the run's supervisor learns at once that this worker is
    out of the attempt (a script's worker is a process of its own, with no ipyparallel result to tell it), counts
    those steps and knows where it failed."""
    if plan.checkpoint_dir:
        try:
            rescue.write_copy(plan.checkpoint_dir, index, step, shards.dense_values(), run_id=plan.run_id,
                              attempt=plan.attempt)
        except OSError:
            pass  # the checkpoints on disk remain
    emit("left", attempt=plan.attempt, local_steps=local_steps, global_step=step,
         error=f"{type(error).__name__}: {error}")


def join_run(client: PSClient, shards: Shards, plan: TrainPlan, is_chief: bool, join: bool, emit):
    """This worker's way into the run, to the values of its first step (loaded into the model; returned as the
    reply): the chief initializes the ps tasks (``initialize``) and waits for the others' first pull, the others
    wait for the chief; ``join``: the run is on already (a chief that joins initializes it only if the one it
    replaces was lost before it had: while it initialized or restored). Frozen values are loaded, and the
    shared-memory lanes mapped where the plan says."""
    reply = client.pull(plan.attempt) if join else None
    if is_chief and reply is None:
        initialize(client, plan, shards, emit)
        client.pull()
        _wait_for_workers(client, plan.num_workers, emit)
        reply = client.pull()
    elif reply is None:
        reply = _wait_for_chief(client, plan.request_timeout, plan.attempt, emit)
    shards.load(reply)
    if shards.has_frozen:
        shards.load(client.pull_frozen())
    if plan.shared_memory:
        client.share(reply, note=lambda line: emit("log", line=line))
    return reply


class StepTally:
    """A worker's account of its steps: a "step" event each (the run store's metric rows), a progress line every
    ``plan.log_every`` (``log``: printed here too), and the summary it returns and sends at the end."""

    def __init__(self, plan: TrainPlan, index: int, emit, log=None):
        self.plan, self.index, self.emit, self.log = plan, index, emit, log
        self.started = time.time()
        self.local_step, self.samples, self.dropped = 0, 0, 0
        self.compute_s = self.comm_s = self.wait_s = self.window_s = 0.0
        self.staleness = Counter()
        self.loss, self.accuracy, self.metrics = float("nan"), None, {}

    def record(self, reply, *, samples: int, compute_s: float, exchange_s: float, loss: float, accuracy, metrics: dict,
               bytes_sent: int, bytes_received: int) -> None:
        """One step: ``compute_s`` spent on this worker's own work, ``exchange_s`` on the push-pull (of which the
        wait for the other workers is ``reply.wait_s``, the rest communication)."""
        self.local_step += 1
        self.samples += samples
        self.loss, self.accuracy, self.metrics = loss, accuracy, metrics
        wait = min(reply.wait_s, exchange_s)
        self.compute_s += compute_s
        self.wait_s += wait
        self.comm_s += exchange_s - wait
        self.window_s += compute_s + exchange_s
        was_dropped = bool(reply.flags & Flag.DROPPED)
        self.dropped += was_dropped
        if not was_dropped:
            self.staleness[reply.value] += 1
        self.emit("step", local_step=self.local_step, global_step=reply.step, loss=loss, accuracy=accuracy,
                  compute_s=compute_s, wait_s=wait, comm_s=exchange_s - wait, bytes_sent=bytes_sent,
                  bytes_received=bytes_received, staleness=None if was_dropped else reply.value, dropped=was_dropped,
                  **({"metrics": metrics} if metrics else {}))
        if self.local_step % self.plan.log_every == 0:
            line = log_line(self.local_step, reply.step, loss, accuracy, self.window_s / self.plan.log_every, metrics)
            self.window_s = 0.0
            self.emit("log", line=line)
            if self.log is not None:
                self.log(line)

    def summary(self, global_step: int, client: PSClient, dropped_metrics: int, **extra) -> dict:
        """The worker's summary (``extra``: what its loop adds), also sent as its "done" event: the run ends on it
        if ipyparallel never delivers the result."""
        summary = {"task": self.index, "local_steps": self.local_step, "global_step": global_step,
                   "dropped": self.dropped, "samples": self.samples, "wall_s": time.time() - self.started,
                   "compute_s": self.compute_s, "wait_s": self.wait_s, "comm_s": self.comm_s,
                   "final_loss": self.loss, "final_accuracy": self.accuracy, "final_metrics": self.metrics,
                   "staleness": dict(self.staleness), "bytes_sent": client.bytes_sent,
                   "bytes_received": client.bytes_received, "metrics_dropped": dropped_metrics, **extra}
        self.emit("done", attempt=self.plan.attempt, **{k: v for k, v in summary.items() if k != "task"})
        return summary
