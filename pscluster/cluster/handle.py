"""Cluster, the kernel's handle on a PS cluster: ps and worker tasks on ipyparallel engines (local, or started
on other hosts by a launcher: ssh, mpi, slurm, or any of ipyparallel's; see ``launchers``).

    cluster = Cluster(ps=1, workers=2).start()
    cluster = Cluster(ps=1, workers=4, launcher="ssh", hosts=["node1", "node2=2", "node3=2"], ps_hosts=["node1"])
    run = cluster.train(model_fn, dataset, loss_fn, optimizer="sgd", lr=0.1, mode="sync", steps=600)
    run.wait()
    cluster.stop()
"""

from __future__ import annotations

import html
import inspect
import io
import os
import secrets
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..errors import ClusterStateError, ConfigError, PeerLost, RuntimeTimeout
from ..metrics.store import RunStore
from ..runtime import remote
from ..runtime.data import first_batch
from ..runtime import optim
from ..runtime import options as run_options
from ..runtime.options import DEFAULTS
from ..runtime.plan import TrainPlan, describe_variables, training_plan
from ..runtime.steps import check_loss, check_step
from ..runtime.seeding import build_model
from ..spec import ClusterSpec, TaskSpec, threads_per_task
from . import reaper, registry, scaling
from .engines import EngineSet
from . import launchers
from .launchers import Launcher
from .progress import StartProgress, in_kernel
from .roles import assign_roles, host_gpus, worker_devices
from .run import Run
from .run_start import adopt_run, start_run
from .script_tasks import PeerWorker
from .supervisor import Supervisor
from .shipping import ship

if TYPE_CHECKING:
    from ..widgets.placement_plan import PlacementPlan
    from .session import Session


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: use an integer >= {minimum}")
    return value


class Cluster:
    """ps and worker tasks on ipyparallel engines. Worker 0 is the chief.

    ``launcher``: the name of a launcher (``launchers.names()``: ``local``, engines on this machine, the default;
    ``ssh``, ``mpi``, ``slurm``; any of ipyparallel's engine launchers such as ``pbs``; a registered one), an
    importable class, or a ``Launcher``; ``launcher_options`` are that launcher's: ``hosts``, ``ps_hosts``,
    ``interface``, ``ports``, ``ssh_args``, ``remote_python``, ``slurm_partition``, ``account``, ``time_limit``,
    ``sbatch_args``, ``mpi_args``... (see ``pscluster.cluster.launchers``). The ps tasks go to the ps hosts,
    the workers to the others.

    ``gpus``: how many GPUs the workers of each host share (one per worker engine, round-robin);
    default: every GPU the host's engines see, 0 without CUDA. ``store``: the run store
    file (default ``$PSCLUSTER_HOME/runs.sqlite``). ``threads``: torch intra-op threads of each task;
    default: this machine's cores shared out among the tasks (at least 1), as every engine runs here —
    more threads than cores make the tasks spin against each other.

    ``encrypt``: the data plane runs over ZeroMQ CURVE encryption (keys derived from the cluster's secret), not
    only signed.

    ``spares``: engines kept started beyond the tasks', so that a lost task's replacement (or a worker added by
    ``scale``) takes one at once instead of waiting for a new engine to start and register; each one taken is
    started again in the background. Default: 1 with local engines, 0 with a remote launcher (a spare holds a
    host's slot or a batch allocation). A cluster taken over by ``attach`` keeps none.

    ``detached``: the cluster (and a run in progress) outlives the process that started it, until
    ``stop()``; a later process takes it over with ``Cluster.attach(name)``. Otherwise every process of
    the cluster dies with the process that started it.
    """

    def __init__(self, ps: int = 1, workers: int = 2, *, gpus: int | None = None, name: str | None = None,
                 store: str | os.PathLike | None = None, threads: int | None = None, detached: bool = False,
                 launcher: str | Launcher = launchers.DEFAULT, encrypt: bool = False, spares: int | None = None,
                 **launcher_options):
        self.num_ps = _count("ps", ps, 1)
        self.num_workers = _count("workers", workers, 1)
        self.launcher = launcher if isinstance(launcher, Launcher) else Launcher(launcher, **launcher_options)
        self.spares = self.launcher.default_spares if spares is None else _count("spares", spares, 0)
        self.launcher.check_tasks(self.num_ps, self.num_workers)
        if detached and not self.launcher.local:
            raise ConfigError(f"detached=True works with local engines only, not {self.launcher.kind}: "
                              "leave detached out, or keep the kernel running")
        self.threads = threads_per_task(ps + workers) if threads is None else _count("threads", threads, 1)
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus is not None and _count("gpus", gpus, 0) > available and self.launcher.local:
            raise ConfigError(f"gpus={gpus} but this machine has {available}: use gpus <= {available}")
        self.gpus = available if gpus is None and self.launcher.local else gpus
        self.name = name or f"pscluster-{os.getpid()}-{secrets.token_hex(2)}"
        self.encrypt = encrypt
        self.detached = detached
        self.spec: ClusterSpec | None = None
        self._scaling = threading.Lock()  # one scale request at a time
        self.runs: list[Run] = []
        self._store_path = store
        self._store: RunStore | None = None
        self._engines: EngineSet | None = None
        self._registration: registry.Registration | None = None
        self._ps_objects: tuple[list[str], bytes] | None = None  # what the ps tasks of the run must be given

    @property
    def store(self) -> RunStore:
        """The run store this cluster records its runs in (opened on first use)."""
        if self._store is None:
            self._store = RunStore(self._store_path)
        return self._store

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.spec is not None

    def start(self, *, progress: bool | None = None) -> "Cluster":
        """Start the engines, assign roles, start the ps servers. Returns self. ``progress``: show each stage
        (engines up n of N, roles assigned, ps serving n of P) in one line as it goes; None: in a kernel only."""
        if self.running:
            raise ClusterStateError(f"cluster {self.name} is already running: stop() it first")
        if self.detached and registry.find(self.name) is not None:
            raise ClusterStateError(f"a cluster named {self.name} is running: attach to it "
                                    f"(Cluster.attach({self.name!r})) or pick another name")
        optim.preload_in_background()  # for train()'s optimizer check, while the engines start
        launcher = self.launcher
        where = "local engines" if launcher.local else f"engines of the {launcher.kind} launcher"
        shown = progress if progress is not None else in_kernel()
        show = StartProgress(f"{self.name}: {self.num_ps} ps + {self.num_workers} workers on {where}") if shown \
            else (lambda stage: None)
        engines = EngineSet(self.num_ps + self.num_workers, self.name, detached=self.detached, launcher=launcher,
                            roles=(self.num_ps, self.num_workers), files=[registry.entry_path(self.name)],
                            spares=self.spares, progress=show)
        infos = engines.start()
        try:
            spec = assign_roles(infos, self.num_ps, self.num_workers, name=self.name,
                                gpus=self.gpus if launcher.local else host_gpus(infos, self.gpus),
                                ps_machines=launcher.ps_machines(engines, infos, self.num_ps, self.num_workers),
                                bind_host=lambda e: launcher.bind_host(e.address))
            spec = replace(spec, encrypt=self.encrypt)
            show(f"roles assigned, starting {self.num_ps} ps")
            # all sent at once: an engine runs its calls in order, so each ps starts after its configure_task
            configured = [engines.view(t.engine_id).apply_async(remote.configure_task, t.device, self.threads)
                          for t in [*spec.ps, *spec.workers]]
            ports = [engines.view(t.engine_id).apply_async(remote.start_ps, spec.secret, t.index, t.host, 0,
                                                           launcher.ports, spec.encrypt)
                     for t in spec.ps]
            for c in configured:
                c.get(timeout=60)
            serving = []
            for p in ports:
                serving.append(p.get(timeout=60))
                show(f"ps serving {len(serving)} of {self.num_ps}")
            self.spec = spec.with_ps_ports(serving)
        except BaseException:
            engines.stop()
            raise
        self._engines = engines
        try:
            self._registration = registry.Registration(self)  # listed in the side panel from now on
        except OSError:  # its registry entry cannot be written (a full disk): no cluster left half started
            self._engines, self.spec = None, None
            engines.stop()
            raise
        show("ready")
        return self

    # --- what recovery needs (see recovery.Tasks) ------------------------------------------
    def lost(self, task: TaskSpec) -> bool:
        """Whether the engine of ``task`` is gone (its process ended, or it missed the controller's heartbeats)."""
        return self._engines is not None and task.engine_id is not None and self._engines.lost(task.engine_id)

    def kill_task(self, task: TaskSpec) -> None:
        """SIGKILL the process of ``task``, on whichever host it runs."""
        self._engines.kill(task.engine_id)

    @property
    def loss_grace_s(self) -> float:
        # a local engine's death is seen at once, and a hung one is lost (HEARTBEAT_DEADLINE_S) before its
        # workers' connections time out (client.HEARTBEAT_TIMEOUT_MS); a remote death takes the deadline
        if self.launcher.local:
            return 1.0
        return launchers.HEARTBEAT_DEADLINE_S + 2.0

    def stop(self) -> None:
        """Stop training, the ps servers and every engine; leaves no process behind."""
        if self._engines is None:
            return
        self._registration.update("stopping")
        active = self.active_run
        if active is not None:
            try:
                active.stop()
            except Exception:
                pass
        self._engines.stop()
        self._engines = None
        self.spec = None
        self._registration.close()
        self._registration = None
        for run in self.runs:
            registry.remove_payload(self.name, run.id)

    @classmethod
    def attach(cls, name: str) -> "Cluster":
        """Take over the detached cluster ``name``, started by a process that has ended: its engines, and
        the run it was training (followed from here on: ``cluster.runs[-1]``, its metrics recorded again)."""
        entry = registry.read(name)
        if entry is None or not entry.get("detached"):
            raise ClusterStateError(f"no detached cluster named {name!r}: see pscluster.clusters() for the "
                                    "running ones, or start it with Cluster(..., detached=True)")
        if reaper.alive(entry["owner_pid"]) and entry["owner_pid"] != os.getpid():
            raise ClusterStateError(f"cluster {name} is still owned by process {entry['owner_pid']}: "
                                    "stop it there, or end that process first")
        state = entry["detached"]
        if not reaper.alive(state["controller_pid"]):
            registry.remove(name)
            raise ClusterStateError(f"cluster {name} is gone (its controller, pid {state['controller_pid']}, "
                                    "ended): start a new one")
        cluster = cls(ps=entry["ps"], workers=entry["workers"], gpus=state["gpus"], name=name,
                      store=entry["store"], threads=state["threads"], detached=True)
        cluster._engines = EngineSet.attach(state["cluster_file"], {int(k): v for k, v in state["engines"].items()},
                                            state["pids"])
        cluster.spec = ClusterSpec.from_dict(state["spec"])
        cluster._registration = registry.Registration(cluster)
        if state.get("run"):
            cluster._adopt(state["run"])
        return cluster

    def _adopt(self, state: dict) -> None:
        """Follow the run a detached cluster's previous owner was training, unless it was finalized."""
        plan = TrainPlan.from_json(state["plan"])
        if (self.store.run(plan.run_id) or {}).get("status") not in ("starting", "training"):
            return
        results = [self._engines.client.get_result(ids[0], block=False) if ids else
                   LostWorker(ClusterStateError("its engine was lost before it started"))
                   for ids in state["msg_ids"]]
        run = adopt_run(self.spec, plan, self.store, results, tasks=self,
                        payload=registry.read_payload(self.name, plan.run_id))
        self.runs.append(run)
        self.record()

    def detached_state(self) -> dict:
        """What a later process needs to attach to this (detached, running) cluster: the registry keeps it."""
        run = self.active_run
        return {"controller_pid": self._engines.controller_pid, "cluster_file": self._engines.cluster_file,
                "spec": self.spec.to_dict(), "engines": {str(k): v for k, v in self._engines.engines.items()},
                "pids": self.pids, "gpus": self.gpus, "threads": self.threads,
                "run": None if run is None else {"plan": run.plan.to_json(),
                                                 "msg_ids": [ar.msg_ids for ar in run.supervisor.worker_results]}}

    def __enter__(self) -> "Cluster":
        return self if self.running else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        """Every process of this cluster (engines and the ipyparallel controller)."""
        return list(self._engines.pids) if self._engines else []

    # --- training ---------------------------------------------------------------------------
    @property
    def active_run(self) -> Run | None:
        return next((r for r in self.runs if not r.done), None)

    def _require_running(self, what: str) -> ClusterSpec:
        if self.spec is None:
            raise ClusterStateError(f"cannot {what}: the cluster is not running, start() it first")
        return self.spec

    @run_options.keywords(run_options.TRAIN)
    def train(self, model_fn, dataset, loss_fn=None, *, step_fn=None, param_groups=None, scheduler=None,
              scheduler_options: dict | None = None, code: str | None = None, test_dataset=None, collate_fn=None,
              **keywords) -> Run:
        """Start training in the background and return its Run (``run.wait()`` blocks).

        ``dataset``: a map-style dataset (each worker reads its own shard, reshuffled every epoch, as
        ``DistributedSampler`` orders it), a ``torch.utils.data.IterableDataset`` (each worker, and each of its
        loader processes, keeps its own part of the stream; see ``runtime.data``), or a ``DataLoader`` over one,
        taken apart into its dataset, ``batch_size``, ``shuffle``, ``collate_fn``, ``num_workers``,
        ``prefetch_factor``, ``pin_memory`` and ``drop_last``. ``batch_size``: per worker (default 64, or the
        DataLoader's). ``loader_workers``: loader processes per worker that build the next batches ahead of the
        step (DataLoader's ``num_workers``), keeping ``prefetch_factor`` each; ``collate_fn`` makes a batch of
        items; ``pin_memory``: page-locked batches for GPU workers.
        ``model_fn``: a torch.nn.Module or a zero-argument callable that builds one. A batch is any structure of
        tensors (tuples, lists, dicts, nested); the default step takes ``batch = (inputs, target)`` and computes
        ``loss_fn(model(inputs), target)`` (``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict);
        ``step_fn(model, batch)`` replaces it for anything else and returns the loss or ``(loss, {"metric":
        value})`` (then ``loss_fn`` may be None; the metrics are logged and stored with the loss). The step is
        tried once here, on two items of the dataset, so a mistake in it fails now, not on every worker.
        ``max_grad_norm``: each worker clips its gradients to this total 2-norm before it pushes them (torch's
        ``clip_grad_norm_``). ``on_nonfinite``: a non-finite loss or gradient fails the run at that step
        (``"fail"``, naming the worker and step; nothing is pushed, so the ps keep the last good parameters) or
        leaves the batch out (``"skip"``, counted in the worker's summary and a ``nonfinite`` event).
        ``on_divergence``: a loss that rose far above its level at the start and stayed there (the rule of
        ``metrics.divergence``) is flagged in the run's record and every view (``"flag"``), or also stops the run
        (``"stop"``) or fails it (``"fail"``).
        ``precision``: ``"bf16"`` (CPU and GPU) or ``"fp16"`` (GPU workers, with dynamic loss scaling) runs each
        worker's forward and loss under ``torch.autocast`` and sends the gradients in that dtype; the ps keeps
        fp32 values and optimizer state, and the trained state is fp32.
        ``optimizer``: a ``torch.optim`` class or its name, or any optimizer class (one defined in the notebook is
        shipped to the ps tasks); extra keyword arguments go to it (anything torch takes: tuples, tensors).
        ``param_groups``: ``[{"params": ["*.bias", "*norm*"], "weight_decay": 0.0}, ...]``: a parameter joins the
        first group with a name pattern (fnmatch) that matches it, whose options override the keyword arguments.
        ``scheduler``: a ``torch.optim.lr_scheduler`` class or name built with ``scheduler_options``, or a function
        of the global step returning the learning-rate factor (warmup included); the ps steps it on the global
        step, as a loop that calls ``scheduler.step()`` after each ``optimizer.step()``, restores included. The
        optimizer and its schedule are built here once on the model, so torch's own error for a bad option comes
        now, in one line.
        ``steps``: the global step target. ``replicas_to_aggregate`` (sync): gradients
        averaged per global step, default the number of workers; fewer make the others backup workers (the
        first gradients of a step are applied, those of the slowest workers dropped as stale); more make each
        worker give several per step, as TF's tokens do (one worker, 2 replicas: two local steps per global
        step). ``code``: the source of the model cell, kept in the run store (default: the source of
        ``model_fn`` when it has one).
        ``test_dataset``: evaluated in this process every ``eval_every`` global steps (default:
        a tenth of ``steps``) and at the end; results go to the run store and the dashboard.
        ``mode``: ``sync``, ``async`` or ``ssp`` (bounded staleness: no worker runs more than
        ``staleness_bound`` steps ahead of the slowest). ``max_lead`` (async): a worker pushes at most this
        fraction more than the slowest live one (a few steps more at the start), so one the OS gives less CPU
        still trains on its share of the data; None lets workers of different speeds each go at its own.
        ``placement``: ``"round_robin"``,
        ``"greedy"`` (TF's), ``"largest_first"``, a ``{variable: ps}`` dict or a strategy from
        ``pscluster.placement``;
        ``partition``: ``{variable name or prefix: shard count or partitioner}`` splits variables
        along dim 0 across ps tasks (see ``plan()`` to compare placements before training).
        ``shared_memory``: a worker exchanges dense values with a ps on its own host through shared memory
        (False: always over the socket). ``pipeline`` (async only, dense models): each worker computes its
        next gradients while its push and pull are in flight, on the parameters it already has, so the round
        trip hides behind compute; every gradient is then at least one step stale. ``overlap`` (sync): a
        worker's push to a ps over the socket leaves part by part while backward still runs, as DDP's buckets
        do (CPU workers; off where a push could change after backward: ``max_grad_norm``,
        ``on_nonfinite="skip"``, fp16; see ``runtime.overlap``); on a GPU worker (sync or async, without
        ``pipeline``, ``max_grad_norm`` or fp16) each gradient's copy to the host starts as soon as backward
        has produced it (``runtime.staging``); the same steps as without it.

        The model's state is its ``state_dict()``: trained parameters, frozen ones (``requires_grad=False``: held
        by the ps, never pushed, never changed) and buffers (BatchNorm's running statistics...), each placed on a
        ps. ``buffers``: how the ps keeps the buffers the workers compute: ``"chief"`` (default) takes worker
        0's at every update, as DDP's ``broadcast_buffers`` takes rank 0's; ``"average"`` the mean of every
        worker's latest values. Every worker starts each step from the ps's buffers.

        Checkpoints (every ps writes its shard, a manifest commits them) go to ``checkpoint_dir`` (default:
        ``checkpoints/run-<id>`` next to the run store, or ``run-<id>.2``... where an earlier store of the same
        path left one) every ``checkpoint_every`` global steps and every
        ``checkpoint_secs`` seconds (either 0 / None: off), on ``run.checkpoint()`` and at the end; the
        newest ``keep_checkpoints`` are kept. With ``restore``, the chief starts from the latest checkpoint
        in ``checkpoint_dir`` when there is one (one of another model is refused here, CheckpointError).
        ``resume="latest"`` continues the newest earlier run of the same
        ``name`` (``resume=<run id>``: that run): its checkpoint folder becomes this run's, so training goes on
        from its latest checkpoint (no earlier run of that name: from scratch). Lost workers and ps tasks are
        replaced during the run: a lost ps rolls every ps back to the latest checkpoint.
        """
        spec = self._require_running("train")
        if self.active_run is not None:
            raise ClusterStateError(f"{self.active_run.name} is still training: "
                                    "wait for it (run.wait()) or stop it (run.stop())")
        if not isinstance(model_fn, torch.nn.Module) and not callable(model_fn):
            raise ConfigError("model_fn must be a torch.nn.Module or a function that builds one")
        if step_fn is not None and not callable(step_fn):
            raise ConfigError("step_fn must be a function f(model, batch) -> loss or (loss, {'metric': value})")
        check_loss(loss_fn, step_fn)
        run_plan, options, dataset, collate_fn, model = training_plan(
            model_fn, dataset, keywords, entry=run_options.TRAIN, of=self.train, num_ps=self.num_ps,
            num_workers=self.num_workers, param_groups=param_groups, scheduler=scheduler,
            scheduler_options=scheduler_options, collate_fn=collate_fn)
        if options.precision == "fp16" and not all(t.device.startswith("cuda") for t in spec.workers):
            raise ConfigError("precision='fp16' needs CUDA workers (this cluster's workers run on the CPU): use "
                              "precision='bf16'")
        optim.check(model, run_plan.optimizer_spec, steps=options.steps)
        example_batch = first_batch(dataset, 2, collate_fn)
        check_step(model, loss_fn, step_fn, example_batch)
        return self._launch(spec, run_plan, [run_plan.optimizer_spec],
                            ship(model_fn, dataset, loss_fn, step_fn, collate_fn), options.of(run_options.START),
                            model_fn=model_fn, loss_fn=loss_fn, step_fn=step_fn, collate_fn=collate_fn,
                            test_dataset=test_dataset, example_batch=example_batch, code=code or _source(model_fn))

    def run(self, train_fn, *, code: str | None = None, **options) -> Run:
        """Run ``train_fn(ctx)`` on every worker, the user's own training loop (see ``pscluster.runtime.context``),
        in the background; returns its Run, as ``train`` does.

        ``train_fn`` runs on the workers only, once on each (again on one started anew after a lost task). The chief
        (worker 0) calls it first, in a thread of its engine: at its loop's first training call (a registered module's
        first forward once an optimizer is registered, a batch of ``ctx.shard``, ``ctx.global_step``, ``should_stop()``,
        ``log`` or a step), the modules it gave ``ctx.model`` and the optimizers it gave ``ctx.optimizer`` make the
        run's plan here (its variables, their placement, the ps tasks' optimizers); the run is recorded, every other
        worker calls ``train_fn`` on its engine, and the chief trains on in the same call. From then on a worker's
        modules hold the run's values and ``optimizer.step()`` is the exchange with the ps tasks. What is wrong with
        ``train_fn`` up to that call (it fails, registers no model or optimizer, returns before it, or the optimizer
        refuses its options) is a one-line ``ConfigError`` here, before anything trains.
        ``options``: those of ``pscluster.runtime.options`` that a user's loop takes (``options.names("run")``:
        ``mode``, ``steps`` (the global step target ``ctx.should_stop()`` watches), ``replicas_to_aggregate``,
        ``seed``, ``placement``, ``partition``, the checkpoint options, ``restore``, ``resume``, ``name``...),
        as in ``train``. ``code``: kept in the run store (default: the source of ``train_fn``).
        """
        from ..runtime.context import loop_plan, settings_plan

        spec = self._require_running("run")
        if self.active_run is not None:
            raise ClusterStateError(f"{self.active_run.name} is still training: "
                                    "wait for it (run.wait()) or stop it (run.stop())")
        if not callable(train_fn):
            raise ConfigError("train_fn must be a function of the worker's context: def train_fn(ctx): ...")
        given = run_options.RunOptions.take(run_options.RUN, options, caller="Cluster.run()")
        payload = ship(train_fn)
        chief = ChiefCalls(self._engines.view(spec.task("worker", 0).engine_id), spec,
                           settings_plan(given, num_workers=self.num_workers), payload)
        model, modules, optimizers = chief.registered()
        try:
            for optimizer_spec in optimizers:
                optim.check(model, optimizer_spec, steps=given.steps)
            run_plan = loop_plan(model, modules, optimizers, given, num_ps=self.num_ps, num_workers=self.num_workers)
            return self._launch(spec, run_plan, optimizers, payload, given.of(run_options.START), model_fn=model,
                                code=code or _source(train_fn), chief=chief)
        except BaseException:
            chief.cancel()
            raise

    @run_options.keywords(run_options.SESSION)
    def session(self, model_fn, optimizer, loss_fn=None, *, step_fn=None, **keywords) -> "Session":
        """A session over the workers for a loop the notebook drives (seed 004's in-graph replication; see
        ``pscluster.cluster.session``): ``session.step(batch)`` splits the batch across the workers, the ps tasks
        apply one averaged update (sync), and it returns the batch's loss and metrics.

        ``model_fn``: a module or a function that builds one. ``optimizer``: a torch optimizer class (with
        ``optimizer_kwargs``) or a function of the model that builds the optimizer (tensor groups too);
        ``session.optimizer`` is the controller's copy, whose groups' options (a learning rate a
        ``ReduceLROnPlateau`` set) apply to each step. ``loss_fn`` / ``step_fn``, ``placement``, ``partition``,
        ``seed``, ``name`` and the checkpoint options as in ``train``; ``request_timeout``: the most one step may
        take."""
        from ..runtime.context import loop_plan
        from ..runtime.session_worker import build_optimizer
        from .session import SESSION_STEPS, Session

        spec = self._require_running("start a session")
        if self.active_run is not None:
            raise ClusterStateError(f"{self.active_run.name} is still training: "
                                    "wait for it (run.wait()) or stop it (run.stop())")
        if self.detached:
            raise ConfigError("a session follows the notebook's loop: start the cluster without detached=True")
        check_loss(loss_fn, step_fn)
        given, optimizer_kwargs = run_options.split(run_options.SESSION, keywords)
        options = run_options.RunOptions.take(run_options.SESSION, given, caller="session()")
        model = build_model(model_fn, options.seed)
        local = build_optimizer(optimizer, model, optimizer_kwargs)
        optimizer_spec = optim.spec_of(local, list(model.named_parameters()))
        optim.check(model, optimizer_spec)
        run_plan = loop_plan(model, (type(model).__name__,), [optimizer_spec],
                             options.replace(mode="sync", steps=SESSION_STEPS), num_ps=self.num_ps,
                             num_workers=self.num_workers, session=True)
        run = self._launch(spec, run_plan, [optimizer_spec],
                           ship(model_fn, optimizer, optimizer_kwargs, loss_fn, step_fn),
                           options.of(run_options.START), model_fn=model, loss_fn=loss_fn, step_fn=step_fn,
                           code=_source(model_fn))
        return Session(self, run, local, model, options.request_timeout)

    def task_view(self, task: TaskSpec):
        """The ipyparallel view of ``task``'s engine."""
        return self._engines.view(task.engine_id)

    def _launch(self, spec: ClusterSpec, run_plan: TrainPlan, optimizers: list[optim.OptimizerSpec], payload: bytes,
                started: run_options.RunOptions, *, model_fn, loss_fn=None, step_fn=None, collate_fn=None,
                test_dataset=None, example_batch=None, code, chief: "ChiefCalls | None" = None) -> Run:
        """Give the ps tasks what the run's optimizers need, then start the run (``start_run``, with the options
        read at its start, ``started``) in the notebook's checkpoint folders (``payload``: what each worker is
        given, see ``remote.train_worker``; ``chief``: worker 0 begun already, waiting for the run's plan)."""
        self._ship_to_ps({name: obj for o in optimizers for name, obj in optim.shipped(o).items()})

        def launch(supervisor: Supervisor) -> list:
            if self.detached:  # for replacement workers after an attach
                registry.write_payload(self.name, supervisor.plan.run_id, payload)
            return [chief.go_on(supervisor.plan) if chief is not None and t.index == 0
                    else self.launch_worker(spec, t.index, supervisor) for t in spec.workers]

        run = start_run(self.store, spec, run_plan, started, launch=launch, cluster=self.name, code=code,
                        model_fn=model_fn, loss_fn=loss_fn, step_fn=step_fn, collate_fn=collate_fn,
                        test_dataset=test_dataset, example_batch=example_batch, tasks=self, payload=payload,
                        metrics_host=self.launcher.controller_ip(), metrics_ports=self.launcher.ports)
        self.runs.append(run)
        self.record()
        return run

    def _ship_to_ps(self, objects: dict[str, object]) -> None:
        """Give every ps task (and each that replaces one later) the optimizer classes and schedule functions the
        run names but a ps cannot import (defined in the notebook), over the control plane."""
        self._ps_objects = (list(objects), ship(*objects.values())) if objects else None
        for t in self.spec.ps:
            self._register_objects(self._engines.view(t.engine_id))

    def _register_objects(self, view) -> None:
        if self._ps_objects is not None:
            view.apply_sync(remote.register_objects, *self._ps_objects)

    # --- tasks: kill, replace ----------------------------------------------------------------
    def launch_worker(self, spec: ClusterSpec, index: int, run: Supervisor, *, join: bool = False):
        """Start worker ``index`` of ``run`` on its engine (``join``: in place of a lost one); its result, or a
        ``LostWorker`` when the engine is gone already (lost since the spec named it: the run replaces it)."""
        task = spec.task("worker", index)
        try:
            view = self._engines.view(task.engine_id)
        except IndexError as e:  # ipyparallel no longer lists the engine
            return LostWorker(ClusterStateError(f"worker {index}'s engine {task.engine_id} was lost: {e}"))
        if run.plan.session:  # its loop runs in a thread of the engine, which stays free for the session's steps
            view.apply_sync(remote.start_session_worker, spec.to_json(), index, run.plan.to_json(), run.payload, join)
            return PeerWorker(index, None, run)
        return view.apply_async(remote.train_worker, spec.to_json(), index, run.plan.to_json(), run.payload, join)

    def record(self) -> None:
        """Rewrite this cluster's registry entry (its tasks or its run's workers changed)."""
        if self._registration is not None:
            self._registration.update("running")

    def _new_engine(self, task: TaskSpec) -> TaskSpec:
        """``task`` on a new engine (placed by the launcher, near the tasks whose engines still answer), configured
        for its device (a ps serving on a new port)."""
        live = [t for t in (*self.spec.ps, *self.spec.workers) if t.engine_id in self._engines.registered()]
        engine = self._engines.add_engine(task, live)
        view = self._engines.view(engine.engine_id)
        if task.device != "cpu" and engine.gpus == 0:
            task = replace(task, device="cpu")
        view.apply_sync(remote.configure_task, task.device, self.threads)
        task = replace(task, engine_id=engine.engine_id, pid=engine.pid, host=self.launcher.bind_host(engine.address))
        if task.role == "ps":
            self._register_objects(view)
            task = replace(task, port=view.apply_sync(remote.start_ps, self.spec.secret, task.index, task.host, 0,
                                                      self.launcher.ports, self.spec.encrypt))
        return task

    def replace_task(self, role: str, index: int) -> ClusterSpec:
        """Give task ``role:index`` a new engine (its old one was lost); the cluster's new spec. During a run
        the caller (recovery) holds the run's membership, as every change of the spec does."""
        task = self._new_engine(self._require_running("replace a task").task(role, index))
        self.spec = self.spec.with_task(task)
        self.record()  # the side panel lists the new engine
        return self.spec

    def scale(self, workers: int) -> scaling.ScaleRequest:
        """Add or remove workers, during a run too: added ones join it with the current parameters, removed
        ones (the highest-numbered, never the chief) end at their next step. Sync runs keep their number of
        backup workers (see ``scaling``). Returns at once: new engines start in the background while the run
        trains; ``.wait()`` on the returned request gives the cluster's new spec. Requests run one at a time."""
        self._require_running("scale")
        n = _count("workers", workers, 1)
        return scaling.ScaleRequest(n, lambda: self._scale_to(n))

    def _scale_to(self, n: int) -> ClusterSpec:
        with self._scaling:
            spec = self._require_running("scale")
            added = []
            if n > len(spec.workers):
                devices = worker_devices(n, self.gpus if self.launcher.local else 0)  # remote: see _new_engine
                added = [self._new_engine(TaskSpec("worker", i, host=spec.chief.host, device=devices[i]))
                         for i in range(len(spec.workers), n)]
            try:
                removed = self._resize(n, added)
            except BaseException:
                self._engines.remove_engines([t.engine_id for t in added])
                raise
            self._engines.remove_engines([t.engine_id for t in removed])
            self.num_workers = n
            self.record()
            return self.spec

    def _resize(self, n: int, added: list[TaskSpec]) -> list[TaskSpec]:
        """The cluster's spec, and its active run, to ``n`` workers (``added``: on new engines), under the run's
        membership, so that a recovery sees the spec before or after, never between; returns the removed tasks.
        A ps lost meanwhile fails the request to it: the recovery (waiting for the membership) goes first, then
        this is tried again on the run it restarted."""
        removed: list[TaskSpec] = []

        def resized() -> ClusterSpec:
            return replace(self.spec, workers=(self.spec.workers + tuple(added))[:n])

        def take(spec: ClusterSpec) -> None:
            removed[:] = self.spec.workers[n:]
            self.spec = spec

        for tries_left in reversed(range(scaling.JOIN_TRIES)):
            run = self.active_run
            try:
                if run is None:
                    take(resized())
                else:
                    run.supervisor.resize(resized, then=take)
                return removed
            except (RuntimeTimeout, PeerLost):
                if not tries_left:
                    raise
                time.sleep(scaling.JOIN_PAUSE_S)
        raise AssertionError("unreachable")

    def kill(self, task: str) -> int:
        """SIGKILL the process of ``task`` (``"worker:1"``, ``"ps:0"``), to try a failure on purpose;
        a run in progress recovers from it. Returns the pid killed."""
        spec = self._require_running("kill a task")
        role, _, index = task.partition(":")
        if role not in ("ps", "worker") or not index.isdigit():
            raise ConfigError(f"task {task!r}: name it role:index, e.g. worker:1 or ps:0")
        victim = spec.task(role, int(index))
        self.kill_task(victim)
        return victim.pid

    def plan(self, model_fn, *, placement=DEFAULTS.placement, partition: dict | None = DEFAULTS.partition,
             optimizer=DEFAULTS.optimizer, seed: int = DEFAULTS.seed, **optimizer_kwargs) -> PlacementPlan:
        """Where ``train`` would put the model's variables, without training (or starting the cluster: only
        the number of ps tasks counts). ``placement`` and ``partition`` as in ``train``; ``optimizer`` and
        its keyword arguments say how much optimizer state each ps keeps next to its variables.

        The PlacementPlan has ``table`` (bytes per ps), ``lines`` (TF-style), ``figure``, and displays all
        three; ``pscluster.placement.compare_placements({"round-robin": a, "greedy": b})`` compares plans.
        """
        from ..widgets.placement_plan import PlacementPlan, placement_label  # pandas and plotly: loaded on first use

        if not isinstance(model_fn, torch.nn.Module) and not callable(model_fn):
            raise ConfigError("model_fn must be a torch.nn.Module or a function that builds one")
        model = build_model(model_fn, seed)
        if not any(True for _ in model.parameters()):
            raise ConfigError("the model has no parameters to place: check model_fn")
        variables = describe_variables(model, self.num_ps, placement, partition)
        return PlacementPlan(variables, self.num_ps, optimizer=optim.optimizer_name(optimizer),
                             optimizer_kwargs=optimizer_kwargs, label=placement_label(placement, partition))

    # --- views ------------------------------------------------------------------------------
    def roles(self) -> list[dict]:
        """One row per task: role, task index, engine id, host, pid, device."""
        spec = self._require_running("list roles")
        rows = []
        for t in (*spec.ps, *spec.workers):
            role = "chief" if t.is_chief else t.role
            rows.append({"role": role, "task": t.index, "engine": t.engine_id, "host": t.host,
                         "pid": t.pid, "device": t.device if t.role == "worker" else "cpu",
                         "address": t.address if t.role == "ps" else ""})
        return rows

    def placement(self) -> list[str]:
        """TF-style placement lines of the latest run, e.g. ``0.weight: /job:ps/task:0``."""
        if not self.runs:
            return []
        return [v.placement for v in self.runs[-1].plan.variables]

    def status(self) -> dict:
        return {"name": self.name, "running": self.running, "ps": self.num_ps, "workers": self.num_workers,
                "launcher": self.launcher.kind,
                "roles": self.roles() if self.running else [],
                "runs": [r.summary() for r in self.runs]}

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Cluster {self.name} {state}: {self.num_ps} ps, {self.num_workers} workers>"

    def _repr_html_(self) -> str:
        if not self.running:
            return html.escape(repr(self))
        rows = self.roles()
        head = "".join(f"<th>{k}</th>" for k in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
                       for r in rows)
        return f"<b>{html.escape(repr(self))}</b><table><tr>{head}</tr>{body}</table>"


class LostWorker:
    """The result of a worker whose engine was gone before it could start: failed at once, so the run's
    supervisor replaces it as it replaces any lost worker."""

    msg_ids: list = []

    def __init__(self, error: Exception):
        self.error = error

    def ready(self) -> bool:
        return True

    def successful(self) -> bool:
        return False

    def get(self, timeout: float | None = None):
        raise self.error


class ChiefCalls:
    """Worker 0 of a ``Cluster.run`` in the run's first attempt, begun on its engine before the run's plan exists
    (``remote.begin_chief``): its loop waits at its first training call for ``go_on(plan)`` or ``cancel()``. From
    ``go_on`` on, it is that worker's result as a supervisor follows one: ``remote.go_on_chief``'s outcome, and what
    both calls printed, in order."""

    def __init__(self, view, spec: ClusterSpec, settings: TrainPlan, payload: bytes):
        self._view = view
        self._begun = view.apply_async(remote.begin_chief, spec.to_json(), settings.to_json(), payload)
        self._going = None
        self._waiting = False

    def registered(self) -> tuple[torch.nn.Module, tuple[str, ...], list[optim.OptimizerSpec]]:
        """What the loop registered by its first training call: (its model, on the CPU, the module names, the
        optimizers' specs in the run's order); the ConfigError that says what is wrong with ``train_fn``."""
        found = self._begun.get()
        if isinstance(found, ConfigError):
            raise found
        self._waiting = True
        return torch.load(io.BytesIO(found), map_location="cpu", weights_only=False)

    def go_on(self, plan: TrainPlan) -> "ChiefCalls":
        """The loop joins the run of ``plan`` and trains on."""
        self._going = self._view.apply_async(remote.go_on_chief, plan.to_json())
        return self

    def cancel(self) -> None:
        """End the loop where it waits, unless it went on (its run was refused)."""
        if self._waiting and self._going is None:
            self._waiting = False
            self._view.apply_sync(remote.cancel_chief)

    @property
    def msg_ids(self) -> list:
        return self._going.msg_ids

    @property
    def stdout(self) -> str:
        return (self._begun.stdout or "") + (self._going.stdout or "")

    @property
    def stderr(self) -> str:
        return (self._begun.stderr or "") + (self._going.stderr or "")

    def ready(self) -> bool:
        return self._going.ready()

    def successful(self) -> bool:
        return self._going.successful()

    def get(self, timeout: float | None = None):
        return self._going.get(timeout)

    def wait_for_output(self, timeout: float = -1) -> bool:
        return self._begun.wait_for_output(timeout) and self._going.wait_for_output(timeout)


def _source(model_fn) -> str | None:
    try:
        return inspect.getsource(model_fn if not isinstance(model_fn, torch.nn.Module) else type(model_fn))
    except (OSError, TypeError):
        return None
