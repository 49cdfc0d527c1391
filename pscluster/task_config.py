"""Which cluster this process belongs to, and as which task: from ``PSCLUSTER_CONFIG``, else from TensorFlow's
``TF_CONFIG`` (see ``from_environment``).

``PSCLUSTER_CONFIG`` is ``{"cluster": <ClusterSpec.to_dict()>, "task": {"type", "index"}}``, as
``ClusterSpec.config_for`` writes it. ``TF_CONFIG`` is read as TF writes it:

    TF_CONFIG='{"cluster": {"ps": ["host:2221"], "chief": ["host:2222"], "worker": ["host:2223", "host:2224"]},
                "task": {"type": "worker", "index": 1}}'

- ``ps``: the ps tasks, in order; each serves its data plane on its ``host:port`` (so list each by an address
  of its machine that the workers reach).
- ``chief``: a task of its own, as in TF's parameter-server strategy: it trains and does the chief's duties
  (initializes or restores the variables, writes the checkpoints). pscluster numbers it worker 0 and TF's
  ``worker`` i worker i + 1. Without a ``chief``, TF's worker 0 is the chief, as in TF 1.x.
- The chief's port is where it receives every task's metric events (it runs the run's supervisor); the other
  workers' ports are not used: nothing connects to them.
- ``evaluator`` (TF's ``train_and_evaluate`` side task, at most one): it evaluates each checkpoint the run
  commits on the test dataset while training goes on, into the run store and TensorBoard; the chief then
  leaves evaluation to it. Its port is not used.

TF_CONFIG carries no secret: every data-plane message is signed with the key in ``PSCLUSTER_SECRET`` (hex, at
least 16 bytes) or in the file ``PSCLUSTER_SECRET_FILE`` names, the same in every task's environment.
"""

from __future__ import annotations

import json

from . import environ
from .errors import ConfigError
from .spec import ClusterSpec, TaskSpec

JOBS = ("ps", "chief", "worker", "evaluator")
MIN_SECRET_BYTES = 16
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(16))'"


def from_environment() -> tuple[ClusterSpec, TaskSpec]:
    """The cluster and this process's task, from ``PSCLUSTER_CONFIG``, else from ``TF_CONFIG``."""
    raw = environ.config_json()
    if raw is None and environ.tf_config_json() is not None:
        return cluster_from_tf_config(environ.tf_config_json())
    if raw is None:
        raise ConfigError(f"neither {environ.CONFIG} nor {environ.TF_CONFIG} is set: export one, e.g. "
                          f"{environ.CONFIG} from ClusterSpec.config_for(role, index)")
    try:
        d = json.loads(raw)
        spec = ClusterSpec.from_dict(d["cluster"])
        return spec, spec.task(d["task"]["type"], int(d["task"]["index"]))
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{environ.CONFIG} is not valid: expected "
                          '{"cluster": {...}, "task": {"type": ..., "index": ...}}') from None


def cluster_from_tf_config(text: str) -> tuple[ClusterSpec, TaskSpec]:
    """The cluster ``TF_CONFIG`` (``text``) describes, and this process's task in it."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{environ.TF_CONFIG} does not parse as JSON ({e.msg} at column {e.colno}): "
                          'write it as {"cluster": {"ps": [...], "worker": [...]}, "task": {...}}') from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ConfigError(f"{environ.TF_CONFIG} has no \"cluster\": write it as "
                          '{"cluster": {"ps": ["host:port"], "worker": ["host:port"]}, "task": {...}}')
    cluster = config["cluster"]
    unknown = sorted(set(cluster) - set(JOBS))
    if unknown:
        raise ConfigError(f"{environ.TF_CONFIG} names the job {unknown[0]!r}: pscluster's jobs are "
                          f"{', '.join(JOBS)}")
    addresses = {job: _addresses(job, cluster.get(job, [])) for job in JOBS}
    for job in ("chief", "evaluator"):
        if len(addresses[job]) > 1:
            raise ConfigError(f"{environ.TF_CONFIG} lists {len(addresses[job])} {job} tasks: a cluster has one")
    if not addresses["ps"]:
        raise ConfigError(f"{environ.TF_CONFIG} lists no ps task: add \"ps\": [\"host:port\"] to its cluster")
    if not addresses["chief"] and not addresses["worker"]:
        raise ConfigError(f"{environ.TF_CONFIG} lists no chief and no worker: add \"chief\": [\"host:port\"]")
    ps = tuple(TaskSpec("ps", i, host=host, port=port) for i, (host, port) in enumerate(addresses["ps"]))
    workers = tuple(TaskSpec("worker", i, host=host, port=port if i == 0 else 0)
                    for i, (host, port) in enumerate(addresses["chief"] + addresses["worker"]))
    evaluator = TaskSpec("evaluator", 0, host=addresses["evaluator"][0][0]) if addresses["evaluator"] else None
    spec = ClusterSpec(ps=ps, workers=workers, secret=_secret(), name="tf_config", evaluator=evaluator)
    return spec, _task(spec, config.get("task"), has_chief=bool(addresses["chief"]))


def _addresses(job: str, listed) -> list[tuple[str, int]]:
    if isinstance(listed, str) or not isinstance(listed, list):
        raise ConfigError(f"{environ.TF_CONFIG}: the {job} job must be a list of \"host:port\", e.g. "
                          f"[\"localhost:2222\"], not {listed!r}")
    found = []
    for address in listed:
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{environ.TF_CONFIG}: {job} address {address!r} is not host:port, e.g. "
                              "localhost:2222")
        found.append((host.strip("[]"), int(port)))
    return found


def _task(spec: ClusterSpec, task, *, has_chief: bool) -> TaskSpec:
    if not isinstance(task, dict) or task.get("type") not in JOBS:
        raise ConfigError(f"{environ.TF_CONFIG}'s task must name this process's job and index, e.g. "
                          f"\"task\": {{\"type\": \"worker\", \"index\": 0}} (type: one of {', '.join(JOBS)})")
    job, index = task["type"], task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError(f"{environ.TF_CONFIG}'s task index {index!r}: give an integer >= 0")
    if job in ("chief", "evaluator"):
        listed = has_chief if job == "chief" else spec.evaluator is not None
        if not listed or index != 0:
            raise ConfigError(f"{environ.TF_CONFIG}'s task is {job} {index}, and its cluster lists "
                              f"{f'one {job} (index 0)' if listed else f'no {job}'}: add \"{job}\": "
                              "[\"host:port\"] to the cluster" + (", or make this task a worker" * (job == "chief")))
        return spec.chief if job == "chief" else spec.evaluator
    count = len(spec.ps) if job == "ps" else len(spec.workers) - has_chief
    if index >= count:
        raise ConfigError(f"{environ.TF_CONFIG}'s task is {job} {index}, and its cluster lists {count} {job} "
                          "task(s): the index counts from 0 within its job")
    return spec.ps[index] if job == "ps" else spec.workers[index + has_chief]


def _secret() -> str:
    try:
        found = environ.secret()
    except OSError as e:
        raise ConfigError(f"cannot read {environ.SECRET_FILE} ({e.strerror}: {e.filename}): point it at a file "
                          "holding the cluster's secret") from None
    if found is None:
        raise ConfigError(f"a cluster from {environ.TF_CONFIG} needs its data-plane key: export "
                          f"{environ.SECRET}=\"$({MAKE_SECRET})\" (the same in every task), or "
                          f"{environ.SECRET_FILE}=<a file holding it>")
    where, value = found
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where} is not a key of {MIN_SECRET_BYTES} or more bytes in hex: make one with "
                          f"{MAKE_SECRET}")
    return value.lower()
