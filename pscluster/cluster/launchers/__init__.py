"""How a cluster's engines start: a ``Launcher``, chosen by name, with its options.

    Launcher()                                              # local engines (the default)
    Launcher("ssh", hosts=("node1", "node2=3"), ps_hosts=("node1",), ports=(20000,20100))
    Launcher("slurm", slurm_partition="gpu", account="proj", time_limit="01:00:00", sbatch_args=("--gres=gpu:1",))
    Launcher("mpi", mpi_args=("--hostfile", "hosts.txt"), interface="10.0.0.1")
    Launcher("pbs", queue="long")                           # any of ipyparallel's engine launchers, by name
    Launcher("mysite.launchers.K8sEngineSetLauncher")       # or by class

The interface every launcher implements, and how a name finds its class, are in ``base``; each of
pscluster's own launchers is a module here (``local``, ``ssh``, ``mpi``, ``slurm``), ipyparallel's others run
through ``ipp``. A new kind (Kubernetes, say) is one ``Launcher`` subclass, made known by ``register`` or the
entry point group ``pscluster.launchers``; its options declared with ``option`` are ``%pscluster start``'s flags
too (``flags``) once it is registered.
"""

from .base import (CONTROLLER_HB_MISSES, DEFAULT, HB_PERIOD_MS, HEARTBEAT_DEADLINE_S, LOCAL_HB_MISSES,
                   LOCAL_HB_PERIOD_MS, LOOPBACK, ORPHAN_DEADLINE_S, Flag, Launcher, find, flags, host_name, names,
                   option, parse_hosts, parse_ports, register)
from .ipp import BatchLauncher, IPyParallelLauncher
from .local import LocalLauncher
from .mpi import MPILauncher
from .slurm import SlurmLauncher
from .ssh import SSHLauncher

for _name, _cls in (("local", LocalLauncher), ("ssh", SSHLauncher), ("mpi", MPILauncher), ("slurm", SlurmLauncher)):
    register(_name, _cls)

__all__ = ["CONTROLLER_HB_MISSES", "DEFAULT", "HB_PERIOD_MS", "HEARTBEAT_DEADLINE_S", "LOCAL_HB_MISSES",
           "LOCAL_HB_PERIOD_MS", "LOOPBACK", "ORPHAN_DEADLINE_S", "BatchLauncher", "Flag", "IPyParallelLauncher",
           "Launcher", "LocalLauncher", "MPILauncher", "SSHLauncher", "SlurmLauncher", "find", "flags", "host_name",
           "names", "option", "parse_hosts", "parse_ports", "register"]
