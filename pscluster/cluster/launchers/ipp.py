"""Any of ipyparallel's engine set launchers, by name or class: ``Launcher("pbs", queue="long")``.

Options other than the common ones (``interface``, ``ports``, ``ps_hosts``) are traits of ipyparallel's
launcher class (``queue``, ``batch_template``, ``namespace``...), checked against it; ``traits={...}`` gives
them as one dict. A batch system's launcher (a ``BatchSystemLauncher``: PBS, SGE, LSF, HTCondor, Slurm)
submits one job per engine, so that a lost engine is one job, cancelled or replaced alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from ...errors import ConfigError
from .base import ADAPTERS, Engines, Launcher, owner_of

if TYPE_CHECKING:
    from ...spec import TaskSpec

log = logging.getLogger("pscluster.engines")


def engine_class(cls: type[Launcher]):
    """The ipyparallel engine set launcher class behind ``cls`` (its ``ipp_class``: a class or a name)."""
    if isinstance(cls.ipp_class, str):
        from ipyparallel.cluster.launcher import find_launcher_class

        return find_launcher_class(cls.ipp_class, "engine")
    return cls.ipp_class


@dataclass(frozen=True)
class IPyParallelLauncher(Launcher):
    """Engines started by one of ipyparallel's engine set launchers (``ipp_class``), all ``n`` in one launch;
    ``traits``: its options. Engines on other hosts, watched through the controller's heartbeats."""

    traits: dict = field(default_factory=dict)

    @classmethod
    @lru_cache
    def for_class(cls, ipp_class) -> type["IPyParallelLauncher"]:
        """This launcher, running ipyparallel's ``ipp_class``."""
        return type(f"{cls.__name__}[{ipp_class.__name__}]", (cls,), {"ipp_class": ipp_class,
                                                                        "__module__": cls.__module__})

    @classmethod
    def from_options(cls, kind: str, options: dict) -> "Launcher":
        own = {f.name for f in fields(cls)} - {"kind", "traits"}
        traits = dict(options.get("traits") or {})
        configurable = set(engine_class(cls).class_trait_names(config=True))
        rest = {}
        for name, value in options.items():
            if name in configurable and name not in own:
                traits[name] = value
            elif name != "traits":
                rest[name] = value
        unknown = [t for t in traits if t not in configurable]
        if unknown:
            raise ConfigError(cls.misplaced(kind, unknown))
        made = super().from_options(kind, rest)
        object.__setattr__(made, "traits", traits)
        return made

    @classmethod
    def misplaced(cls, kind: str, names: list[str]) -> str:
        if any(owner_of(n) for n in names):
            return super().misplaced(kind, names)
        from ipyparallel.cluster.launcher import BaseLauncher

        ipp_class = engine_class(cls)
        some = sorted(set(ipp_class.class_trait_names(config=True)) - set(BaseLauncher.class_trait_names()))
        return (f"{names[0]!r} is not an option of a cluster, nor a trait of ipyparallel's {ipp_class.__name__} "
                f"(the {kind} launcher): check the spelling; its traits include {', '.join(some[:12])}")

    def cluster_options(self) -> dict:
        return {**super().cluster_options(), "engine_launcher_class": engine_class(type(self))}

    def engine_options(self, counts: dict[str, int] | None = None) -> dict:
        return dict(self.traits)

    def hint(self) -> str:
        return (f"check the engines of ipyparallel's {engine_class(type(self)).__name__} (their output is in the "
                f"ipython profile's log directory) and that they reach {self.controller_ip()}")

    def start(self, engines: Engines, n: int, num_ps: int, num_workers: int) -> None:
        engines.launch(n, **self.engine_options())

    def add(self, engines: Engines, task: "TaskSpec | None", live: Sequence["TaskSpec"]) -> None:
        engines.launch(1, **self.engine_options())


# A batch system's variable holding, on an engine, the id of the job it runs in (ipyparallel's launcher base
# class -> the variable); looked up by class, so that a subclass of one (a site's own) has it too.
def _job_variables() -> list[tuple[type, str]]:
    from ipyparallel.cluster import launcher as ipp

    return [(ipp.SGELauncher, "JOB_ID"), (ipp.PBSLauncher, "PBS_JOBID"), (ipp.LSFLauncher, "LSB_JOBID"),
            (ipp.SlurmLauncher, "SLURM_JOB_ID")]


@dataclass(frozen=True)
class BatchLauncher(IPyParallelLauncher):
    """Engines submitted as batch jobs, one job per engine: a lost engine is its job, cancelled (``kill``) or
    replaced (``add``) alone, and ``stop`` deletes every job still there. (Where ``together()``, the first
    engines are one job of as many tasks, as ipyparallel submits them; an engine that shares its job is then
    killed through its nanny, and a replacement is a job of its own.) The batch scripts go to the ipython
    profile's ``pscluster-jobs`` directory (not the working directory) and are removed with their jobs."""

    def job_variable(self) -> str | None:
        cls = engine_class(type(self))
        return next((name for base, name in _job_variables() if issubclass(cls, base)), None)

    def hint(self) -> str:
        return (f"check the engines' jobs in the queue: they may wait there (queue, account, time limit); "
                f"and that they reach {self.controller_ip()}")

    def together(self) -> bool:
        """Whether the first engines are one job (the options ask for a job of several tasks). Default: no."""
        return False

    def replacement_options(self) -> dict:
        """The engine launcher's options for a job of one more engine. Default: ``engine_options()``."""
        return self.engine_options()

    def _submit(self, engines: Engines, n: int, options: dict) -> str:
        set_id = engines.new_set_id()
        jobs = os.path.join(engines.cluster.profile_dir, "pscluster-jobs")
        os.makedirs(jobs, exist_ok=True)
        script = os.path.join(jobs, f"{engines.cluster_id}-{set_id}.sh")
        return engines.launch(n, set_id=set_id, batch_file_name=script, **options)

    def start(self, engines: Engines, n: int, num_ps: int, num_workers: int) -> None:
        for size in [n] if self.together() else [1] * n:
            self._submit(engines, size, self.engine_options())

    def add(self, engines: Engines, task: "TaskSpec | None", live: Sequence["TaskSpec"]) -> None:
        self._submit(engines, 1, self.replacement_options())

    def job_set(self, engines: Engines, engine_id: int) -> str | None:
        """The engine set (ipyparallel's, one job) the engine runs in, by the job id it reported; None when it
        runs in no job known, or shares its job with other engines in use."""
        info = engines.info.get(engine_id)
        job = info.job if info is not None else None
        if not job or sum(i.job == job for e, i in engines.info.items() if e in engines.engines) > 1:
            return None
        for set_id, launched in engines.cluster.engines.items():
            submitted = str(getattr(launched, "job_id", "") or "")
            if submitted and (submitted == job or submitted.split(".")[0] == job.split(".")[0]):
                return set_id
        return None

    def _end(self, engines: Engines, set_id: str) -> None:
        """Delete the job of engine set ``set_id`` (gone already is fine) and its batch script."""
        launched = engines.cluster.engines.get(set_id)
        if launched is None:
            return
        script = getattr(launched, "batch_file", None)
        try:
            engines.cluster.stop_engines_sync(set_id)
        except Exception as e:  # the job ended already, or the batch system refused: logged, stop goes on
            log.info("deleting job %s of engine set %s: %s", getattr(launched, "job_id", "?"), set_id, e)
            engines.cluster.engines.pop(set_id, None)
        if script and os.path.isfile(script) and os.path.dirname(script).endswith("pscluster-jobs"):
            os.remove(script)

    def kill(self, engines: Engines, engine_id: int) -> None:
        """Cancel the engine's job (the batch system kills its processes); by its nanny when it has none."""
        set_id = self.job_set(engines, engine_id)
        if set_id is None:
            super().kill(engines, engine_id)
        else:
            self._end(engines, set_id)

    def release(self, engines: Engines, engine_ids: list[int]) -> None:
        for engine_id in engine_ids:
            set_id = self.job_set(engines, engine_id)
            if set_id is not None:
                self._end(engines, set_id)

    def stop(self, engines: Engines) -> None:
        jobs = [str(getattr(s, "job_id", "") or "") for s in engines.cluster.engines.values()]
        for set_id in list(engines.cluster.engines):
            self._end(engines, set_id)
        self.drain([j for j in jobs if j])

    def drain(self, jobs: list[str]) -> None:
        """Wait (bounded) until the batch system no longer lists ``jobs``, deleted just now. Default: no wait
        (ipyparallel has no status command for batch systems); Slurm's asks squeue."""


def _adapt(cls) -> type[IPyParallelLauncher] | None:
    """The Launcher that runs ipyparallel's engine launcher ``cls`` (None: not one)."""
    from ipyparallel.cluster.launcher import BaseLauncher, BatchSystemLauncher

    if not (isinstance(cls, type) and issubclass(cls, BaseLauncher)):
        return None
    base = BatchLauncher if issubclass(cls, BatchSystemLauncher) else IPyParallelLauncher
    return base.for_class(cls)


ADAPTERS.append(_adapt)
