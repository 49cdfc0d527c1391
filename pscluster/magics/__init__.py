"""``%pscluster`` and ``%%pscluster``: thin wrappers over the public API.

    %pscluster start --ps 1 --workers 2
    %pscluster start --launcher ssh --hosts node1,node2=2 --ps-hosts node1 --interface 10.0.0.1 --ports 20000-20100
    %pscluster start --launcher slurm --slurm-partition gpu --account proj --time-limit 01:00:00 --sbatch-arg=--gres=gpu:1
    %pscluster start --launcher pbs --launcher-opt queue=long --interface 10.0.0.1   (any ipyparallel launcher)
    %pscluster start --launcher mpi --mpi-arg=--hostfile --mpi-arg=hosts.txt --interface 10.0.0.1
    %%pscluster train --mode sync --steps 600 --batch-size 64 --optimizer sgd --lr 0.1 [--wait] [--name N --resume]
    model = ...; loss_fn = ...; dataset = ...; test_dataset = ... (optional)
    %%pscluster train --step-fn step --opt weight_decay=0.01 --max-grad-norm 1.0 [--reuse]
    model = ...; dataset = ...; def step(model, batch): ... return loss, {"metric": value}
    %%pscluster train --mode ssp --staleness-bound 2 --placement greedy --partition embedding=2
    ...
    %%pscluster run --mode sync [--steps 1000] [--wait]   (the cell is the body of train_fn(ctx): your own loop)
    model = ctx.model(Net()); optimizer = ctx.optimizer(torch.optim.Adam(model.parameters()))
    for epoch in range(3): for x, y in ctx.shard(DataLoader(dataset, batch_size=64, shuffle=True)): ...
    %pscluster placement        (which ps task holds each variable, or each shard, of the latest run)
    %pscluster status
    %pscluster tensorboard      (TensorBoard on the runs' event files, shown inline; --stop ends it)
    %pscluster stop

Errors are shown as one line (IPython's UsageError), never a traceback, and
leave the running cluster and finished runs as they were.

The commands' flags are in ``parsers`` (the run's from ``runtime.options``, the cluster's defaults from
``Cluster``'s signature), the magics object that runs them in ``commands``, and what a cell is made into in
``cells``.
"""

from .commands import PSClusterMagics


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(PSClusterMagics(ipython))
