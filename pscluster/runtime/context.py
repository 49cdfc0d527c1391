"""The user's own training loop on every worker: ``train_fn(ctx)``, with a parameter server under it.

A loop written for one process becomes a worker's loop by a few changed lines::

    def train_fn(ctx):
        model = ctx.model(Net().to(ctx.device))                      # the run's variables: values pulled
        optimizer = ctx.optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))   # step() is the exchange
        train_loader = ctx.shard(DataLoader(train_set, batch_size=64, shuffle=True))  # this worker's part
        for epoch in range(epochs):
            for x, y in train_loader:                                 # one epoch of it
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()                                      # push, update on the ps, pull
                ctx.log(loss=loss.item())

The run's rules are the context's, the same for every loop (``Cluster.train``'s, ``worker.library_loop``, is a
``train_fn`` too): ``optimizer.step()`` clips the gradients to ``max_grad_norm`` and applies ``on_nonfinite``
(``steps.GradientRules``); ``with ctx.autocast():`` around forward and loss, and ``ctx.backward(loss)`` in place of
``loss.backward()``, give the run's ``precision`` (fp16 loss scaling, an overflow left out), the loss checked with
the gradients, and ``overlap``'s pushes begun. A loop with its own ``torch.autocast`` and ``GradScaler`` keeps them.

Call order on a worker (``run_loop``):

1. The worker's random streams are seeded (``seeding``: ``ctx.seed``), then ``train_fn(ctx)`` is called.
2. ``ctx.model(module)`` for each module the run's plan names (``TrainPlan.modules``, in that order). Several
   modules are one model to the run, a ``ModuleDict`` of them by name (``run.state_dict()`` keys
   ``<name>.<key>``); one module is the model itself.
3. ``ctx.optimizer(torch_optimizer)`` for each optimizer the plan names (its class, defaults and param groups,
   built on the registered modules' parameters), whose ``step()`` from then on pushes the gradients of its
   parameters, has the ps apply the update with that optimizer (its state lives on the ps) and loads the new
   values of its parameters and of its modules' buffers. The options of its param groups (a learning rate the
   loop sets, or a torch ``lr_scheduler`` wrapped around it) travel with each push and apply to that update.
   With several optimizers (a GAN's), each step is one optimizer's, in the loop's order; the first optimizer's
   steps (or the one registered with ``global_step=True``) are the run's global steps.
   Registering the last of them joins the run: the chief initializes the ps tasks with its modules' values (or a
   checkpoint's), every worker's modules get them, before the loop's first forward.
4. The loop ends when ``train_fn`` returns: it leaves the run (a sync step stops waiting for its gradients), which
   ends once every worker's loop has returned. The run's end (its step target, a stop from anywhere,
   ``ctx.request_stop(reason)``) turns ``ctx.should_stop()`` true, ends the epoch of ``ctx.shard`` under way, and
   makes a later ``optimizer.step()`` or epoch raise ``RunEnded``, which ``run_loop`` takes as the loop's end.

A run's plan may also come from the loop itself (``FirstCallContext``): the worker's context then begins with the
run's settings only, and at the loop's first training call hands the modules and the optimizers registered by then
to whoever makes the plan (``loop_plan``), then joins the run as in step 3. ``Cluster.run``'s chief begins its run
so, as a script's workers do: ``train_fn`` runs once on each worker, and never in the notebook's kernel.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import replace
from types import SimpleNamespace

import torch

from ..errors import ConfigError, PeerLost, RunEnded, StaleTask
from ..spec import ClusterSpec
from . import seeding
from .client import PSClient
from .data import training_input, worker_batches
from .shard_loader import ShardLoader, shard_loader
from .emitter import MetricsEmitter
from .loop_overlap import LoopOverlap, begin_backward
from .member import Shards, SparseRows, StepTally, join_run, leave, local_device, merge_pushes
from .optim import OptimizerSpec, group_options, literal_pattern, spec_of
from .options import DEFAULTS, PLAN, RunOptions
from .overlap import EarlyPush
from .plan import TrainPlan
from .policies import policy_for
from .protocol import Flag
from .staging import GradientStaging
from .steps import PRECISIONS, GradientRules, Precision, metric_values
from .streams import Batches

MAX_NAME = 64


class ModuleSet:
    """The modules a ``train_fn`` registers, in order, by name; ``model`` is the one module the run's variables
    are of (the module itself when there is one, else a ``ModuleDict`` of them by name)."""

    def __init__(self):
        self.modules: dict[str, torch.nn.Module] = {}

    def add(self, module, name: str | None) -> torch.nn.Module:
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"ctx.model({type(module).__name__}): give a torch.nn.Module")
        if any(m is module for m in self.modules.values()):
            raise ConfigError("ctx.model() was given the same module twice: register each module once")
        if name is None:
            base = type(module).__name__
            name = base if base not in self.modules else f"{base}_{len(self.modules)}"
        if not isinstance(name, str) or not name or "." in name or len(name) > MAX_NAME or name in self.modules:
            raise ConfigError(f"ctx.model(..., name={name!r}): give each module a name of its own, without dots")
        self.modules[name] = module
        return module

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.modules)

    @property
    def model(self) -> torch.nn.Module:
        if len(self.modules) == 1:
            return next(iter(self.modules.values()))
        return torch.nn.ModuleDict(self.modules)

    def optimizer_spec(self, optimizer, cls: type | None = None) -> OptimizerSpec:
        """The spec of ``optimizer`` (see ``optim.spec_of``), built on the registered modules' parameters; ``cls``:
        the class of the optimizer ``optimizer`` stands for (its defaults and groups as registered)."""
        if cls is None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"ctx.optimizer({type(optimizer).__name__}): give a torch.optim.Optimizer built on "
                              "the parameters of the modules given to ctx.model()")
        if not self.modules:
            raise ConfigError("ctx.optimizer() before ctx.model(): register the modules first, then build the "
                              "optimizer on their parameters")
        return spec_of(optimizer, list(self.model.named_parameters()), cls)


class Optimizers:
    """The optimizers a ``train_fn`` registers, in the run's order: the one whose steps are the global steps first
    (``global_step=True``, else the first registered), the others as registered. Each trains parameters of its own;
    together, every trainable parameter of the registered modules."""

    def __init__(self):
        # (optimizer, global_step, (its class, its defaults and groups as registered)): what the loop sets before its
        # first step (an lr) is an option of that step's push, not of the optimizer the ps tasks build
        self.registered: list[tuple[torch.optim.Optimizer, bool | None, tuple[type, SimpleNamespace]]] = []

    def add(self, optimizer, global_step: bool | None) -> None:
        if any(o is optimizer for o, _, _ in self.registered):
            raise ConfigError("ctx.optimizer() was given the same optimizer twice: register each once")
        if global_step and any(g for _, g, _ in self.registered):
            raise ConfigError("two optimizers with global_step=True: the global step counts one optimizer's steps")
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for other, _, _ in self.registered:
            if mine & {id(p) for g in other.param_groups for p in g["params"]}:
                raise ConfigError("two optimizers update one parameter: give each optimizer parameters of its own")
        as_registered = SimpleNamespace(defaults=dict(optimizer.defaults),
                                        param_groups=[dict(g) for g in optimizer.param_groups])
        self.registered.append((optimizer, global_step, (type(optimizer), as_registered)))

    def _in_order(self) -> list[tuple]:
        counting = next((i for i, (_, g, _) in enumerate(self.registered) if g), 0)
        return [self.registered[i] for i in [counting] + [i for i in range(len(self.registered)) if i != counting]]

    @property
    def ordered(self) -> list[torch.optim.Optimizer]:
        return [optimizer for optimizer, _, _ in self._in_order()]

    def specs(self, modules: ModuleSet) -> list[OptimizerSpec]:
        """The specs of the optimizers in the run's order, named by the parameters of every module registered by
        now (a module registered after an optimizer renames them all: ``<module>.<parameter>``)."""
        return [modules.optimizer_spec(as_registered, cls) for _, _, (cls, as_registered) in self._in_order()]

    def check_trained(self, model: torch.nn.Module) -> None:
        """ConfigError for a trainable parameter that no optimizer updates (the ps would train it)."""
        updated = {id(p) for o, _, _ in self.registered for g in o.param_groups for p in g["params"]}
        left_out = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in updated]
        if left_out:
            raise ConfigError(f"parameter {left_out[0]} is trainable but in no group of an optimizer: add it, or "
                              "set requires_grad=False on it (the ps trains every trainable parameter)")


def loop_plan(model: torch.nn.Module, modules: tuple[str, ...], optimizers: list[OptimizerSpec], options: Mapping, *,
              num_ps: int, num_workers: int, **fields) -> TrainPlan:
    """The plan of a user's loop over ``model`` (its ``modules``) with ``optimizers`` in the run's order (see
    ``Optimizers``) and the run's ``options`` (an entry's: its placement, partition and those the plan carries;
    ``fields``: more of the plan's, as ``session``): each trained variable says which optimizer updates it; sync
    aggregates every worker's gradients unless ``replicas_to_aggregate`` says otherwise. With several optimizers,
    no shared-memory lanes (a lane carries every variable, a push only one optimizer's) and, in sync mode, no
    backup workers (each optimizer's step waits for every worker). No ``max_lead``: a loop of the user's may stop
    pushing for its own reasons (its data ends, it evaluates) while it still counts as live, and would hold the
    others."""
    first, *more = optimizers
    plan = TrainPlan.for_model(model, first, num_ps=num_ps, placement=options.get("placement", DEFAULTS.placement),
                               partition=options.get("partition"), run_id=1, num_workers=num_workers,
                               modules=modules, more_optimizers=tuple(spec.to_dict() for spec in more),
                               options=_loop_options(options), **fields)
    if more and policy_for(plan).aggregates_steps and plan.replicas_to_aggregate != num_workers:
        raise ConfigError("several optimizers with replicas_to_aggregate other than the number of workers: "
                          "leave replicas_to_aggregate out, or train with one optimizer")
    if more and plan.pipeline:
        raise ConfigError("pipeline=True with several optimizers: each optimizer's step needs the values the "
                          "other's gave; run without pipeline")
    if not more:
        return plan
    plan = plan.replace(shared_memory=False)
    which = [set(n for g in spec.groups for n in g["params"]) for spec in optimizers]
    of_param = {v.parameter: next(k for k, names in enumerate(which) if literal_pattern(v.parameter) in names)
                for v in plan.variables if v.kind == "param"}
    # a buffer goes with the optimizer of its module's parameters (a generator's BatchNorm statistics with its steps)
    of_module = {}
    for name, k in of_param.items():
        of_module.setdefault(name.split(".", 1)[0], k)
    return replace(plan, variables=tuple(
        replace(v, optimizer=of_param[v.parameter]) if v.kind == "param" else
        replace(v, optimizer=of_module.get(v.parameter.split(".", 1)[0], 0)) if v.kind == "buffer" else v
        for v in plan.variables))


def settings_plan(options: Mapping, *, num_workers: int) -> TrainPlan:
    """The plan of a user's loop until its first training call (``FirstCallContext``): the run's ``options`` (as
    ``loop_plan``'s), no variables yet."""
    return TrainPlan(run_id=1, optimizer="SGD", num_workers=num_workers, options=_loop_options(options))


def _loop_options(options: Mapping) -> RunOptions:
    """What a user's loop's plan carries of the run's ``options``: the batches are the loop's own, no ``max_lead``
    (see ``loop_plan``)."""
    return RunOptions(options).of(PLAN).replace(batch_size=None, max_lead=None)


class _Context:
    """What ``train_fn(ctx)`` is given: its registrations and its data; ``WorkerContext`` is its kind."""

    def __init__(self, run_seed: int, worker_index: int, num_workers: int, device: torch.device, seed: int):
        """``run_seed``: the run's (its batches' order); ``seed``: this worker's own (``seeding``)."""
        self.worker_index, self.num_workers, self.device, self.seed = worker_index, num_workers, device, seed
        self._run_seed = run_seed
        self._modules = ModuleSet()
        self._optimizers = Optimizers()
        self._streams: list[Batches] = []
        self._samples = 0
        self._overlap = False  # pushes during backward, host copies of GPU gradients (``optimizer(overlap=True)``)
        self._syncing = True  # False under ``no_sync()``

    @property
    def is_chief(self) -> bool:
        """Worker 0: it initializes the run; it is the one to evaluate and save what only one should."""
        return self.worker_index == 0

    def model(self, module: torch.nn.Module, name: str | None = None) -> torch.nn.Module:
        """Make ``module``'s parameters and buffers variables of the run, placed and partitioned by the run's
        placement, and return it. Once the optimizer is registered too, they hold the run's values (the
        chief's initial ones, or a checkpoint's). ``name``: its prefix in ``run.state_dict()`` when a loop
        registers several (default: its class name)."""
        self._modules.add(module, name)
        return module

    def optimizer(self, optimizer: torch.optim.Optimizer, *, global_step: bool | None = None,
                  overlap: bool = False) -> torch.optim.Optimizer:
        """Turn ``optimizer`` (a torch optimizer on the registered modules' parameters) into the run's: the same
        object, whose ``step()`` pushes the gradients of its parameters, has the ps apply the update with this
        optimizer (its state on the ps) and pulls the new values. Its param groups' options set by the loop (a
        learning rate each iteration, a torch ``lr_scheduler`` around it) apply to the update they go with.
        Several optimizers (a GAN's generator and discriminator) each update parameters of their own, stepped in
        the loop's order; the steps of one are the run's global steps: ``global_step=True``'s, else the first's.

        ``overlap=True`` (one optimizer): its gradients are final when backward returns, so its pushes leave
        during backward (sync, CPU workers, pushes of a few MB) and a GPU worker copies them to the host during
        it, as ``Cluster.train``'s do. Clip with the run's ``max_grad_norm``, not after backward; accumulate the
        micro-batches before the last under ``ctx.no_sync()``; a gradient changed after backward fails the step
        (see ``loop_overlap``). With ``pipeline=True`` (async), ``step()`` does not wait for the new values.

        Every ``step()`` applies the run's rules to the gradients before they leave (``steps.GradientRules``):
        clipped to ``max_grad_norm``, checked finite (``on_nonfinite``), and with ``ctx.backward`` under fp16, an
        overflow of the loss scale leaves the step out. It returns False for a step left out.

        ``ctx.optimizer()`` without one (``Cluster.train``'s loop): the optimizer of a plan that names its own
        (``optimizer=``, ``lr=``, ``scheduler=``), which runs on the ps tasks alone (``PlanOptimizer``)."""
        self._modules.optimizer_spec(optimizer)  # what is wrong with it, said at once
        self._optimizers.add(optimizer, global_step)
        self._overlap = self._overlap or bool(overlap)
        if self._overlap and len(self._optimizers.registered) > 1:
            raise ConfigError("ctx.optimizer(..., overlap=True) with several optimizers: a push during backward "
                              "carries every gradient of a ps, a step one optimizer's; leave overlap out")
        optimizer.__class__ = _run_optimizer_class(type(optimizer))
        optimizer._pscluster_context = self
        vars(optimizer).pop("step", None)  # an lr_scheduler built earlier wrapped torch's own step
        # a GradScaler unscales the gradients and skips a step itself, as for any optimizer: the update is the ps's
        # (a fused one would otherwise be handed the scale, to unscale in its own step)
        optimizer._step_supports_amp_scaling = False
        return optimizer

    def shard(self, data, **loader_kwargs) -> ShardLoader:
        """This worker's DataLoader over ``data`` (a DataLoader, or a dataset with DataLoader's keyword arguments:
        ``batch_size`` 64 and ``shuffle=True`` unless given): each iteration is one epoch of this worker's part, and
        the next epoch's order comes by itself. One worker reads exactly what the DataLoader would (its order, its
        random draws); N workers split each epoch as ``DistributedSampler`` does (see ``shard_loader``). ``len()``,
        ``.dataset``, ``.batch_size`` and ``.sampler`` read as a DataLoader's. An iteration ends early once the run
        has ended (its target, a stop, ``request_stop``). The next batches are read while ``optimizer.step()``
        waits for the new values, unless reading them draws random numbers (``streams``)."""
        return self._stream_of(shard_loader(data, self.worker_index, self.num_workers, self._run_seed,
                                            self._batches, loader_kwargs, self._epoch_began))

    def endless_shard(self, dataset, batch_size: int | None = None, *, collate_fn=None, loader_workers: int = 0,
                      prefetch_factor: int | None = None, pin_memory: bool = False, shuffle: bool = True,
                      drop_last: bool = False, always_read_ahead: bool = False) -> Batches:
        """This worker's endless stream of batches of ``dataset`` (a map-style dataset, an IterableDataset, or a
        DataLoader taken apart as ``Cluster.train`` takes it), for a loop that counts steps, not epochs: its part of
        each epoch, reshuffled every epoch with the run's seed (unless ``shuffle=False``), epoch after epoch, in
        ``loader_workers`` loader processes that live as long as the stream. ``batch_size``: per worker (default 64,
        or the DataLoader's). Its first batch is read before the run starts; it ends once the run has ended;
        batches are read ahead as ``shard``'s are, or with ``always_read_ahead`` even where reading them draws
        random numbers: for a loop that draws none between ``optimizer.step()`` and its next batch (the library's
        loop), the same batches and draws, in the same order, with each read during the exchange."""
        if isinstance(dataset, torch.utils.data.DataLoader) and (not shuffle or drop_last):
            raise ConfigError("a DataLoader given to ctx.endless_shard brings its own shuffle and drop_last: set "
                              "them on the DataLoader, or give its dataset")
        dataset, batch_size, collate_fn, loader = training_input(dataset, batch_size, collate_fn, loader_workers,
                                                                 prefetch_factor, pin_memory)
        if not shuffle or drop_last:
            loader = replace(loader, shuffle=shuffle, drop_last=drop_last)
        return self._stream_of(self._batches(lambda: worker_batches(
            dataset, self.worker_index, self.num_workers, batch_size, self._run_seed, loader, collate_fn,
            self.device), first_before_begin=True, always_ahead=always_read_ahead))

    def _batches(self, make, **options) -> Batches:
        """Batches of the iterator ``make()`` starts, as this context hands them out (see ``streams``)."""
        return Batches(make, begin=self._training_call, counted=self._count, ended=self._ended, **options)

    def _stream_of(self, stream):
        """``stream``, read ahead during each exchange and closed with the context."""
        self._streams.append(stream)
        return stream

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside push nothing during backward: the micro-batches of an accumulation but the last,
        with ``ctx.optimizer(..., overlap=True)`` (as DDP's ``no_sync``; without overlap, nothing to hold back)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

    def _training_call(self) -> None:
        pass

    def _ended(self) -> str | None:
        """Why the run is over for this loop, or None while it trains."""
        return None

    def _count(self, samples: int) -> None:
        self._samples += samples

    def _epoch_began(self, epoch: int, batches: int | None) -> None:
        """An epoch of a ``shard`` loader began (``ShardLoader``'s ``began``)."""


class WorkerContext(_Context):
    """The context of worker ``index`` of a run, on its engine or in its process (see the module).

    Its exchange (``_push``, ``_settle``) is the one worker loop of the package: a user's ``optimizer.step()``
    and the library's own loop (``worker.library_loop``, ``Cluster.train``'s) both push through it. A push-pull
    is sent, then settled (its reply waited for and loaded into the model): at once in a user's ``step()``; with
    ``pipeline`` (async) at the next ``step()``, after the next gradients were computed on the values the worker
    has, so that the round trip hides behind them."""

    def __init__(self, spec: ClusterSpec, index: int, plan: TrainPlan, *, join: bool = False, log=None):
        task = spec.task("worker", index)
        super().__init__(plan.seed, index, plan.num_workers, local_device(task),
                         seeding.worker_seed(plan.seed, index, plan.attempt))
        self._plan, self._spec, self._task, self._join, self._log = plan, spec, task, join, log
        # from the start (``_start``) on, with the run's plan as it is then
        self._emitter: MetricsEmitter | None = None
        self._tally: StepTally | None = None
        self._client: PSClient | None = None
        self._shards: Shards | None = None
        self._sparse: SparseRows | None = None
        self._early: EarlyPush | None = None  # pushes that leave during backward (``overlap``)
        self._staging: GradientStaging | None = None  # a CUDA worker's gradients copied to the host in backward
        self._loop_overlap: LoopOverlap | None = None  # a user's loop with overlap=True: when those two begin
        self._model: torch.nn.Module | None = None  # the registered modules as one, from the start on
        self._reply = None  # the last settled reply: the values the model holds are of its step
        self._in_flight = None  # the push-pull sent and not settled: (its reply's wait, its optimizer)
        self._pending: dict[str, float] = {}  # ctx.log's scalars since the last exchange
        self._sent_options: dict[int, list[dict]] = {}  # per optimizer: the group options the ps tasks have now
        self._unrecorded: dict | None = None  # the last exchange's step, recorded with them at the next one
        self._stop_reason: str | None = None
        self._wire = PRECISIONS[plan.precision]
        self._precision = Precision(plan.precision, self.device)  # ``autocast``, ``backward``
        self._rules = GradientRules(self._precision, index, self._emit)  # what ``step()`` does to the gradients
        self._loss: torch.Tensor | None = None  # the step's loss as ``backward`` was given it, for the rules
        self._scaled = False  # this step's backward went through the fp16 loss scale
        self._plan_optimizer: PlanOptimizer | None = None  # ``optimizer()`` of a plan that names its own
        self._parameters: dict[int, tuple[list, list]] = {}  # per optimizer: (its parameters, named as the model's)
        self._since = time.perf_counter()  # the end of the last global step's exchange
        self._exchanging = 0.0  # exchanges since then
        self._bytes = (0, 0)  # the client's bytes sent and received then

    # --- registration ------------------------------------------------------------------------
    def model(self, module: torch.nn.Module, name: str | None = None) -> torch.nn.Module:
        super().model(module, name)
        names, planned = self._modules.names, self._plan.modules
        if planned and names != planned[:len(names)]:
            raise ConfigError(f"worker {self.worker_index} registered modules {list(names)} where the run's plan has "
                              f"{list(planned)}: register the same modules, in the same order, on every worker")
        return module

    def _check_registered(self) -> None:
        """ConfigError unless this worker registered the modules and optimizers of the run's plan."""
        planned = self._plan.optimizer_specs
        if len(self._optimizers.registered) != len(planned):
            raise ConfigError(f"the loop began with {len(self._optimizers.registered)} optimizers registered where the "
                              f"run's plan has {len(planned)}: register the model with ctx.model() and every "
                              "optimizer with ctx.optimizer() before the loop")
        if self._modules.names != self._plan.modules:
            raise ConfigError(f"worker {self.worker_index} registered modules {list(self._modules.names)} where the "
                              f"run's plan has {list(self._plan.modules)}: register the same modules on every worker")
        if [(s.optimizer, s.groups) for s in self._optimizers.specs(self._modules)] != \
                [(p.optimizer, p.groups) for p in planned]:
            raise ConfigError(f"worker {self.worker_index} built other optimizers than the run's plan has "
                              f"({', '.join(p.optimizer for p in planned)}): build the same on every worker")
        self._optimizers.check_trained(self._modules.model)
        for k, optimizer in enumerate(self._optimizers.ordered):
            optimizer._pscluster_set = k

    def _start(self) -> None:
        """Join the run: the registered modules get the run's values. A user's loop must have registered what the
        plan names; the library's loop (a plan without modules) registers its one model and the plan's optimizer
        is its own."""
        if self._plan.modules:
            self._check_registered()
        model = self._model = self._modules.model
        self._emitter = MetricsEmitter(self._plan.metrics_address, f"worker:{self.worker_index}", self._spec.key,
                                       run_id=self._plan.run_id)
        self._tally = StepTally(self._plan, self.worker_index, self._emitter.emit, self._log)
        self._shards = Shards(model, self._plan, len(self._spec.ps))
        self._client = PSClient(self._spec, task=self.worker_index, run_id=self._plan.run_id,
                                timeout=self._plan.request_timeout, pinned=self.device.type == "cuda")
        self._client.receive_into(self._shards.spare)
        self._reply = join_run(self._client, self._shards, self._plan, self._task.is_chief, self._join,
                               self._emitter.emit)
        self._sparse = SparseRows(model, self._plan, self._client)
        if self._overlap:
            early = EarlyPush(self._shards, self._client, self._plan, self.device, self._wire)
            self._early = early if early.ps else None
            if GradientStaging.applies(self._plan, self.device):
                slots = {vid: slot for i in self._shards.dense for vid, slot in self._client.gradient_slots(i).items()}
                self._staging = GradientStaging(self._shards, slots, self._wire)
            if self._plan.modules:  # a user's loop (the library's begins them itself)
                self._loop_overlap = LoopOverlap(self._modules.modules.values(), self._shards, self._early,
                                                 self._staging, step_of=lambda: self._reply.step,
                                                 paused=lambda: not self._syncing)
        self._emitter.emit("state", state="training")
        self._since = time.perf_counter()
        self._bytes = (self._client.bytes_sent, self._client.bytes_received)

    def optimizer(self, optimizer: torch.optim.Optimizer | None = None, *, global_step: bool | None = None,
                  overlap: bool = False) -> torch.optim.Optimizer:
        if optimizer is None:
            return self._plans_optimizer(overlap)
        if self._reply is not None:
            raise ConfigError(f"ctx.optimizer() after the run started: the run's plan has "
                              f"{len(self._plan.optimizer_specs)} optimizers; register each before the loop")
        super().optimizer(optimizer, global_step=global_step, overlap=overlap)
        if self._registered_all():
            self._start()  # the run's registrations are complete: its values before the first forward
        return optimizer

    def _plans_optimizer(self, overlap: bool) -> PlanOptimizer:
        """``optimizer()`` without one: that of a plan that names its own (see ``_Context.optimizer``)."""
        if self._plan.modules or not self._plan.variables or self._plan_optimizer is not None:
            raise ConfigError("ctx.optimizer() without an optimizer: give your loop's torch optimizer, "
                              "ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1)); a run's own optimizer "
                              "is Cluster.train's, taken once")
        if len(self._modules.names) != 1 or self._reply is not None:
            raise ConfigError("ctx.optimizer() before its loop's first batch and after ctx.model(model), once")
        self._overlap = self._overlap or bool(overlap)
        self._plan_optimizer = PlanOptimizer(self, list(self._modules.model.parameters()))
        return self._plan_optimizer

    def _registered_all(self) -> bool:
        """Whether every optimizer of the run is registered (the plan says how many)."""
        return len(self._optimizers.registered) == len(self._plan.optimizer_specs)

    def _training_call(self) -> None:
        if self._reply is None:
            self._start()

    def _epoch_began(self, epoch: int, batches: int | None) -> None:
        """An ``epoch`` event in the worker's metrics (the views show each worker's epoch), with ``epoch``,
        ``batches`` and the ``global_step`` it begins at: the run has started, its first batch is being read."""
        self._emitter.emit("epoch", epoch=epoch, batches=batches, global_step=self._reply.step)

    # --- the loop ----------------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """The run's global step of the values the model holds: as of this worker's last exchange (with
        ``pipeline``, the one before the step in flight), or its start (0 on a fresh run, the step a restored or
        joined run is at)."""
        self._training_call()
        return self._reply.step

    @property
    def plan(self) -> TrainPlan:
        """The run's plan, read-only: its options as attributes (``ctx.plan.mode``, ``.steps``, ``.precision``,
        ``.max_grad_norm``, ``.on_nonfinite``, ``.pipeline``, ``.seed``, ``.attempt``...), its variables and their
        placement. A ``Cluster.run`` chief's, until its loop's first training call: the run's settings, no
        variables yet."""
        return self._plan

    def autocast(self):
        """The run's ``precision`` around a step's forward and loss: ``torch.autocast`` on this worker's device
        with bf16 or fp16 (the parameters stay fp32), nothing under fp32. Its backward goes through
        ``ctx.backward``."""
        return self._precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` under the run's rules, which the next ``optimizer.step()`` applies: with
        ``precision="fp16"`` the loss is scaled and the gradients unscaled after it (a step whose gradients
        overflowed the scale is left out, the scale halved, as torch's GradScaler does); ``loss`` is checked
        with the gradients (``on_nonfinite``); with ``overlap`` (``ctx.optimizer(..., overlap=True)``) the
        pushes, and a GPU's copies of its gradients to the host, begin here (not under ``ctx.no_sync()``)."""
        self._training_call()
        self._loss = loss
        if self._overlap and self._syncing:
            if self._loop_overlap is not None:
                self._loop_overlap.begin(loss)
            else:
                begin_backward(self._early, self._staging, self._reply.step, loss)
        self._precision.backward(loss, self._model)
        if self._precision.scale is not None:
            self._scaled = True
            if self._loop_overlap is not None:
                self._loop_overlap.unscaled()

    def _emit(self, kind: str, **fields) -> None:
        self._emitter.emit(kind, **fields)

    def should_stop(self) -> bool:
        """Whether the loop should end: the run reached its target step, was stopped (from the notebook, the side
        panel, another worker's ``request_stop``), or this worker asked for it (with ``pipeline``: as of the
        values the model holds; a step computed past the end is left out)."""
        self._training_call()
        return self._ended() is not None

    def _ended(self) -> str | None:
        if self._reply is None:
            return None
        reply, steps = self._reply, self._plan.steps
        if self._stop_reason is not None:
            return self._stop_reason
        if steps is not None and reply.step >= steps:
            return f"its target of {steps} global steps reached"
        if reply.flags & Flag.STOPPED:
            return f"stopped at global step {reply.step}"
        return None

    def request_stop(self, reason: str = "requested by the loop") -> None:
        """End the run at the current global step (early stopping): every worker's ``should_stop()`` turns
        true; the run ends finished, ``reason`` in its events."""
        self._training_call()
        if self._stop_reason is not None:
            return
        self._settle()
        self._stop_reason = str(reason)
        self._emitter.emit("stop_requested", reason=self._stop_reason, global_step=self.global_step)
        self._client.stop(self._client.park())

    def log(self, **scalars) -> None:
        """Record numbers (``loss``, ``accuracy`` and any others) in the metrics of this worker's last step, the
        one ``ctx.global_step`` names (before the first step: of the first): the run store, the dashboard,
        TensorBoard and ``run.metrics()`` show them. A loss logged after ``optimizer.step()`` is that step's."""
        self._training_call()
        self._pending.update(metric_values(scalars))

    def _exchange(self, optimizer) -> bool:
        """``optimizer.step()``: the gradients of its parameters to the ps tasks with its groups' options, the new
        values back into the model (with ``pipeline``, at the next step). False when the step was left out: a
        non-finite gradient (``on_nonfinite="skip"``), or with ``pipeline`` a step computed past the run's end."""
        self._training_call()
        if self._in_flight is None and (reason := self._ended()) is not None:
            raise RunEnded(reason)
        try:
            return self._step(optimizer)
        except (PeerLost, StaleTask) as lost:
            self._rejoin(lost)
            return False

    def _rejoin(self, lost: Exception) -> None:
        """A ps was lost (or this worker fenced off) during a step: raise ``lost``, which ends this loop; a lost ps
        restarts every worker's loop from the newest state (a script's context joins the next attempt in place)."""
        raise lost

    def _step(self, optimizer) -> bool:
        """``_exchange`` of a run that has not ended: the last push settled (``pipeline``), the gradients through
        the run's rules (``steps.GradientRules``), pushed; the reply settled at once unless ``pipeline``."""
        plan, k = self._plan, optimizer._pscluster_set
        computed_on = self._reply.step  # the global step of the values this step's gradients were computed on
        if self._in_flight is not None:
            self._settle()  # pipeline: the last step's values, now that this step's gradients are computed
            if self.should_stop():
                return False
        if self._loop_overlap is not None:
            self._loop_overlap.check()  # before max_grad_norm clips them
        loss, scaled, self._loss, self._scaled = self._loss, self._scaled, None, False
        params, named = self._parameters_of(optimizer)
        checked = self._early.checked() if self._early is not None else frozenset()  # finite, checked already
        if not self._rules.passes(plan, loss, params, named, scaled=scaled, checked=checked, step=computed_on,
                                  local_step=self._local_steps):
            return False
        if isinstance(optimizer, PlanOptimizer):  # the plan's optimizer and schedule: the ps tasks' own
            self._push(computed_on)
        else:  # the group options go when they changed (an lr the loop set): the ps tasks keep them for the attempt
            groups = group_options(optimizer)
            meta = {"optimizer": k} if k else {}
            if groups != self._sent_options.get(k):
                meta["groups"] = groups
            self._push(computed_on, k, meta=meta or None)
            self._sent_options[k] = groups
        if not plan.pipeline:
            for stream in self._streams:
                stream.read_ahead()  # the loop's next batches, while the push-pull is in flight
            self._settle()
        return True

    def _parameters_of(self, optimizer) -> tuple[list, list]:
        """(The parameters ``optimizer`` steps, in its order; those of them as the model names them)."""
        k = optimizer._pscluster_set
        if k not in self._parameters:
            if isinstance(optimizer, PlanOptimizer):
                params = optimizer.params
            else:
                params = [p for g in optimizer.param_groups for p in g["params"]]
            mine = {id(p) for p in params}
            self._parameters[k] = params, [(n, p) for n, p in self._model.named_parameters() if id(p) in mine]
        return self._parameters[k]

    @property
    def _local_steps(self) -> int:
        """This worker's global steps settled so far (the last one's record may be pending)."""
        return self._tally.local_step + (self._unrecorded is not None)

    def _push(self, step: int, k: int = 0, *, meta: dict | None = None) -> None:
        """Send optimizer ``k``'s push of the gradients in the model's ``.grad`` (computed on the values of global
        ``step``), and of its buffers' values; what left during backward (``_early``) or was copied to the host
        then (``_staging``) goes as it is. Its reply is for ``_settle``. The last global step's record goes
        first, with what the loop logged since it."""
        if k == 0 and self._unrecorded is not None:
            self._record()
        samples = 0
        if k == 0:  # the batches handed out since the last push are this step's
            samples, self._samples = self._samples, 0
        began = time.perf_counter()
        opened = self._early.finish() if self._early is not None else {}
        staged = self._staging.take() if self._staging is not None else None
        pushed = merge_pushes(self._shards.grads(self._wire, sent=opened, staged=staged), self._sparse.grads())
        if self._plan.more_optimizers:
            pushed = {ps: self._of_optimizer(ids, tensors, k) for ps, (ids, tensors) in pushed.items()}
        self._in_flight = (self._client.start_push_pull(step, pushed, opened, meta=meta), k, samples)
        if self._plan.pipeline:
            for p in self._model.parameters():
                p.grad = None  # they leave with the push: the next backward must not write into them
        self._exchanging += time.perf_counter() - began

    def _settle(self) -> None:
        """Wait for the push-pull in flight, if any, and load its values into the model (with several optimizers,
        only its optimizer's variables and buffers: the loop's graphs through the others', a generator's output
        whose backward is yet to come, must find them as they were). The global step's exchange (the first
        optimizer's) is a step to record; the others' time counts in the next one's."""
        if self._in_flight is None:
            return
        (wait, k, samples), self._in_flight = self._in_flight, None
        began = time.perf_counter()
        reply = wait()
        keep = (lambda v: v.optimizer == k) if self._plan.more_optimizers else None
        self._client.hold(self._shards.load(reply, keep))
        self._reply = reply
        settled = time.perf_counter()
        self._exchanging += settled - began
        if k == 0:
            sent, received = self._client.bytes_sent, self._client.bytes_received
            self._unrecorded = dict(reply=reply, samples=samples,
                                    compute_s=settled - self._since - self._exchanging, exchange_s=self._exchanging,
                                    bytes_sent=sent - self._bytes[0], bytes_received=received - self._bytes[1])
            self._exchanging, self._bytes = 0.0, (sent, received)
            self._since = settled

    def _of_optimizer(self, ids: list[int], tensors: list, k: int) -> tuple[list[int], list]:
        """What a push of optimizer ``k`` carries of ``(ids, tensors)``: its variables' gradients, and every buffer
        (the ps keeps the latest; the reply's go back only to optimizer ``k``'s modules, see ``_settle``)."""
        kept = [(vid, t) for vid, t in zip(ids, tensors)
                if (v := self._shards.by_id[vid]).kind == "buffer" or v.optimizer == k]
        return [vid for vid, _ in kept], [t for _, t in kept]

    def _record(self) -> None:
        """The last exchange's step, with what the loop logged since (``loss`` and ``accuracy`` as the step's)."""
        logged, self._pending = self._pending, {}
        loss, accuracy, metrics = logged.pop("loss", float("nan")), logged.pop("accuracy", None), logged
        self._tally.record(**self._unrecorded, loss=loss, accuracy=accuracy, metrics=metrics)
        self._unrecorded = None

    # --- the end -----------------------------------------------------------------------------
    def finish(self) -> dict:
        """After ``train_fn`` returned: a loop that ended before the run did leaves it (sync steps stop waiting for
        its gradients; the run ends when every worker's loop has returned); the summary."""
        if self._reply is None and not self._modules.names:
            raise ConfigError(f"train_fn returned without registering the run's modules {list(self._plan.modules)} "
                              "with ctx.model()")
        self._training_call()
        self._settle()
        if not self.should_stop():
            self._client.lost_workers([self.worker_index])
            self._emitter.emit("loop_returned", global_step=self.global_step, local_step=self._local_steps)
        if self._unrecorded is not None:
            self._record()
        return self._tally.summary(self.global_step, self._client, self._emitter.dropped, skipped=self._rules.skipped,
                                   overlapped_pushes=self._early.pushes if self._early is not None else 0,
                                   staged_steps=self._staging.steps if self._staging is not None else 0)

    def went_past_the_end(self, error: RunEnded) -> None:
        """``train_fn`` raised ``error``: it stepped, or began an epoch, after the run's end. The loop's normal end,
        said in one line."""
        line = f"the loop went on after the run's end ({error.reason}): it ends there"
        if self._log is not None:
            self._log(line)
        self._emitter.emit("log", line=line)

    def failed(self, error: Exception) -> None:
        """On the way out of a failed loop: this worker's copy of the values it holds (see ``member.leave``)."""
        if self._reply is not None:
            leave(self._shards, self._plan, self.worker_index, self._reply.step, self._local_steps, self._emitter.emit,
                  error)

    def _leave_attempt(self) -> None:
        """Let go of the exchange of the current attempt (its connections, its metrics sender, what was in flight),
        before ``_start`` joins the next one with the modules, optimizers and streams the loop holds."""
        if self._emitter is not None:
            self._emitter.close()
        if self._client is not None:
            self._client.close()
        self._reply = self._in_flight = self._unrecorded = self._loss = None
        self._scaled = False
        self._pending, self._sent_options = {}, {}  # a restarted ps knows no group options yet

    def close(self) -> None:
        super().close()
        self._leave_attempt()


class FirstCallContext(WorkerContext):
    """A worker's context whose run's plan is made at the loop's first training call (a registered module's first
    forward once an optimizer is registered, a batch of ``ctx.shard``, ``ctx.global_step``, ``should_stop()``,
    ``log`` or a step), from every module and optimizer registered by then: ``planned(model, module names,
    optimizer specs in the run's order)`` returns it, and the worker joins the run as any worker does. ``plan``: the
    run's settings until then (``settings_plan``). A ``train_fn`` that registers no module or no optimizer by that
    call, or returns before it, fails with a ConfigError."""

    def __init__(self, spec: ClusterSpec, index: int, plan: TrainPlan, planned, *, log=None):
        super().__init__(spec, index, plan, log=log)
        self._planned = planned
        self._first_forward: list = []  # the registered modules' forward hooks that start the run (``_forward``)

    def model(self, module: torch.nn.Module, name: str | None = None) -> torch.nn.Module:
        super().model(module, name)
        self._first_forward.append(module.register_forward_pre_hook(lambda *_: self._forward()))
        return module

    def _registered_all(self) -> bool:
        return False  # how many optimizers the loop registers is known at its first training call only

    def _forward(self) -> None:
        """A registered module's forward: the loop's first, once an optimizer is registered, starts the run (the
        run's values before it)."""
        if self._optimizers.registered:
            self._training_call()

    def _start(self) -> None:
        for hook in self._first_forward:
            hook.remove()
        self._first_forward = []
        self._plan = self._planned(*self._registered())
        super()._start()

    def _registered(self) -> tuple[torch.nn.Module, tuple[str, ...], list[OptimizerSpec]]:
        """(The model of the registered modules, their names, the optimizers' specs in the run's order); a
        ConfigError unless they make a run: a module, an optimizer, every trainable parameter in one."""
        if not self._modules.names or not self._optimizers.registered:
            raise ConfigError("train_fn reached no training step after ctx.model(module) and "
                              "ctx.optimizer(optimizer): register the model and its optimizer before the loop")
        model = self._modules.model
        self._optimizers.check_trained(model)
        return model, self._modules.names, self._optimizers.specs(self._modules)

    def finish(self) -> dict:
        if self._reply is None:
            self._registered()  # what it registered wrong is said first
            raise ConfigError("train_fn returned before its loop's first training call (a forward of a registered "
                              "module, a batch of ctx.shard, optimizer.step()...): give it a loop that trains")
        return super().finish()


class PlanOptimizer:
    """``ctx.optimizer()``'s: the optimizer of a plan that names its own (``Cluster.train``'s ``optimizer=``,
    ``lr=``, ``scheduler=``), which lives on the ps tasks alone. ``step()`` is the run's exchange of every
    parameter's gradient, as a registered torch optimizer's is; ``zero_grad()`` sets the gradients to None."""

    _pscluster_set = 0  # the optimizer of the run's global steps

    def __init__(self, context: WorkerContext, params: list[torch.nn.Parameter]):
        self._pscluster_context, self.params = context, params

    def step(self) -> bool:
        return self._pscluster_context._exchange(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


_classes: dict[type, type] = {}


def _run_optimizer_class(cls: type) -> type:
    """A subclass of the optimizer's class whose ``step()`` is the run's exchange (one per class)."""
    if getattr(cls, "_pscluster_run", False):
        return cls
    if cls not in _classes:
        def step(self, closure=None):
            if closure is not None:
                raise ConfigError("optimizer.step(closure): a run's step applies one gradient per push; compute "
                                  "the loss and backward before step(), without a closure")
            self._opt_called = True  # what a torch lr_scheduler checks
            return self._pscluster_context._exchange(self)

        def zero_grad(self, set_to_none: bool = True) -> None:
            # torch's own wraps its loop in a profiler label, an op call that costs more than the loop itself (more
            # still right after a backward): the label only while a profiler records
            if not set_to_none or torch._C._autograd._profiler_enabled():
                return torch.optim.Optimizer.zero_grad(self, set_to_none)
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

        members = {"step": step, "_pscluster_run": True, "__module__": cls.__module__}
        if cls.zero_grad is torch.optim.Optimizer.zero_grad:  # a class's own zero_grad stays its own
            members["zero_grad"] = zero_grad
        _classes[cls] = type(cls.__name__, (cls,), members)
    return _classes[cls]


def run_loop(spec: ClusterSpec, index: int, plan: TrainPlan, train_fn, *, join: bool = False, log=None,
             planned=None) -> dict:
    """Run ``train_fn(ctx)`` as worker ``index`` of ``plan`` (see the module); its summary, as ``run_worker``
    returns one. ``planned``: the run's plan is made at the loop's first training call by ``planned`` (see
    ``FirstCallContext``), ``plan`` holding the run's settings until then (``settings_plan``)."""
    seeding.seed_worker(plan.seed, index, plan.attempt)
    ctx = WorkerContext(spec, index, plan, join=join, log=log) if planned is None else \
        FirstCallContext(spec, index, plan, planned, log=log)
    try:
        try:
            train_fn(ctx)
        except RunEnded as e:
            ctx.went_past_the_end(e)
        except StaleTask:
            raise
        except Exception as e:
            ctx.failed(e)
            raise
        return ctx.finish()
    finally:
        ctx.close()
