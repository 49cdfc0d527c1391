"""``%pscluster`` refuses bad input with a one-line UsageError that names the fix.

No engines start here: every command below fails before a cluster would start. The
one stand-in is a "running cluster" object for the checks that need one.
"""

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from pscluster.magics import PSClusterMagics
from pscluster.magics.cells import defined_names
from pscluster.magics.parsers import USAGE


class RunningCluster:
    """Stands in for a started Cluster: only what the magics read before training."""

    name = "stand-in"
    running = True

    def train(self, *args, **kwargs):
        raise AssertionError("the magic must refuse the cell before training")


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "pscluster")
    return shell


@pytest.fixture
def magics(shell):
    """The extension's magics object, reset to "no cluster, no run" around each test."""
    obj = next(m for m in shell.magics_manager.registry.values() if isinstance(m, PSClusterMagics))
    obj.cluster = obj.last_run = None
    yield obj
    obj.cluster = obj.last_run = None


def usage_error(shell, line, cell=None) -> str:
    with pytest.raises(UsageError) as info:
        if cell is None:
            shell.run_line_magic("pscluster", line)
        else:
            shell.run_cell_magic("pscluster", line, cell)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("line, fragments", [
    ("", [USAGE]),
    ("bogus", ["unknown command 'bogus'",
               "%pscluster start|attach|train|run|status|placement|checkpoint|kill|scale|tensorboard|stop"]),
    ("start --ps 0", ["ps=0", "use an integer >= 1"]),
    ("start --workers -1", ["workers=-1", "use an integer >= 1"]),
    ("start --gpus 999", ["gpus=999", "use gpus <="]),
    ("start --threads 0", ["threads=0", "use an integer >= 1"]),
    ("start --bogus 1", ["unrecognized arguments: --bogus 1", "see %pscluster start --help"]),
    ("start --ps one", ["invalid int value: 'one'", "see %pscluster start --help"]),
    ("start --name 'unclosed", ["cannot parse the arguments", "check the quotes"]),
    ("train --steps 10", ["train and run are cell magics", "%%pscluster train"]),
    ("stop", ["no cluster to stop", "%pscluster start first"]),
    ("placement", ["no run yet", "%%pscluster train"]),
    ("placement --bogus", ["unrecognized arguments: --bogus", "see %pscluster placement --help"]),
    ("kill worker:1", ["no cluster to kill a task of", "%pscluster start first"]),
    ("kill", ["the following arguments are required: task", "see %pscluster kill --help"]),
    ("checkpoint", ["no run yet", "%pscluster checkpoint"]),
    ("scale --workers 3", ["no cluster to scale", "%pscluster start first"]),
    ("scale", ["the following arguments are required: --workers", "see %pscluster scale --help"]),
    ("attach no-such-cluster", ["no detached cluster named 'no-such-cluster'", "detached=True"]),
], ids=["empty", "unknown-command", "no-ps", "negative-workers", "too-many-gpus", "no-threads", "unknown-option",
        "not-a-number", "quotes", "train-as-line-magic", "stop-before-start", "placement-before-start",
        "placement-bad-option", "kill-before-start", "kill-no-task", "checkpoint-before-train",
        "scale-before-start", "scale-without-count", "attach-unknown"])
def test_bad_line_magics(shell, magics, line, fragments):
    message = usage_error(shell, line)
    for fragment in fragments:
        assert fragment in message, message
    assert magics.cluster is None  # nothing was started


@pytest.mark.parametrize("line, cell, fragments", [
    ("train --steps 10", "model = 1", ["no cluster to train on", "%pscluster start first"]),
    ("start", "x = 1", ["the other commands are line magics"]),
    ("placement", "x = 1", ["the other commands are line magics"]),
], ids=["train-before-start", "start-as-cell-magic", "placement-as-cell-magic"])
def test_bad_cell_magics(shell, magics, line, cell, fragments):
    message = usage_error(shell, line, cell)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("line, fragment", [
    ("train --mode bsp", "argument --mode: invalid choice: 'bsp'"),
    ("train --lr fast", "argument --lr: invalid float value: 'fast'"),
    ("train --staleness-bound two", "argument --staleness-bound: invalid int value: 'two'"),
    ("train --placement best", "argument --placement: invalid choice: 'best'"),
    ("train --partition embedding=x", "argument --partition: 'embedding=x': use NAME=SHARDS"),
    ("train --partition embedding", "argument --partition: 'embedding': use NAME=SHARDS"),
    ("train --partition embedding=0", "argument --partition: 'embedding=0': use NAME=SHARDS"),
    ("train --partition =2", "argument --partition: '=2': use NAME=SHARDS"),
    ("train --checkpoint-every often", "argument --checkpoint-every: invalid int value: 'often'"),
], ids=["mode", "lr", "staleness-bound", "placement", "partition-not-a-number", "partition-no-count",
        "partition-zero", "partition-no-name", "checkpoint-every"])
def test_bad_train_options(shell, magics, line, fragment):
    magics.cluster = RunningCluster()
    message = usage_error(shell, line, "model = 1")
    assert fragment in message and "see %pscluster train --help" in message, message


def test_negative_staleness_bound_is_refused_before_the_cell_runs(shell, magics):
    magics.cluster = RunningCluster()
    shell.user_ns.pop("refused", None)
    message = usage_error(shell, "train --mode ssp --staleness-bound -1", "model = 1\nrefused = 1\n")
    assert "--staleness-bound -1: use an integer >= 0" in message
    assert "refused" not in shell.user_ns


class TrainingCluster(RunningCluster):
    """A stand-in that records what the magic passes to ``train`` and lists one run's placement."""

    def __init__(self):
        self.calls, self.args = [], []

    def train(self, *args, **kwargs):
        self.args.append(args)
        self.calls.append(kwargs)
        return Recorded()

    def placement(self):
        return [f"0.weight/part_{k}: /job:ps/task:{k} (rows {4 * k}-{4 * k + 3}, 256 B)" for k in range(2)] \
            if self.calls else []


class Recorded:
    name = "recorded"

    def dashboard(self):
        pass


TRAIN_CELL = "model = 1\nloss_fn = 2\ndataset = 3\n"


def test_train_options_reach_cluster_train(shell, magics):
    cluster = magics.cluster = TrainingCluster()
    shell.run_cell_magic("pscluster", "train --mode ssp --staleness-bound 3 --placement greedy "
                         "--partition embedding=2 --partition fc.weight=3", TRAIN_CELL)
    (kwargs,) = cluster.calls
    assert kwargs["mode"] == "ssp" and kwargs["staleness_bound"] == 3 and kwargs["placement"] == "greedy"
    assert kwargs["partition"] == {"embedding": 2, "fc.weight": 3}
    shell.run_cell_magic("pscluster", "train", TRAIN_CELL)
    assert cluster.calls[-1]["placement"] == "round_robin" and cluster.calls[-1]["partition"] is None
    assert cluster.calls[-1]["mode"] == "sync" and cluster.calls[-1]["staleness_bound"] == 2


def test_placement_lists_the_latest_run(shell, magics, capsys):
    cluster = magics.cluster = TrainingCluster()
    assert "no run yet" in usage_error(shell, "placement")
    shell.run_cell_magic("pscluster", "train --partition 0.weight=2", TRAIN_CELL)
    capsys.readouterr()
    assert shell.run_line_magic("pscluster", "placement") is None
    assert capsys.readouterr().out.splitlines() == cluster.placement()


def test_train_cell_without_model(shell, magics):
    magics.cluster = RunningCluster()
    message = usage_error(shell, "train --steps 10", "net = 1\nloss_fn = None\n")
    assert "defines no `model`" in message and "assign a torch.nn.Module" in message
    assert "net" not in shell.user_ns  # the cell was refused before it ran


def test_train_cell_without_loss_fn(shell, magics):
    magics.cluster = RunningCluster()
    for name in ("loss_fn", "dataset"):
        shell.user_ns.pop(name, None)
    message = usage_error(shell, "train --steps 10", "model = 1\n")
    assert "defines no `loss_fn`" in message and "torch.nn.CrossEntropyLoss()" in message


def test_train_options_of_the_training_contract_reach_cluster_train(shell, magics):
    cluster = magics.cluster = TrainingCluster()
    shell.run_cell_magic("pscluster", "train --optimizer adamw --opt weight_decay=0.05 --opt betas=(0.9,0.98) "
                         "--opt amsgrad=True --max-grad-norm 0.5 --on-nonfinite skip --buffers average",
                         TRAIN_CELL)
    (kwargs,) = cluster.calls
    assert kwargs["weight_decay"] == 0.05 and kwargs["betas"] == (0.9, 0.98) and kwargs["amsgrad"] is True
    assert kwargs["max_grad_norm"] == 0.5 and kwargs["on_nonfinite"] == "skip" and kwargs["buffers"] == "average"
    message = usage_error(shell, "train --opt 3", TRAIN_CELL)
    assert "'3': use KEY=VALUE, e.g. --opt weight_decay=0.01" in message


def test_train_with_a_step_fn_needs_no_loss_fn(shell, magics):
    cluster = magics.cluster = TrainingCluster()
    shell.user_ns.pop("loss_fn", None)
    shell.run_cell_magic("pscluster", "train --step-fn step", "model = 1\ndataset = 3\ndef step(model, batch):\n"
                         "    return 0\n")
    (kwargs,) = cluster.calls
    assert kwargs["step_fn"] is shell.user_ns["step"] and cluster.args[-1][2] is None
    message = usage_error(shell, "train --step-fn steps", "model = 1\ndataset = 3\n")
    assert "defines no `steps`: assign a function f(model, batch) -> loss to `steps`" in message


def test_a_train_cell_must_define_what_it_trains_on_unless_it_reuses_it(shell, magics):
    cluster = magics.cluster = TrainingCluster()
    shell.run_cell_magic("pscluster", "train", TRAIN_CELL + "test_dataset = 4\n")
    assert cluster.calls[-1]["test_dataset"] == 4
    message = usage_error(shell, "train", "model = 5\n")  # loss_fn and dataset of the cell before
    assert "defines no `loss_fn`" in message and "(or --reuse to take the one of an earlier cell)" in message
    assert shell.user_ns["model"] == 1  # refused before it ran
    shell.run_cell_magic("pscluster", "train --reuse", "model = 5\n")
    assert cluster.args[-1] == (5, 3, 2) and cluster.calls[-1]["test_dataset"] == 4
    shell.run_cell_magic("pscluster", "train", TRAIN_CELL)
    assert cluster.calls[-1]["test_dataset"] is None  # an earlier cell's test set is not taken silently


def test_start_while_running(shell, magics):
    magics.cluster = RunningCluster()
    message = usage_error(shell, "start --ps 1")
    assert "stand-in is already running" in message and "%pscluster stop it first" in message


@pytest.mark.parametrize("line, option", [("start --help", "--workers"), ("train --help", "--batch-size"),
                                          ("train --help", "--partition NAME=SHARDS"),
                                          ("placement --help", "latest run")])
def test_help_prints_and_is_not_an_error(shell, magics, capsys, line, option):
    assert shell.run_line_magic("pscluster", line) is None
    assert option in capsys.readouterr().out
    assert magics.cluster is None


def test_status_without_cluster(shell, magics, capsys):
    assert shell.run_line_magic("pscluster", "status") is None
    assert "no cluster running: %pscluster start" in capsys.readouterr().out


@pytest.mark.parametrize("cell, names", [
    ("model = Net()", {"model"}),
    ("model, loss_fn = a, b\ndataset: object = d", {"model", "loss_fn", "dataset"}),
    ("def model():\n    inner = 1\n    return inner\nclass Net: pass", {"model", "Net"}),
    ("with open(f) as fh:\n    model = load(fh)", {"fh", "model"}),
    ("if big:\n    model = A()\nelse:\n    model = B()", {"model"}),
    ("print(model)\nmodel.eval()", set()),
    ("model = (", set()),
    ("import torch\nimport os.path\nfrom models import model", {"torch", "os", "model"}),
    ("from models import make as model", {"model"}),
    ("try:\n    model = A()\nexcept ImportError:\n    model = B()", {"model"}),
], ids=["assign", "tuple-and-annotated", "def-and-class", "with", "if", "only-reads", "syntax-error", "imports",
        "import-as", "try"])
def testdefined_names(cell, names):
    assert defined_names(cell) == names


@pytest.mark.parametrize("line, fragments", [
    ("start --launcher ssh", ["the ssh launcher needs hosts", "--hosts node1,node2"]),
    ("start --launcher nfs", ["launcher 'nfs': use one of local, ssh, mpi, slurm", "see %pscluster start --help"]),
    ("start --launcher ssh --hosts a,b --ps-hosts c", ["ps host 'c' is not one of the hosts", "list it in hosts"]),
    ("start --launcher ssh --hosts a=1,b=1 --workers 2", ["do not hold 1 ps + 2 workers", "adding up to 3"]),
    ("start --hosts a", ["hosts are for the ssh launcher", "launcher='ssh'"]),
    ("start --launcher mpi --slurm-partition gpu", ["slurm_partition are slurm launcher options", "launcher='slurm'"]),
    ("start --ports 80-90", ["ports 80-90", "1024 <= LO <= HI <= 65535"]),
    ("start --launcher ssh --hosts a --interface eth0", ["interface 'eth0'", "give an IP address"]),
    ("start --launcher ssh --hosts a --detached", ["detached=True works with local engines only", "keep the kernel"]),
], ids=["ssh-without-hosts", "unknown-launcher", "ps-host-not-a-host", "counts-do-not-add-up", "hosts-without-ssh",
        "slurm-option-on-mpi", "privileged-ports", "interface-not-an-address", "detached-remote"])
def test_bad_launcher_options(shell, magics, line, fragments):
    message = usage_error(shell, line)
    for fragment in fragments:
        assert fragment in message, message
    assert magics.cluster is None
