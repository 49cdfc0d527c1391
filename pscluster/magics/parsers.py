"""The flags of each ``%pscluster`` command: argparse parsers whose errors are one line (``ConfigError``)
naming ``--help``. A run's flags come from ``runtime.options``; a cluster's defaults from ``Cluster``'s signature."""

from __future__ import annotations

import argparse
import ast
import inspect

from ..cluster import launchers
from ..cluster.handle import Cluster
from ..errors import ConfigError
from ..runtime import options

USAGE = ("usage: %pscluster start|attach|train|run|status|placement|checkpoint|kill|scale|tensorboard|stop [options]  "
         "(%pscluster <command> --help for options)")
CELL_COMMANDS = ("train", "run")
CLUSTER_DEFAULTS = {name: p.default for name, p in inspect.signature(Cluster).parameters.items()}


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message}: see %pscluster {self.prog.split()[-1]} --help")

    def exit(self, status=0, message=None):
        if message:
            print(message)
        raise HelpShown


class HelpShown(Exception):
    pass


def option_value(text: str) -> tuple[str, object]:
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


def launcher_name(name: str) -> str:
    """A launcher name that names one (argparse type): the one-line error lists the names otherwise."""
    try:
        launchers.find(name)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def launcher_options(args) -> dict:
    """The launcher options ``%pscluster start``'s parsed ``args`` give (``launchers.flags``), and its
    ``--launcher-opt`` ones."""
    given = {f.name: v for f in launchers.flags() if (v := getattr(args, f.name, None))}
    return {**given, **dict(args.launcher_opts)}


def _with_wait(parser: Parser) -> Parser:
    parser.add_argument("--wait", action="store_true",
                        help="block until the run ends, with a progress bar and the workers' log lines")
    return parser


def parsers() -> dict[str, Parser]:
    start = Parser(prog="%pscluster start", add_help=True)
    start.add_argument("--ps", type=int, default=CLUSTER_DEFAULTS["ps"], help="number of ps tasks (>= 1)")
    start.add_argument("--workers", type=int, default=CLUSTER_DEFAULTS["workers"], help="number of worker tasks (>= 1)")
    start.add_argument("--gpus", type=int, default=None, help="GPUs for the workers (default: all visible)")
    start.add_argument("--name", default=None, help="cluster name")
    start.add_argument("--detached", action="store_true",
                       help="outlive this kernel (and go on training); a later kernel takes it over with "
                            "%%pscluster attach NAME")
    start.add_argument("--threads", type=int, default=None,
                       help="torch threads per task (default: the cores shared out among the tasks)")
    start.add_argument("--spares", type=int, default=None,
                       help="engines kept started for a lost task's replacement or an added worker (default: 1 "
                            "with local engines, 0 with a remote launcher)")
    start.add_argument("--encrypt", action="store_true",
                       help="run the data plane over ZeroMQ CURVE encryption (it is always signed)")
    start.add_argument("--launcher", type=launcher_name, default=CLUSTER_DEFAULTS["launcher"],
                       help="how the engines start: here (local), over ssh, with mpiexec, as Slurm jobs, or any "
                            f"launcher of ipyparallel or registered with pscluster ({', '.join(launchers.names())}), "
                            "or an importable package.module.Class")
    start.add_argument("--launcher-opt", dest="launcher_opts", action="append", type=option_value, default=[],
                       metavar="KEY=VALUE",
                       help="another option of the launcher (repeatable), e.g. --launcher pbs --launcher-opt "
                            "queue=long (a trait of ipyparallel's launcher)")
    for f in launchers.flags():  # the launchers' own options (--launcher-opt KEY=VALUE for any other)
        help_text = f"{f.owner}: {f.help}" if f.owner else f.help
        if f.repeat:
            start.add_argument(f.flag, dest=f.name, action="append", default=[], metavar=f.metavar, help=help_text)
        else:
            start.add_argument(f.flag, dest=f.name, default=None, metavar=f.metavar, help=help_text)

    train = _with_wait(options.add_flags(Parser(prog="%%pscluster train"), options.TRAIN))
    train.add_argument("--lr", type=float, default=0.01, help="learning rate")
    train.add_argument("--momentum", type=float, default=None, help="(optimizers that take it)")
    train.add_argument("--opt", type=option_value, action="append", default=[], metavar="KEY=VALUE",
                       help="an optimizer option, as a Python literal (repeatable), e.g. --opt weight_decay=0.01 "
                            "--opt betas=(0.9,0.98)")
    train.add_argument("--step-fn", default=None, metavar="NAME",
                       help="the cell's function f(model, batch) -> loss or (loss, {metric: value}) to train with "
                            "(then the cell needs no loss_fn)")
    train.add_argument("--scheduler", default=None, metavar="NAME",
                       help="a torch.optim.lr_scheduler class (e.g. StepLR) or a function of the global step in the "
                            "cell that returns the learning-rate factor")
    train.add_argument("--scheduler-opt", type=option_value, action="append", default=[], metavar="KEY=VALUE",
                       help="an option of the scheduler, as a Python literal (repeatable), e.g. --scheduler-opt "
                            "step_size=100")
    train.add_argument("--reuse", action="store_true",
                       help="take dataset, loss_fn, test_dataset and the step function from earlier cells when "
                            "this cell does not define them")

    run = _with_wait(options.add_flags(Parser(prog="%%pscluster run", description="the cell is the body of "
                                               "train_fn(ctx), run on every worker: your own training loop"),
                                       options.RUN))

    kill = Parser(prog="%pscluster kill", description="SIGKILL one task, to try a failure: the run recovers")
    kill.add_argument("task", help="role:index, e.g. worker:1 or ps:0")

    attach = Parser(prog="%pscluster attach", description="take over a detached cluster and its run")
    attach.add_argument("name", help="the cluster's name (pscluster.clusters() lists them)")

    scale = Parser(prog="%pscluster scale", description="add or remove workers, during a run too")
    scale.add_argument("--workers", type=int, required=True, help="the number of workers from now on (>= 1)")

    tensorboard = Parser(prog="%pscluster tensorboard",
                          description="TensorBoard on the runs' event files, on 127.0.0.1, shown inline")
    tensorboard.add_argument("--port", type=int, default=0, help="its port (default: a free one)")
    tensorboard.add_argument("--stop", action="store_true", help="stop the TensorBoard this kernel started")
    return {"start": start, "train": train, "run": run, "status": Parser(prog="%pscluster status"), "scale": scale,
            "attach": attach,
            "placement": Parser(prog="%pscluster placement",
                                 description="one line per variable or shard of the latest run: its ps task"),
            "stop": Parser(prog="%pscluster stop"), "kill": kill,
            "checkpoint": Parser(prog="%pscluster checkpoint",
                                  description="write a checkpoint of the latest run now; prints its manifest"),
            "tensorboard": tensorboard}
