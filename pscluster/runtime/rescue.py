"""A lost ps costs a few steps, never the run: the newest state there is, committed as a checkpoint.

When a ps is lost, the checkpoint on disk may be old (by default one every 10 minutes) or missing, yet the
state of the run is still nearly all there:

- every surviving ps writes its shard when it is stopped (values and optimizer state, at its own step);
- every worker of the failed attempt leaves, on its way out, its copy of the dense variables it last pulled
  (``write_copy``: ``copies/worker-<i>.tensors`` in the checkpoint directory, and its receipt);
- every ps keeps, as often as a small share of its time allows, a copy of its optimizer state at its step
  (``write_state_copy``: ``copies/ps-<i>.tensors``; see ``run_state.RunState.keep_state_copy``): it outlives the
  ps's process, not its host.

``assemble`` commits the newest step for which every ps has a source of that same step (its own shard first:
it carries the optimizer state; else a worker's copy), when that is newer than the newest committed checkpoint:
every ps of the restarted run holds one step, never a mix. A ps rebuilt from a worker's copy takes its optimizer
state from its newest own state of the run (its state copy, or a shard it wrote: the stopped survivor's, a
checkpoint's), a few steps older than its values; the returned sources and the manifest's ``rescued`` entry say
from which step (``state_step``). Only a ps that left no state of the run restarts its optimizer state. A lost ps
that held a sparse variable cannot be rebuilt that way (a worker holds only the rows it touched): its only
sources are its own shards, so unless the others have sources of its newest one, nothing is assembled and every
ps rolls back to the latest committed checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import CheckpointError
from . import checkpoint
from .plan import VariableSpec

_RECEIPT = re.compile(r"^ps-(\d+)\.json$")


def copies_dir(directory) -> Path:
    return Path(directory) / "copies"


def write_state_copy(directory, ps: int, step: int, state: dict, shapes: dict[str, list[int]], *, run_id: int,
                     attempt: int) -> None:
    """Keep ps ``ps``'s optimizer state at its step ``step`` (``state``: a shard's ``name#slot`` entries, see
    ``checkpoint.shard_tensors``; its values are the workers' to keep), for variables of ``shapes`` (name: shape,
    every variable the ps holds), replacing its previous copy: not fsynced, as it need outlive the ps's process, not
    the host. OSError when it cannot be written."""
    folder = copies_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    size, sha = checkpoint.write_tensors(folder / f"ps-{ps}.tensors", state, fsync=False)
    checkpoint.write_json(folder / f"ps-{ps}.json", {"ps": ps, "step": step, "run_id": run_id, "attempt": attempt,
                                                     "bytes": size, "sha256": sha, "file": f"copies/ps-{ps}.tensors",
                                                     "shapes": shapes}, fsync=False)


def write_copy(directory, worker: int, step: int, values: dict[str, torch.Tensor], *, run_id: int,
               attempt: int) -> None:
    """Keep worker ``worker``'s copy of the variables (by variable name) it pulled at global step ``step``: not
    fsynced, as a state copy (it need outlive the worker's process, not the host), and so still in the page cache
    when a rescue reads it back a moment later."""
    folder = copies_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    size, sha = checkpoint.write_tensors(folder / f"worker-{worker}.tensors", values, fsync=False)
    checkpoint.write_json(folder / f"worker-{worker}.json", {"worker": worker, "step": step, "run_id": run_id,
                                                             "attempt": attempt, "bytes": size, "sha256": sha,
                                                             "variables": sorted(values)}, fsync=False)


@dataclass(frozen=True)
class Source:
    """Where one ps's part of an assembled checkpoint came from."""

    ps: int
    step: int
    origin: str  # "ps 0" (its own shard) or "worker 1" (a worker's copy)
    state_step: int | None  # the step of its optimizer state (its own shard's: ``step``); None: restarted

    @property
    def own(self) -> bool:
        return self.origin == f"ps {self.ps}"

    def to_dict(self) -> dict:
        return {"ps": self.ps, "step": self.step, "from": self.origin, "optimizer_state": self.state_step is not None,
                "optimizer_state_step": self.state_step}


@dataclass(frozen=True)
class Assembled:
    step: int
    path: Path
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class _Candidate:
    """A source of one ps's part at one step, not read yet: a file and the receipt it must match."""

    source: Source
    file: Path
    receipt: dict


def assemble(directory, *, num_ps: int, run_id: int, attempt: int, variables: list[VariableSpec], optimizer: str,
             optimizer_kwargs: dict, keep: int | None = None, state_keys=()) -> Assembled | None:
    """Commit the newest state of attempt ``attempt`` of run ``run_id`` that every ps has at one step (see the
    module docstring); None when there is none newer than the newest committed checkpoint."""
    directory = Path(directory)
    written = _own_shards(directory, run_id)  # every attempt's: a lost ps's optimizer state may be older
    shards = {ps: [r for r in receipts if r.get("attempt") == attempt] for ps, receipts in written.items()}
    copies = _worker_copies(directory, run_id, attempt)
    committed = checkpoint.committed_steps(directory)
    # ps -> step -> its sources of that step, best first
    candidates: dict[int, dict[int, list[_Candidate]]] = {}
    for ps in range(num_ps):
        held = {v.name for v in variables if v.ps == ps}
        by_step = candidates[ps] = {}
        for receipt in shards.get(ps, ()):  # its own shard before a copy: it carries the optimizer state
            by_step.setdefault(receipt["step"], []).append(
                _Candidate(Source(ps, receipt["step"], f"ps {ps}", receipt["step"]),
                           directory / str(receipt.get("file")), receipt))
        if not any(v.sparse for v in variables if v.ps == ps):
            for worker, (file, receipt) in sorted(copies.items()):
                if held <= set(receipt["variables"]):
                    by_step.setdefault(receipt["step"], []).append(
                        _Candidate(Source(ps, receipt["step"], f"worker {worker}", None), file, receipt))
    read: dict[Path, dict[str, torch.Tensor] | None] = {}  # each file's tensors, read back once (None: damaged)
    chosen = _newest_common(candidates, read, after=committed[-1] if committed else -1)
    if chosen is None:
        return None
    step = next(iter(chosen.values())).source.step
    folder = checkpoint.step_dir(directory, step)
    folder.mkdir(parents=True, exist_ok=True)
    found, sources = [], []
    for ps, candidate in chosen.items():
        if candidate.source.own:
            found.append(_place_shard(directory, candidate.receipt, step, attempt))
            sources.append(candidate.source)
            continue
        held = [v for v in variables if v.ps == ps]
        state_step, state = _newest_state(directory, run_id, ps, held, written.get(ps, ()))
        found.append(checkpoint.write_shard(directory, step, ps, {**{v.name: read[candidate.file][v.name]
                                                                     for v in held}, **state},
                                            run_id=run_id, attempt=attempt))
        sources.append(replace(candidate.source, state_step=state_step))
    sources = tuple(sources)
    path = checkpoint.commit(directory, step, run_id, variables, optimizer, optimizer_kwargs, found, keep=keep,
                             state_keys=state_keys, rescued=[s.to_dict() for s in sources])
    return Assembled(step=step, path=path, sources=sources)


def _newest_common(candidates: dict[int, dict[int, list[_Candidate]]], read: dict,
                   after: int) -> dict[int, _Candidate] | None:
    """Each ps's best source at the newest step past ``after`` at which every ps has one, or None. A source's
    file is read back and checked (size, SHA-256) before it is taken, once however many ps it serves (into
    ``read``, by file): a damaged one is never a source (that ps's next source of the step is tried, or the step
    given up)."""
    while True:
        common = set.intersection(*(set(by_step) for by_step in candidates.values())) if candidates else set()
        newer = [s for s in common if s > after]
        if not newer:
            return None
        step = max(newer)
        for best in (by_step[step][0] for by_step in candidates.values()):
            if best.file not in read:
                read[best.file] = _read_back(best.file, best.receipt)
        damaged = [ps for ps, by_step in candidates.items() if read[by_step[step][0].file] is None]
        if not damaged:
            return {ps: by_step[step][0] for ps, by_step in candidates.items()}
        for ps in damaged:
            del candidates[ps][step][0]
            if not candidates[ps][step]:
                del candidates[ps][step]


def _newest_state(directory: Path, run_id: int, ps: int, held,
                  shards) -> tuple[int | None, dict[str, torch.Tensor]]:
    """(its step, the optimizer state entries of ``held``, ps ``ps``'s variables, by shard key) of the newest
    intact state ps ``ps`` left of run ``run_id``, in any attempt: its state copy or a shard it wrote (``shards``:
    their receipts); (None, {}) when it left none that fits its variables."""
    receipts = list(shards)
    try:
        copy = json.loads((copies_dir(directory) / f"ps-{ps}.json").read_text())
        if copy.get("run_id") == run_id and isinstance(copy.get("step"), int):
            receipts.append(copy)
    except (OSError, ValueError):
        pass
    shapes = {v.name: tuple(v.shape) for v in held}
    for receipt in sorted(receipts, key=lambda r: r["step"], reverse=True):
        tensors = _read_back(directory / str(receipt.get("file")), receipt)
        if tensors is None:
            continue
        saved = receipt.get("shapes") or {name: t.shape for name, t in tensors.items() if "#" not in name}
        if any(tuple(saved.get(name, ())) != shape for name, shape in shapes.items()):
            continue  # another placement's
        return receipt["step"], {key: t for key, t in tensors.items()
                                 if "#" in key and key.partition("#")[0] in shapes}
    return None, {}


def _own_shards(directory: Path, run_id: int) -> dict[int, list[dict]]:
    """Each ps's shard receipts written in any attempt of run ``run_id`` (committed or not; not yet read back, see
    ``_newest_common``)."""
    written: dict[int, list[dict]] = {}
    for entry in directory.iterdir() if directory.is_dir() else ():
        if not (entry.is_dir() and re.fullmatch(r"step-\d{9}", entry.name)):
            continue
        for receipt_path in entry.iterdir():
            if not _RECEIPT.match(receipt_path.name):
                continue
            try:
                receipt = json.loads(receipt_path.read_text())
            except (OSError, ValueError):
                continue
            if receipt.get("run_id") == run_id and isinstance(receipt.get("step"), int):
                written.setdefault(receipt.get("ps"), []).append(receipt)
    return written


def _read_back(file: Path, receipt: dict) -> dict[str, torch.Tensor] | None:
    """The tensors of ``file`` when it holds what its receipt says was written (its size and SHA-256), else None."""
    try:
        return checkpoint.read_tensors(file, receipt)
    except (CheckpointError, KeyError, TypeError):
        return None


def _worker_copies(directory: Path, run_id: int, attempt: int) -> dict[int, tuple[Path, dict]]:
    """The workers' copies of ``attempt`` of run ``run_id`` (not yet read back, see ``_newest_common``): worker ->
    (its file, its receipt)."""
    copies = {}
    folder = copies_dir(directory)
    for receipt_path in sorted(folder.glob("worker-*.json")) if folder.is_dir() else ():
        try:
            receipt = json.loads(receipt_path.read_text())
            if (receipt.get("run_id") == run_id and receipt.get("attempt") == attempt
                    and isinstance(receipt.get("step"), int) and isinstance(receipt.get("variables"), list)):
                copies[int(receipt["worker"])] = (receipt_path.with_suffix(".tensors"), receipt)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return copies


def _place_shard(directory: Path, receipt: dict, step: int, attempt: int) -> dict:
    """A ps's own shard (written at its step) as its shard of ``step``: linked (or copied) into that step's
    folder with a receipt of its own."""
    if receipt["step"] == step:
        return receipt
    source = directory / receipt["file"]
    target = checkpoint.step_dir(directory, step) / f"ps-{receipt['ps']}.tensors"
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copyfile(source, target)
    placed = {**receipt, "step": step, "attempt": attempt, "file": f"{target.parent.name}/{target.name}",
              "schedule": {}}  # the schedule is fast-forwarded to the checkpoint's step
    checkpoint.write_json(target.with_name(f"ps-{receipt['ps']}.json"), placed, fsync=False)
    return placed
