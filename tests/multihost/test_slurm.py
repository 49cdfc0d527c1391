"""The Slurm launcher against a real Slurm on this machine: munged, slurmctld and slurmd started here (one node,
``localhost``), each engine a job of its own (the default; sbatch_args such as ``--nodes=2`` make the first
engines one job, checked here as far as its batch script). A cluster trains to its target; a worker whose job is
cancelled with ``scancel`` is replaced by a new job and the run still ends exactly on its step target; ``stop()``
leaves no job in the queue. Plus the batch script the launcher submits (no daemons needed).

How Slurm 22.05 (Debian 12's slurmctld, slurmd, munge; ``make slurm-deps``) runs here, found by trying:

- No cgroups needed: ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (the cgroup plugins
  want a writable cgroup hierarchy of their own), no accounting (``accounting_storage/none``,
  ``jobacct_gather/none``). slurmd logs that it cannot load mpi/pmix_v4: harmless with ``MpiDefault=none``.
- Everything on loopback: ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`` binds slurmctld, slurmd and
  srun's own ports to the address ``localhost`` resolves to (without it, 0.0.0.0); ``SlurmctldHost=localhost``
  and ``NodeName=localhost NodeAddr=127.0.0.1`` with ``slurmd -N localhost`` (the machine's host name is another).
- Two cores, three engines: the partition has ``OverSubscribe=FORCE:8`` with ``select/cons_tres`` and
  ``CR_CPU`` (no memory accounting), else the third one-CPU job waits for a free CPU forever.
- munged refuses a socket whose directory is not reachable by everyone (pytest's tmp directories are 0700):
  ``--force`` makes it a warning. Every path (socket, key, pid, seed, log) points into the test's directory and
  the clients find the socket through ``AuthInfo=socket=...`` in slurm.conf; ``SLURM_CONF`` names that file for
  sbatch, squeue, scancel (and the engines' srun: sbatch's ``--export=ALL``).
- All three daemons run in the foreground (``-F``, ``-D``) as children of the test, so their pids are known and
  they are stopped by pid; the slurmstepd processes of the jobs (children of init) end with their jobs, and
  any left are killed by pid too.
- Timings on 2 loaded cores: the daemons answer within ~1 s; a job starts ~1 s after sbatch; scancel ends its
  processes within ~0.1 s, an engine's too (pscluster's SIGTERM handler: ipyparallel's own would wait for the
  training call to end, i.e. until Slurm's KillWait, 30 s, ends in SIGKILL). The whole test: 51 s at a load of 7
  (3 engines registered in 20 s, the replacement trained 15 s after scancel), 83 s at a load of 10.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch

import pscluster
from pscluster.cluster.launchers import Launcher, SlurmLauncher
from pscluster.cluster.reaper import alive

from ..integration.conftest import events, mlp, wait_for_step
from ..integration.test_recovery import SlowWhile, wait_until_trained_by
from ..ports import quiet_port_range

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
PARTITION = "pscl"
STEPS = 600


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm daemons run as root here (SlurmUser=root): run the tests as root"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.access(f"/usr/sbin/{d}", os.X_OK)]
    if missing:
        return f"{', '.join(missing)} missing: make slurm-deps installs slurmctld, slurmd, munge"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _queue() -> list[str]:
    """The ids of the jobs squeue lists (pending, running, completing)."""
    listed = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, timeout=30,
                            check=True)
    return listed.stdout.split()


def _our_stepds(conf: str) -> list[int]:
    """The slurmstepd processes of this test's Slurm (told apart by their SLURM_CONF)."""
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == "slurmstepd" and p.environ().get("SLURM_CONF") == conf:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged, slurmctld and slurmd for this module, on loopback; SLURM_CONF set for the clients. Yields the
    path of slurm.conf; stops the daemons (and any job step left) by pid."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir()
    (d / "munge").chmod(0o700)
    subprocess.run([_binary("mungekey"), "--create", f"--keyfile={d}/munge/munge.key"], check=True, timeout=30)
    started: list[subprocess.Popen] = []
    conf = str(d / "slurm.conf")
    before = os.environ.get("SLURM_CONF")
    try:
        socket_path = d / "munge" / "munge.socket"
        started.append(subprocess.Popen(
            [_binary("munged"), "--foreground", "--force", f"--socket={socket_path}", f"--key-file={d}/munge/munge.key",
             f"--pid-file={d}/munge/munged.pid", f"--seed-file={d}/munge/munged.seed",
             f"--log-file={d}/munge/munged.log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: socket_path.exists(), 15, "munged made no socket", d / "munge" / "munged.log", started[-1])
        hardware = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, check=True,
                                  timeout=30).stdout
        cpus, memory = re.search(r"CPUs=(\d+)", hardware)[1], re.search(r"RealMemory=(\d+)", hardware)[1]
        ctld_port, slurmd_port = quiet_port_range(2)
        with open(conf, "w") as f:
            f.write(f"""ClusterName=pscltest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")
        os.environ["SLURM_CONF"] = conf
        log = d / "log"
        started.append(subprocess.Popen([_binary("slurmctld"), "-D", "-i"], stdout=open(log / "slurmctld.out", "w"),
                                        stderr=subprocess.STDOUT))
        started.append(subprocess.Popen([_binary("slurmd"), "-D", "-N", "localhost"],
                                        stdout=open(log / "slurmd.out", "w"), stderr=subprocess.STDOUT))
        _wait(lambda: _idle(), 30, "the node did not turn idle", log / "slurmctld.log", *started[1:])
        yield conf
    finally:
        try:
            if started[1:] and started[1].poll() is None:
                subprocess.run(["scancel", "--quiet", f"--partition={PARTITION}"], timeout=30)
        finally:
            for process in reversed(started):
                _stop(process)
            for pid in _our_stepds(conf):  # steps of jobs that outlived the daemons
                os.kill(pid, signal.SIGKILL)
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before


def _idle() -> bool:
    state = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30)
    return state.returncode == 0 and state.stdout.strip() == "idle"


def _wait(condition, timeout: float, what: str, log, *processes) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.args[0] for p in processes if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{what} ({', '.join(ended) or 'timed out'}); {log.name}: {tail}")
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_slurm_jobs_train_a_cancelled_workers_job_is_replaced_and_stop_leaves_no_job(slurm, tmp_path):
    digits = pscluster.datasets.digits("train")
    cluster = pscluster.Cluster(ps=1, workers=2, launcher="slurm", slurm_partition=PARTITION, time_limit="10",
                                interface="127.0.0.1")
    assert isinstance(cluster.launcher, SlurmLauncher)
    started = time.monotonic()
    cluster.start()
    engine_pids = [t.pid for t in (*cluster.spec.ps, *cluster.spec.workers)]
    try:
        print(f"3 engines as Slurm jobs in {time.monotonic() - started:.1f}s")
        # one job per engine, each engine where the launcher says: its pid on this machine, in its job
        where = cluster._engines.where()
        jobs = {e: w["job"] for e, w in where.items()}
        assert len(set(jobs.values())) == 3 and sorted(jobs.values()) == sorted(_queue())
        for w in where.values():
            assert psutil.Process(w["pid"]).environ()["SLURM_JOB_ID"] == w["job"]
        assert {t.host for t in (*cluster.spec.ps, *cluster.spec.workers)} == {"127.0.0.1"}

        # the run must still train when the replacement's job has started and its engine registered: from the
        # loss until the replacement trained, batches come slowly (as in integration/test_recovery)
        slow = tmp_path / "slow"
        run = cluster.train(mlp, SlowWhile(digits, str(slow), delay_s=0.25), torch.nn.CrossEntropyLoss(),
                            lr=0.1, mode="sync", steps=STEPS, batch_size=32, checkpoint_secs=None)
        wait_for_step(run, 50)
        slow.touch()
        victim = cluster.spec.task("worker", 1)
        cancelled = jobs[victim.engine_id]
        subprocess.run(["scancel", cancelled], check=True, timeout=30)
        cancelled_at = time.time()
        deadline = time.monotonic() + 10  # SIGTERM ends the engine at once, not after Slurm's KillWait (30 s)
        while alive(victim.pid):
            assert time.monotonic() < deadline, "the engine of the cancelled job still runs after 10 s"
            time.sleep(0.1)
        wait_until_trained_by(run, 1, since=cancelled_at, timeout=120)
        print(f"the replacement trained {time.time() - cancelled_at:.1f}s after scancel")
        slow.unlink()
        run.wait(timeout=180, verbose=False)
        assert run.status == "finished" and run.error is None
        assert run.global_step == STEPS  # exactly the target
        assert list(events(run, "lost")["task"]) == ["worker:1"]
        assert list(events(run, "replaced")["task"]) == ["worker:1"]
        replacement = cluster.spec.task("worker", 1)
        assert replacement.pid != victim.pid and not alive(victim.pid) and run.local_steps[1] > 0
        new_job = cluster._engines.where()[replacement.engine_id]["job"]
        assert new_job not in jobs.values() and cancelled not in _queue() and new_job in _queue()
        print(f"trained {STEPS} steps, {time.monotonic() - started:.1f}s since the start")
    finally:
        pids = cluster.pids
        stopping = time.monotonic()
        cluster.stop()
        print(f"stopped in {time.monotonic() - stopping:.1f}s")
    assert _queue() == [], "stop() left jobs in the queue"
    assert not [p for p in pids + engine_pids if alive(p)]


def test_slurm_batch_script_carries_partition_account_time_and_extra_options(tmp_path):
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    launcher = Launcher("slurm", slurm_partition="gpu", account="proj42", time_limit="01:30:00", qos="normal",
                        sbatch_args=("--gres=gpu:4", "--mem=8G"))
    engines = SlurmEngineSetLauncher(work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="c1",
                                     **launcher.engine_options())
    engines.write_batch_script(1)  # one job per engine
    script = (tmp_path / engines.batch_file_name).read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj42", "#SBATCH --time=01:30:00",
                 "#SBATCH --qos=normal", "#SBATCH --gres=gpu:4", "#SBATCH --mem=8G", "#SBATCH --ntasks=1"):
        assert line in script.splitlines(), f"{line!r} missing from\n{script}"
    assert "srun" in script and "ipyparallel.engine" in script
    assert launcher.job_variable() == "SLURM_JOB_ID"
    # a size in sbatch_args: the first engines are one job of that size (a replacement, one job of one task)
    sized = Launcher("slurm", slurm_partition="gpu", sbatch_args=("--nodes=2",))
    engines = SlurmEngineSetLauncher(work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="c2",
                                     **sized.engine_options())
    engines.write_batch_script(5)
    lines = (tmp_path / engines.batch_file_name).read_text().splitlines()
    assert sized.together() and "#SBATCH --ntasks=5" in lines and "#SBATCH --nodes=2" in lines
