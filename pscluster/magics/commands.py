"""The ``%pscluster`` magics object of a kernel: each command's work, on the cluster it started."""

from __future__ import annotations

import shlex
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..cluster.handle import Cluster
from ..errors import PSClusterError
from ..metrics.store import default_path
from ..runtime import options
from ..tensorboard_server import TensorBoard
from .cells import cell_function, defined_names
from .parsers import CELL_COMMANDS, USAGE, HelpShown, launcher_options, parsers


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
        by_command = parsers()
        if command not in by_command:
            raise UsageError(f"unknown command {command!r}: {USAGE}")
        wants_help = "-h" in rest or "--help" in rest
        if (cell is not None) != (command in CELL_COMMANDS) and not wants_help:
            raise UsageError("train and run are cell magics (%%pscluster train ..., %%pscluster run ...); "
                             "the other commands are line magics (%pscluster ...)")
        try:
            args = by_command[command].parse_args(rest)
            return getattr(self, f"_{command}")(args, cell)
        except HelpShown:
            return None
        except PSClusterError as e:
            raise UsageError(str(e)) from None

    def _start(self, args, cell):
        if self.cluster is not None and self.cluster.running:
            raise UsageError(f"cluster {self.cluster.name} is already running: %pscluster stop it first")
        cluster = Cluster(ps=args.ps, workers=args.workers, gpus=args.gpus, name=args.name, threads=args.threads,
                          detached=args.detached, launcher=args.launcher, encrypt=args.encrypt, spares=args.spares,
                          **launcher_options(args))
        self.cluster = cluster.start(progress=True)
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
        defined = defined_names(cell)
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
            train_fn = cell_function(cell, self.shell)
        except SyntaxError as e:
            raise UsageError(f"the %%pscluster run cell does not parse: {e.msg} (line {e.lineno} of the cell)") \
                from None
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
