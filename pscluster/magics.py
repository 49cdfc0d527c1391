"""``%pscluster`` and ``%%pscluster``: thin wrappers over the public API.

    %pscluster start --ps 1 --workers 2
    %pscluster start --launcher ssh --hosts node1,node2=2 --ps-hosts node1 --interface 10.0.0.1 --ports 20000-20100
    %pscluster start --launcher slurm --partition gpu --account proj --time-limit 01:00:00 --sbatch-arg=--gres=gpu:1
    %pscluster start --launcher pbs --launcher-opt queue=long --interface 10.0.0.1   (any ipyparallel launcher)
    %pscluster start --launcher mpi --mpi-arg=--hostfile --mpi-arg=hosts.txt --interface 10.0.0.1
    %%pscluster train --mode sync --steps 600 --batch-size 64 --optimizer sgd --lr 0.1 [--wait] [--name N --resume]
    model = ...; loss_fn = ...; dataset = ...; test_dataset = ... (optional)
    %%pscluster train --step-fn step --opt weight_decay=0.01 --max-grad-norm 1.0 [--reuse]
    model = ...; dataset = ...; def step(model, batch): ... return loss, {"metric": value}
    %%pscluster train --mode ssp --staleness-bound 2 --placement greedy --partition embedding=2
    ...
    %%pscluster run --mode sync --steps 1000 [--wait]     (the cell is the body of train_fn(ctx): your own loop)
    model = ctx.model(Net()); optimizer = ctx.optimizer(torch.optim.Adam(model.parameters()))
    for x, y in ctx.shard(dataset, batch_size=64): ...; optimizer.step(); if ctx.should_stop(): break
    %pscluster placement        (which ps task holds each variable, or each shard, of the latest run)
    %pscluster status
    %pscluster tensorboard      (TensorBoard on the runs' event files, shown inline; --stop ends it)
    %pscluster stop

Errors are shown as one line (IPython's UsageError), never a traceback, and
leave the running cluster and finished runs as they were.
"""

from __future__ import annotations

import argparse
import ast
import shlex
import textwrap
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .cluster.handle import Cluster
from .cluster import launchers
from .errors import ConfigError, PSClusterError
from .metrics.store import default_path
from .runtime import options
from .tensorboard_server import TensorBoard

USAGE = ("usage: %pscluster start|attach|train|run|status|placement|checkpoint|kill|scale|tensorboard|stop [options]  "
         "(%pscluster <command> --help for options)")
LAUNCHER_OPTIONS = ("hosts", "ps_hosts", "interface", "ports", "ssh_args", "remote_python", "partition", "account",
                    "time_limit", "qos", "sbatch_args", "mpi_args")  # and --launcher-opt KEY=VALUE
CELL_COMMANDS = ("train", "run")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message}: see %pscluster {self.prog.split()[-1]} --help")

    def exit(self, status=0, message=None):
        if message:
            print(message)
        raise _HelpShown


class _HelpShown(Exception):
    pass


def _option(text: str) -> tuple[str, object]:
    """``betas=(0.9, 0.98)`` -> ``("betas", (0.9, 0.98))``: the value as a Python literal (a number, tuple, bool,
    None...), else as a string; an argparse type, so a bad form is a one-line usage error."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE, e.g. --opt weight_decay=0.01 "
                                         "--opt betas=(0.9,0.98)")
    try:
        return key.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return key.strip(), value.strip()


def _launcher(name: str) -> str:
    """A launcher name that names one (argparse type): the one-line error lists the names otherwise."""
    try:
        launchers.find(name)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _with_wait(parser: _Parser) -> _Parser:
    parser.add_argument("--wait", action="store_true",
                        help="block until the run ends, with a progress bar and the workers' log lines")
    return parser


def _parsers() -> dict[str, _Parser]:
    start = _Parser(prog="%pscluster start", add_help=True)
    start.add_argument("--ps", type=int, default=1, help="number of ps tasks (>= 1)")
    start.add_argument("--workers", type=int, default=2, help="number of worker tasks (>= 1)")
    start.add_argument("--gpus", type=int, default=None, help="GPUs for the workers (default: all visible)")
    start.add_argument("--name", default=None, help="cluster name")
    start.add_argument("--detached", action="store_true",
                       help="outlive this kernel (and go on training); a later kernel takes it over with "
                            "%%pscluster attach NAME")
    start.add_argument("--threads", type=int, default=None,
                       help="torch threads per task (default: the cores shared out among the tasks)")
    start.add_argument("--encrypt", action="store_true",
                       help="run the data plane over ZeroMQ CURVE encryption (it is always signed)")
    start.add_argument("--launcher", type=_launcher, default=launchers.DEFAULT,
                       help="how the engines start: here (local), over ssh, with mpiexec, as Slurm jobs, or any "
                            f"launcher of ipyparallel or registered with pscluster ({', '.join(launchers.names())}), "
                            "or an importable package.module.Class")
    start.add_argument("--launcher-opt", dest="launcher_opts", action="append", type=_option, default=[],
                       metavar="KEY=VALUE",
                       help="another option of the launcher (repeatable), e.g. --launcher pbs --launcher-opt "
                            "queue=long (a trait of ipyparallel's launcher)")
    start.add_argument("--hosts", default=None, metavar="HOST[=N],...",
                       help="ssh: [user@]host[:port], N engines there (default: as the ps/worker rule places them)")
    start.add_argument("--ps-hosts", default=None, metavar="HOST,...",
                       help="the hosts of the ps tasks (default: the first host); the workers go to the others")
    start.add_argument("--interface", default=None, metavar="IP",
                       help="the address the controller and the metrics collector listen on (default: 127.0.0.1 "
                            "for local and mpi, else this machine's address on the route to the first host)")
    start.add_argument("--ports", default=None, metavar="LO-HI", help="pick the data-plane and metrics ports here")
    start.add_argument("--ssh-arg", dest="ssh_args", action="append", default=[], metavar="ARG",
                       help="ssh: an argument for ssh and scp (repeatable), e.g. --ssh-arg=-i --ssh-arg=KEY")
    start.add_argument("--remote-python", default=None, help="ssh: the Python on the hosts (default: this one's path)")
    start.add_argument("--partition", default=None, help="slurm: the partition")
    start.add_argument("--account", default=None, help="slurm: the account")
    start.add_argument("--time-limit", default=None, help="slurm: the job's time limit, e.g. 01:00:00")
    start.add_argument("--qos", default=None, help="slurm: the QoS")
    start.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="ARG",
                       help="slurm: an extra #SBATCH argument of each engine's job (repeatable), "
                            "e.g. --sbatch-arg=--gres=gpu:1")
    start.add_argument("--mpi-arg", dest="mpi_args", action="append", default=[], metavar="ARG",
                       help="mpi: an mpiexec argument (repeatable), e.g. --mpi-arg=--hostfile --mpi-arg=hosts.txt")

    train = _with_wait(options.add_flags(_Parser(prog="%%pscluster train"), options.TRAIN))
    train.add_argument("--lr", type=float, default=0.01, help="learning rate")
    train.add_argument("--momentum", type=float, default=None, help="(optimizers that take it)")
    train.add_argument("--opt", type=_option, action="append", default=[], metavar="KEY=VALUE",
                       help="an optimizer option, as a Python literal (repeatable), e.g. --opt weight_decay=0.01 "
                            "--opt betas=(0.9,0.98)")
    train.add_argument("--step-fn", default=None, metavar="NAME",
                       help="the cell's function f(model, batch) -> loss or (loss, {metric: value}) to train with "
                            "(then the cell needs no loss_fn)")
    train.add_argument("--scheduler", default=None, metavar="NAME",
                       help="a torch.optim.lr_scheduler class (e.g. StepLR) or a function of the global step in the "
                            "cell that returns the learning-rate factor")
    train.add_argument("--scheduler-opt", type=_option, action="append", default=[], metavar="KEY=VALUE",
                       help="an option of the scheduler, as a Python literal (repeatable), e.g. --scheduler-opt "
                            "step_size=100")
    train.add_argument("--reuse", action="store_true",
                       help="take dataset, loss_fn, test_dataset and the step function from earlier cells when "
                            "this cell does not define them")

    run = _with_wait(options.add_flags(_Parser(prog="%%pscluster run", description="the cell is the body of "
                                               "train_fn(ctx), run on every worker: your own training loop"),
                                       options.RUN))

    kill = _Parser(prog="%pscluster kill", description="SIGKILL one task, to try a failure: the run recovers")
    kill.add_argument("task", help="role:index, e.g. worker:1 or ps:0")

    attach = _Parser(prog="%pscluster attach", description="take over a detached cluster and its run")
    attach.add_argument("name", help="the cluster's name (pscluster.clusters() lists them)")

    scale = _Parser(prog="%pscluster scale", description="add or remove workers, during a run too")
    scale.add_argument("--workers", type=int, required=True, help="the number of workers from now on (>= 1)")

    tensorboard = _Parser(prog="%pscluster tensorboard",
                          description="TensorBoard on the runs' event files, on 127.0.0.1, shown inline")
    tensorboard.add_argument("--port", type=int, default=0, help="its port (default: a free one)")
    tensorboard.add_argument("--stop", action="store_true", help="stop the TensorBoard this kernel started")
    return {"start": start, "train": train, "run": run, "status": _Parser(prog="%pscluster status"), "scale": scale,
            "attach": attach,
            "placement": _Parser(prog="%pscluster placement",
                                 description="one line per variable or shard of the latest run: its ps task"),
            "stop": _Parser(prog="%pscluster stop"), "kill": kill,
            "checkpoint": _Parser(prog="%pscluster checkpoint",
                                  description="write a checkpoint of the latest run now; prints its manifest"),
            "tensorboard": tensorboard}


@magics_class
class PSClusterMagics(Magics):
    """The cluster started by ``%pscluster start`` lives in this object (one per kernel)."""

    def __init__(self, shell):
        super().__init__(shell)
        self.cluster: Cluster | None = None
        self.last_run = None
        self.board: TensorBoard | None = None

    @line_cell_magic
    def pscluster(self, line: str, cell: str | None = None):
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"cannot parse the arguments ({e}): check the quotes") from None
        if not words:
            raise UsageError(USAGE)
        command, rest = words[0], words[1:]
        parsers = _parsers()
        if command not in parsers:
            raise UsageError(f"unknown command {command!r}: {USAGE}")
        wants_help = "-h" in rest or "--help" in rest
        if (cell is not None) != (command in CELL_COMMANDS) and not wants_help:
            raise UsageError("train and run are cell magics (%%pscluster train ..., %%pscluster run ...); "
                             "the other commands are line magics (%pscluster ...)")
        try:
            args = parsers[command].parse_args(rest)
            return getattr(self, f"_{command}")(args, cell)
        except _HelpShown:
            return None
        except PSClusterError as e:
            raise UsageError(str(e)) from None

    def _start(self, args, cell):
        if self.cluster is not None and self.cluster.running:
            raise UsageError(f"cluster {self.cluster.name} is already running: %pscluster stop it first")
        launcher_options = {k: v for k in LAUNCHER_OPTIONS if (v := getattr(args, k))}
        launcher_options.update(args.launcher_opts)
        cluster = Cluster(ps=args.ps, workers=args.workers, gpus=args.gpus, name=args.name, threads=args.threads,
                          detached=args.detached, launcher=args.launcher, encrypt=args.encrypt, **launcher_options)
        where = ("local engines" if cluster.launcher.local else
                 f"engines started by the {cluster.launcher.kind} launcher")
        print(f"starting {cluster.num_ps} ps + {cluster.num_workers} workers on {where}...", flush=True)
        self.cluster = cluster.start()
        return self.cluster

    def _attach(self, args, cell):
        if self.cluster is not None and self.cluster.running:
            raise UsageError(f"cluster {self.cluster.name} is running in this kernel: %pscluster stop it first")
        self.cluster = Cluster.attach(args.name)
        self.last_run = self.cluster.runs[-1] if self.cluster.runs else None
        print(f"attached to {self.cluster.name}" + (f"; following {self.last_run.name}" if self.last_run else ""))
        if self.last_run is not None:
            self.last_run.dashboard()
        return self.cluster

    def _running(self, what: str) -> Cluster:
        if self.cluster is None or not self.cluster.running:
            raise UsageError(f"no cluster to {what}: run %pscluster start first")
        return self.cluster

    def _train(self, args, cell):
        cluster = self._running("train on")
        given = options.from_flags(args, options.TRAIN)
        defined = _defined_names(cell)
        if "model" not in defined:
            raise UsageError("the %%pscluster train cell defines no `model`: assign a torch.nn.Module "
                             "(or a function that builds one) to `model` in the cell")
        required = [(args.step_fn, "a function f(model, batch) -> loss") if args.step_fn else
                    ("loss_fn", "a loss function, e.g. torch.nn.CrossEntropyLoss()"),
                    ("dataset", "a dataset, e.g. pscluster.datasets.digits('train')")]
        for name, what in required:
            if name not in defined and not args.reuse:
                hint = " (or --reuse to take the one of an earlier cell)" if name in self.shell.user_ns else ""
                raise UsageError(f"the %%pscluster train cell defines no `{name}`: assign {what} to `{name}`{hint}")
        result = self.shell.run_cell(cell, store_history=False)
        if not result.success:
            return None
        ns = self.shell.user_ns
        for name, what in required:
            if name not in ns:
                raise UsageError(f"no `{name}` is defined: assign {what} to `{name}` in the cell")
        kwargs = {"lr": args.lr, **dict(args.opt)}
        if args.momentum is not None:
            kwargs["momentum"] = args.momentum
        test_dataset = ns.get("test_dataset") if "test_dataset" in defined or args.reuse else None
        run = cluster.train(ns["model"], ns["dataset"], None if args.step_fn else ns["loss_fn"],
                            step_fn=ns[args.step_fn] if args.step_fn else None,
                            scheduler=ns.get(args.scheduler, args.scheduler) if args.scheduler else None,
                            scheduler_options=dict(args.scheduler_opt) or None, test_dataset=test_dataset, code=cell,
                            **given, **kwargs)
        return self._follow(run, args.wait)

    def _run(self, args, cell):
        cluster = self._running("run on")
        given = options.from_flags(args, options.RUN)
        try:
            train_fn = _cell_function(cell, self.shell.user_ns)
        except SyntaxError as e:
            raise UsageError(f"the %%pscluster run cell does not parse: {e.msg} (line {e.lineno - 1})") from None
        return self._follow(cluster.run(train_fn, code=cell, **given), args.wait)

    def _follow(self, run, wait: bool):
        """Show a run that started: its dashboard, and with ``wait`` its progress until it ends (Ctrl-C stops it)."""
        self.last_run = run
        run.dashboard()
        if wait:
            try:
                run.wait(progress=True)
            except KeyboardInterrupt:
                run.stop()
                print(f"{run.name} stopped at global step {run.global_step}")
        return run

    def _status(self, args, cell):
        if self.cluster is None or not self.cluster.running:
            print("no cluster running: %pscluster start --ps 1 --workers 2")
            return None
        return self.cluster

    def _placement(self, args, cell):
        lines = self.cluster.placement() if self.cluster is not None else []
        if not lines:
            raise UsageError("no run yet: train one with %%pscluster train, then %pscluster placement lists "
                             "the ps task of each of its variables")
        print("\n".join(lines))

    def _kill(self, args, cell):
        pid = self._running("kill a task of").kill(args.task)
        print(f"killed {args.task} (pid {pid})")

    def _scale(self, args, cell):
        cluster = self._running("scale")
        before = cluster.num_workers
        cluster.scale(args.workers).wait()
        run = cluster.active_run
        print(f"workers: {before} -> {cluster.num_workers}" + (f" ({run.name} goes on with them)" if run else ""))

    def _checkpoint(self, args, cell):
        if self.last_run is None:
            raise UsageError("no run yet: train one with %%pscluster train, then %pscluster checkpoint")
        path = self.last_run.checkpoint()
        print(f"checkpoint written: {path}")
        return None

    def _tensorboard(self, args, cell):
        if self.board is not None:
            self.board.stop()
            self.board = None
        if args.stop:
            print("TensorBoard stopped")
            return None
        store = self.cluster.store.path if self.cluster is not None else default_path()
        self.board = TensorBoard(Path(store).parent / "tensorboard", port=args.port).start()
        print(f"TensorBoard: {self.board.url} (tensorboard --logdir {self.board.logdir})")
        return self.board

    def _stop(self, args, cell):
        cluster = self._running("stop")
        cluster.stop()
        print(f"cluster {cluster.name} stopped")


TRAIN_FN = "train_fn"  # the name a %%pscluster run cell's function has in its tracebacks


def _cell_function(cell: str, namespace: dict):
    """``def train_fn(ctx): <the cell>``, defined in ``namespace`` (the notebook's, so that the cell sees its names
    and the function is shipped to the engines with those it uses), without binding a name there."""
    source = f"def {TRAIN_FN}(ctx):\n" + (textwrap.indent(cell, "    ") if cell.strip() else "    pass\n")
    scope: dict = {}
    exec(compile(source, "<%%pscluster run>", "exec"), namespace, scope)
    return scope[TRAIN_FN]


def _defined_names(cell: str) -> set[str]:
    """Names a cell binds at top level (assignments, loops, with, defs, imports; not inside
    function or class bodies); empty if the cell does not parse."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return set()
    names: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # names bound inside are local to it
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Lambda):
            continue
        pending.extend(ast.iter_child_nodes(node))
    return names


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(PSClusterMagics(ipython))
