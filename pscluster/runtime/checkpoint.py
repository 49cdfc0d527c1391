"""Sharded checkpoints: every ps writes its own shard, a manifest written last commits them.

Layout of a checkpoint directory::

    step-000000200/ps-0.tensors     ps 0's variables and their optimizer state at global step 200
    step-000000200/ps-0.json        the shard's receipt: step, size and SHA-256 (written after the shard)
    step-000000200.manifest.json    the commit: format version, step, placement, shapes, dtypes, checksums

Every file is written to a temporary name and renamed, so readers see a whole file or none. A shard is
fsynced before its receipt exists; the receipt is not (lost or empty after a crash, it only leaves its step
uncommitted); the commit fsyncs the step folder (the renames of shards and receipts), then writes the
manifest fsynced and renames it: that rename is the commit, so a process killed while writing leaves no
manifest that restore accepts, and restore checks every shard's size and SHA-256 anyway. Large files are
written with O_DIRECT (no page cache to fill and flush) while another thread computes their SHA-256.

Tensor files are a JSON header and raw bytes (no pickle): an 8-byte little-endian header length, the
header ``{"tensors": [{"key", "dtype", "shape", "offset", "nbytes"}]}``, then the data. A shard holds, per
variable, its value under the variable's name and each optimizer slot under ``name#slot`` (``name#slot:int``
/ ``:float`` for the plain numbers some optimizers keep, such as SparseAdam's step count).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError
from .plan import VariableSpec, state_dict_of

FORMAT_VERSION = 1
_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 64 << 20
_MANIFEST = re.compile(r"^step-(\d{9})\.manifest\.json$")
# the temporary file of a shard being written, beside its step's folder (``_write_file``): step, ps
SHARD_BEING_WRITTEN = re.compile(r"\.step-(\d{9})-ps-(\d+)\.tensors\.\d+\.tmp")
_DIRECT_MIN = 1 << 20  # smaller files go through the page cache
_DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT write, a multiple of any file system's block size
_DIRECT_ALIGN = 4096  # what O_DIRECT asks of offsets and lengths on common file systems


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:09d}"


def manifest_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:09d}.manifest.json"


# --- files ---------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(views) -> str:
    digest = hashlib.sha256()
    for view in views:
        digest.update(view)  # releases the GIL: runs beside the writes
    return digest.hexdigest()


_buffers: list[mmap.mmap] = []
_buffers_lock = threading.Lock()


@contextmanager
def _aligned_buffer():
    """A page-aligned buffer of ``_DIRECT_CHUNK`` bytes, kept for the next write: its pages are mapped
    once, not on every checkpoint."""
    with _buffers_lock:
        buf = _buffers.pop() if _buffers else mmap.mmap(-1, _DIRECT_CHUNK)
    try:
        yield buf
    finally:
        with _buffers_lock:
            _buffers.append(buf)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _write_direct(tmp: Path, views: list[memoryview], size: int, place) -> bool:
    """Write ``views`` to ``tmp`` with O_DIRECT through an aligned buffer, fsync, then ``place()`` it while it is
    still open; False (nothing to keep written) where the system or the file system has no O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        with _aligned_buffer() as buf, memoryview(buf) as out:
            filled = 0
            for view in views:
                while view:
                    n = min(len(out) - filled, len(view))
                    out[filled:filled + n] = view[:n]
                    filled, view = filled + n, view[n:]
                    if filled == len(out):
                        _write_all(fd, out)
                        filled = 0
            if filled:  # the tail, padded to a whole block, then cut back to the file's size
                padded = -(-filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
                out[filled:padded] = bytes(padded - filled)
                _write_all(fd, out[:padded])
                os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:  # a file system that opens with O_DIRECT but refuses its writes
            return False
        raise
    else:
        place()
        return True
    finally:
        os.close(fd)


def _write_file(path: Path, pieces, *, fsync: bool = True, new_folder: bool = False) -> tuple[int, str]:
    """Write ``pieces`` (bytes-like) to ``path`` through a temporary file renamed while still open; with
    ``fsync``, the data is on disk before the rename (the folder is not fsynced: the commit does that). With
    ``new_folder``, ``path``'s folder is made only then (the temporary file is written beside it): the folder never
    exists without its file, even where the file system turns read-only meanwhile (it cannot while a file on it
    is open for writing), which would leave it empty for good. Returns (size, SHA-256 hex)."""
    views = [memoryview(p).cast("B") for p in pieces]
    size = sum(len(v) for v in views)
    tmp = (path.parent.parent / f".{path.parent.name}-{path.name}.{os.getpid()}.tmp" if new_folder else
           path.with_name(f".{path.name}.{os.getpid()}.tmp"))

    def place() -> None:
        if new_folder:
            path.parent.mkdir(exist_ok=True)
        os.replace(tmp, path)

    with ThreadPoolExecutor(1) as hashing:
        sha = hashing.submit(_sha256, views)
        try:
            if not (fsync and size >= _DIRECT_MIN and _write_direct(tmp, views, size, place)):
                with open(tmp, "wb") as f:
                    for view in views:
                        f.write(view)
                    f.flush()
                    if fsync:
                        os.fsync(f.fileno())
                    place()
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.filename is None:  # a write or close that failed (a full disk) says which file: this one
                raise OSError(e.errno, e.strerror, str(path)) from e
            raise
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return size, sha.result()


def write_json(path: Path, obj, *, fsync: bool = True) -> None:
    _write_file(path, [json.dumps(obj, indent=1).encode()], fsync=fsync)


@dataclass(frozen=True)
class Pieces:
    """A tensor of ``shape`` given as the consecutive flat ``pieces`` it is made of (the optimizer state of a
    variable a ps steps in chunks): ``write_tensors`` writes it as one tensor without putting it together."""

    pieces: tuple
    shape: tuple


def write_tensors(path: Path, tensors: dict[str, torch.Tensor | Pieces], *, fsync: bool = True,
                  new_folder: bool = False) -> tuple[int, str]:
    """Write ``tensors`` to ``path`` (atomically; fsynced unless told not to; ``new_folder``: see ``_write_file``);
    returns (size, SHA-256 hex)."""
    entries, datas, offset = [], [], 0
    for key, t in tensors.items():
        pieces = [p.detach().cpu().contiguous() for p in (t.pieces if isinstance(t, Pieces) else (t,))]
        nbytes = sum(p.numel() * p.element_size() for p in pieces)
        entries.append({"key": key, "dtype": str(pieces[0].dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes})
        datas += [p.reshape(-1).view(torch.uint8).numpy() for p in pieces if p.numel()]
        offset += nbytes
    header = json.dumps({"tensors": entries}).encode()
    return _write_file(Path(path), [_LENGTH.pack(len(header)), header, *datas], fsync=fsync, new_folder=new_folder)


def read_tensors(path: Path, receipt: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a file written by ``write_tensors``, read once into one buffer they all view (no copy);
    with ``receipt`` (its ``bytes`` and ``sha256``) checked against it first. CheckpointError naming the file
    when it is missing, not one (truncated, or a header that does not fit the file), or not what ``receipt``
    says."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            raw = bytearray(os.fstat(f.fileno()).st_size)
            with memoryview(raw) as view:
                filled = 0
                while filled < len(raw) and (n := f.readinto(view[filled:])):
                    filled += n
            del raw[filled:]  # a file that shrank meanwhile
    except OSError as e:
        raise CheckpointError(f"{path} could not be read ({e.strerror}): restore from another checkpoint") from None
    if receipt is not None:
        if len(raw) != receipt["bytes"]:
            raise CheckpointError(f"{path} has {len(raw)} bytes, {receipt['bytes']} were written: it is truncated "
                                  "or damaged")
        if hashlib.sha256(raw).hexdigest() != receipt["sha256"]:
            raise CheckpointError(f"{path} fails its SHA-256 checksum: it is damaged")
    try:
        (length,) = _LENGTH.unpack_from(raw)
        if length > min(_MAX_HEADER, len(raw) - _LENGTH.size):
            raise ValueError("header longer than the file")
        header = json.loads(raw[_LENGTH.size:_LENGTH.size + length])
        base = _LENGTH.size + length
        out = {}
        for e in header["tensors"]:
            dtype = getattr(torch, e["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"not a dtype: {e['dtype']}")
            shape = tuple(int(d) for d in e["shape"])
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            start = base + int(e["offset"])
            if nbytes != e["nbytes"] or start < base or start + nbytes > len(raw):
                raise ValueError(f"tensor {e['key']} outside the file")
            out[e["key"]] = (torch.frombuffer(raw, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape)
                             if nbytes else torch.empty(shape, dtype=dtype))
        return out
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise CheckpointError(f"{path} is not a readable tensor file ({e}): it is damaged, "
                              "restore from another checkpoint") from None


# --- what a ps writes ----------------------------------------------------------------------------
def encode_state(state: dict) -> dict[str, torch.Tensor]:
    """A torch optimizer's per-parameter state as tensors by slot key (``slot``, or ``slot:int`` /
    ``slot:float`` for a plain number), for a shard file or an INIT message (``Pieces`` as they are: a shard
    file's)."""
    out = {}
    for slot, value in state.items():
        if isinstance(value, torch.Tensor):
            out[slot] = value.detach()
        elif isinstance(value, Pieces):
            out[slot] = value
        elif isinstance(value, bool | int | float):
            kind = "float" if isinstance(value, float) else "int"
            out[f"{slot}:{kind}"] = torch.tensor(value, dtype=torch.float64 if kind == "float" else torch.int64)
    return out


def decode_state(entries: dict[str, torch.Tensor]) -> dict:
    """The inverse of ``encode_state`` (tensors copied: they may be views of a received message)."""
    state = {}
    for key, t in entries.items():
        slot, _, kind = key.partition(":")
        state[slot] = t.clone() if not kind else (t.item() if kind == "float" else int(t.item()))
    return state


def shard_tensors(names: list[str], params: list[torch.Tensor], states: list[dict]) -> dict[str, torch.Tensor]:
    """The tensors of one ps's shard: each variable's value under its name, and its optimizer state
    (``states[i]``, the torch optimizer's per-parameter state) under ``name#slot``."""
    out = {}
    for name, param, state in zip(names, params, states):
        out[name] = param.detach()
        out.update({f"{name}#{key}": t for key, t in encode_state(state).items()})
    return out


def split_state(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(values by variable name, optimizer state by variable name) of a shard's tensors."""
    values, entries = {}, {}
    for key, t in tensors.items():
        name, sep, slot = key.partition("#")
        if sep:
            entries.setdefault(name, {})[slot] = t
        else:
            values[name] = t
    return values, {name: decode_state(e) for name, e in entries.items()}


def non_finite(tensors: dict[str, torch.Tensor | Pieces]) -> str | None:
    """The key of the first floating-point tensor of ``tensors`` that holds a NaN or an infinity, or None."""
    for key, t in tensors.items():
        for piece in t.pieces if isinstance(t, Pieces) else (t,):
            if piece.is_floating_point() and not torch.isfinite(piece).all():
                return key
    return None


def write_shard(directory, step: int, ps: int, tensors: dict[str, torch.Tensor], *, run_id: int,
                attempt: int = 0, schedule: dict | None = None) -> dict:
    """Write ps ``ps``'s shard of step ``step`` and then its receipt; returns the receipt. ``attempt``
    counts the restarts of the run (after a ps was lost): only receipts of one attempt form a checkpoint.
    ``schedule``: the learning-rate schedule's state (JSON, the same on every ps; see ``optim``).
    CheckpointError, nothing written, when a value or an optimizer slot is not finite: no checkpoint ever holds
    a diverged state."""
    bad = non_finite(tensors)
    if bad is not None:
        raise CheckpointError(f"ps {ps}'s shard of step {step} was not written: {bad} holds NaN or infinite values "
                              "(the run diverged: lower the learning rate, or clip with max_grad_norm=...)")
    folder = step_dir(directory, step)
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        size, sha = write_tensors(folder / f"ps-{ps}.tensors", tensors, new_folder=True)
        receipt = {"ps": ps, "step": step, "run_id": run_id, "attempt": attempt,
                   "file": f"{folder.name}/ps-{ps}.tensors", "bytes": size, "sha256": sha, "schedule": schedule or {}}
        write_json(folder / f"ps-{ps}.json", receipt, fsync=False)  # the commit fsyncs the folder
    except OSError as e:  # a full disk, a folder turned read-only or removed: no part of this shard is left
        (folder / f"ps-{ps}.tensors").unlink(missing_ok=True)
        with suppress(OSError):
            folder.rmdir()  # unless another ps's shard of the step is there
        raise CheckpointError(f"ps {ps}'s shard of step {step} could not be written to {folder}: "
                              f"{errno.errorcode.get(e.errno, e.errno)} {e.strerror}") from e
    return receipt


# --- the commit ----------------------------------------------------------------------------------
def receipts(directory, step: int, num_ps: int, *, attempt: int = 0) -> list[dict] | None:
    """The receipts of every ps for ``step`` written in ``attempt``, or None while some are missing."""
    folder = step_dir(directory, step)
    found = []
    for ps in range(num_ps):
        try:
            receipt = json.loads((folder / f"ps-{ps}.json").read_text())
        except (OSError, ValueError):
            return None
        if receipt.get("step") != step or receipt.get("attempt") != attempt:
            return None
        found.append(receipt)
    return found


def uncommitted_steps(directory) -> list[int]:
    """Steps that have a shard folder but no manifest yet, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        m = re.fullmatch(r"step-(\d{9})", entry.name)
        if m and entry.is_dir() and not manifest_path(directory, int(m.group(1))).exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def commit(directory, step: int, run_id: int, variables, optimizer: str, optimizer_kwargs: dict,
           shard_receipts: list[dict], *, keep: int | None = None, state_keys=(), rescued=None) -> Path:
    """Write the manifest of ``step`` (the commit), then delete all but the newest ``keep`` checkpoints.
    ``state_keys``: the model's state_dict keys and the variable each holds (``plan.model_tensors``);
    ``rescued``: where each shard came from, for a checkpoint assembled after a lost ps (``rescue``)."""
    directory = Path(directory)
    manifest = {"format_version": FORMAT_VERSION, "run_id": run_id, "step": step, "time": time.time(),
                "optimizer": optimizer, "optimizer_kwargs": optimizer_kwargs,
                "variables": [{"id": v.id, "name": v.name, "variable": v.parameter, "shape": list(v.shape),
                               "dtype": v.dtype, "ps": v.ps, "start": v.start, "sparse": v.sparse, "kind": v.kind}
                              for v in variables],
                "state_keys": [list(k) for k in state_keys],
                "schedule": min(shard_receipts, key=lambda r: r["ps"]).get("schedule", {}),
                "shards": [{"ps": r["ps"], "file": r["file"], "bytes": r["bytes"], "sha256": r["sha256"]}
                           for r in sorted(shard_receipts, key=lambda r: r["ps"])]}
    if rescued:
        manifest["rescued"] = rescued
    path = manifest_path(directory, step)
    _fsync_dir(step_dir(directory, step))  # the shards' and receipts' renames, on disk before the commit
    write_json(path, manifest)
    _fsync_dir(directory)
    if keep is not None:
        prune(directory, keep)
    return path


def commit_ready(directory, *, num_ps: int, run_id: int, attempt: int, variables, optimizer: str,
                 optimizer_kwargs: dict, keep: int | None = None, state_keys=()) -> dict[int, Path]:
    """Commit every step whose shards all ``num_ps`` ps tasks have written in ``attempt`` of run
    ``run_id``; the manifests written by step, oldest first."""
    written = {}
    for step in uncommitted_steps(directory):
        found = receipts(directory, step, num_ps, attempt=attempt)
        if found is not None and all(r.get("run_id") == run_id for r in found):
            written[step] = commit(directory, step, run_id, variables, optimizer, optimizer_kwargs, found, keep=keep,
                                   state_keys=state_keys)
    return written


def prune(directory, keep: int) -> None:
    """Delete all but the newest ``keep`` committed checkpoints (manifest first: a half-deleted one is
    never taken for a checkpoint), and the shard folders of older uncommitted steps and the temporary shard files
    of older steps (a ps killed while writing leaves one, see ``_write_file``). A folder holds one line of
    training (a run and those that restore from it: a run from scratch sets the earlier one aside, see
    ``set_aside``), so its newest steps are the writing run's own."""
    steps = committed_steps(directory)
    for step in steps[:-keep] if keep > 0 else steps:
        manifest_path(directory, step).unlink(missing_ok=True)
        shutil.rmtree(step_dir(directory, step), ignore_errors=True)
    if steps:
        for step in uncommitted_steps(directory):
            if step < steps[-1]:
                shutil.rmtree(step_dir(directory, step), ignore_errors=True)
        for entry in os.scandir(directory):
            written = SHARD_BEING_WRITTEN.fullmatch(entry.name)
            if written and int(written.group(1)) < steps[-1]:
                Path(entry.path).unlink(missing_ok=True)


def set_aside(directory, into_name: str) -> Path | None:
    """Move pscluster's own entries at the top of ``directory`` (step folders, their manifests, refused ones too,
    and the ``copies`` folder of ``rescue``) into a new subfolder ``into_name``, or ``<into_name>.2``... where that
    exists (one set aside earlier is never written into), with renames; the subfolder, or None when there was
    nothing to move. Nothing else of ``directory`` is touched. The checkpoints are whole in the subfolder (they
    restore from there) and out of the way of a run from scratch in ``directory``: ``committed_steps`` and
    ``uncommitted_steps`` list the top only. Each step's manifest leaves before its folder, so a process killed
    while moving leaves no manifest in ``directory`` whose shards are gone (at most one step split: its folder
    there, uncommitted, and its manifest in the subfolder, refused by a restore from it)."""
    directory = Path(directory)
    own = []  # (step, whether a folder, name): each step's manifests before its folder, the copies last
    for entry in os.scandir(directory) if directory.is_dir() else ():
        m = re.fullmatch(r"step-(\d{9})(\.manifest\.json(\.refused)?)?", entry.name)
        if m and bool(m.group(2)) != entry.is_dir():
            own.append((int(m.group(1)), entry.is_dir(), entry.name))
        elif entry.name == "copies" and entry.is_dir():
            own.append((math.inf, True, entry.name))
    if not own:
        return None
    into, k = directory / into_name, 2
    while into.exists():
        into, k = directory / f"{into_name}.{k}", k + 1
    into.mkdir()
    for *_, name in sorted(own):
        os.rename(directory / name, into / name)
    _fsync_dir(into)
    _fsync_dir(directory)
    return into


def committed_steps(directory) -> list[int]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for m in map(_MANIFEST.match, os.listdir(directory)) if m)


# --- restore -------------------------------------------------------------------------------------
def _manifest_variables(manifest: dict) -> tuple[VariableSpec, ...]:
    return tuple(VariableSpec(id=v["id"], name=v["name"], shape=tuple(v["shape"]), dtype=v["dtype"], ps=v["ps"],
                              variable="" if v["variable"] == v["name"] else v["variable"], start=v["start"],
                              sparse=v["sparse"], kind=v.get("kind", "param"))
                 for v in manifest["variables"])


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its manifest, read and checked against its shard files."""

    path: Path
    step: int
    run_id: int
    variables: tuple[VariableSpec, ...]
    shards: tuple[dict, ...]
    optimizer: str
    optimizer_kwargs: dict
    state_keys: tuple[tuple[str, str], ...] = ()
    schedule: dict = field(default_factory=dict)  # the learning-rate schedule's state at this step
    _read_back: dict = field(default_factory=dict, repr=False, compare=False)  # shard file -> its checked tensors

    @classmethod
    def load(cls, path) -> "Checkpoint":
        """The checkpoint of manifest ``path``, each shard read back and checked (``_read``), and kept for
        ``tensors``: a restore reads every shard once. CheckpointError naming the file that is missing, of the
        wrong size, with a bad checksum or with a value that is not finite."""
        path = Path(path)
        try:
            m = json.loads(path.read_text())
            if m.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format version {m.get('format_version')}, this pscluster reads {FORMAT_VERSION}")
            variables = _manifest_variables(m)
            ckpt = cls(path=path, step=int(m["step"]), run_id=int(m["run_id"]), variables=variables,
                       shards=tuple(m["shards"]), optimizer=m["optimizer"],
                       optimizer_kwargs=m.get("optimizer_kwargs") or {},
                       state_keys=tuple((str(k), str(n)) for k, n in m.get("state_keys", [])),
                       schedule=m.get("schedule") or {})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is not a readable manifest ({e})") from None
        for shard in ckpt.shards:
            ckpt._read_back[shard["file"]] = ckpt._read(shard)
        return ckpt

    def _read(self, shard: dict) -> dict[str, torch.Tensor]:
        """The tensors of ``shard``, checked: there, of its manifest's size and SHA-256, every value finite (a
        checkpoint written before diverged states were refused, see ``write_shard``, holds none)."""
        file = self.path.parent / shard["file"]
        if not file.exists():
            raise CheckpointError(f"{file} is missing: checkpoint of step {self.step} is incomplete")
        tensors = read_tensors(file, shard)
        bad = non_finite(tensors)
        if bad is not None:
            raise CheckpointError(f"checkpoint of step {self.step} holds NaN or infinite values ({bad} in "
                                  f"{shard['file']}): a diverged state is never restored")
        return tensors

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(whole parameters by parameter name, optimizer state by parameter name), views of the buffers the
        shard files were read into where a parameter is whole in one shard (not to be written to): the shards of a
        partitioned parameter joined in row order, per-row optimizer slots likewise; other slots (step
        counts) are those of the first shard. A parameter some of whose parts carry no optimizer state (a
        rescued checkpoint's, see ``rescue``) has none: it restarts from a fresh state."""
        values, states = {}, {}
        for shard in self.shards:
            v, s = split_state(self._read_back[shard["file"]])
            values.update(v)
            states.update(s)
        params, slots = {}, {}
        for parameter in dict.fromkeys(v.parameter for v in self.variables):
            parts = sorted((v for v in self.variables if v.parameter == parameter), key=lambda v: v.start)
            params[parameter] = _join([values[v.name] for v in parts])
            per_slot: dict[str, list] = {}
            for v in parts if all(states.get(v.name) for v in parts) else ():
                for slot, value in states.get(v.name, {}).items():
                    per_slot.setdefault(slot, []).append(value)
            slots[parameter] = {slot: _join(vs) if all(_per_row(t, v.shape) for t, v in zip(vs, parts)) else vs[0]
                                for slot, vs in per_slot.items()}
        return params, slots

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state at this checkpoint, as ``model.state_dict()`` holds it: parameters, buffers, every
        key of a tied parameter, in the model's order; each its own copy (``tensors`` gives views of the shard files'
        buffers, which ``torch.save`` would write whole)."""
        return state_dict_of(self.state_keys, {name: t.clone() for name, t in self.tensors()[0].items()})


def _per_row(slot, shape) -> bool:
    """Whether an optimizer slot is kept per row of its variable of ``shape`` (then it is split and joined
    like the variable; other slots, such as step counts, are the same on every shard)."""
    return isinstance(slot, torch.Tensor) and tuple(slot.shape) == tuple(shape)


def _join(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]


def latest(directory, *, on_refused=None) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` that passes its checks (every shard there, its checksum, its values
    finite), or None. Each refused one is reported to ``on_refused(error_message)``, leaves the committed set (its
    manifest is renamed ``*.refused``: a later commit of the same step is a new checkpoint, not refused again) and
    the previous one is tried."""
    for step in reversed(committed_steps(directory)):
        path = manifest_path(directory, step)
        try:
            found = Checkpoint.load(path)
            return found
        except CheckpointError as e:
            try:
                os.replace(path, path.with_name(path.name + ".refused"))
            except FileNotFoundError:  # another reader refused it first
                pass
            if on_refused is not None:
                on_refused(str(e))
    return None


def _whole_shapes(variables) -> dict[str, tuple[tuple, str]]:
    """(whole shape, dtype) of each model parameter of ``variables``, its parts' rows summed."""
    whole: dict[str, tuple[tuple, str]] = {}
    for v in variables:
        shape = tuple(v.shape)
        if v.parameter in whole:
            rows = whole[v.parameter][0][0] + shape[0]
            shape = (rows, *shape[1:])
        whole[v.parameter] = (shape, v.dtype)
    return whole


def _check_fits(name: str, saved, variables) -> None:
    """CheckpointError unless the variables of checkpoint ``name`` (``saved``, as its manifest lists them: any
    placement) hold the same parameters, whole shapes and dtypes as ``variables``."""
    held, wanted = _whole_shapes(saved), _whole_shapes(variables)
    if set(wanted) != set(held):
        missing, extra = sorted(set(wanted) - set(held)), sorted(set(held) - set(wanted))
        raise CheckpointError(f"checkpoint {name} does not fit this model (missing {missing}, unexpected {extra}): "
                              "train with another checkpoint_dir or restore=False")
    for parameter, (shape, dtype) in held.items():
        if (shape, dtype) != wanted[parameter]:
            raise CheckpointError(f"checkpoint {name} holds {parameter} as {shape} {dtype}, the model as "
                                  f"{wanted[parameter][0]} {wanted[parameter][1]}: train with another "
                                  "checkpoint_dir or restore=False")


def check_fits(directory, variables) -> None:
    """CheckpointError when the newest readable manifest in ``directory`` (the checkpoint a chief restoring
    from it would take) does not fit ``variables``; nothing when there is none. Reads manifests only: what the
    controller checks at ``train()``, before any task starts."""
    for step in reversed(committed_steps(directory)):
        path = manifest_path(Path(directory), step)
        try:
            saved = _manifest_variables(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # refused by the chief's ``latest`` too, which then tries the one before
        _check_fits(path.name, saved, variables)
        return


def reshard(ckpt: Checkpoint, variables) -> tuple[dict[int, torch.Tensor], dict[int, dict]]:
    """The checkpoint's values and optimizer state cut to ``variables`` (any placement and number of ps):
    (value by variable id, optimizer state by variable id). CheckpointError when the model differs."""
    _check_fits(ckpt.path.name, ckpt.variables, variables)
    params, slots = ckpt.tensors()
    values, states = {}, {}
    for v in variables:
        whole = params[v.parameter]
        values[v.id] = whole[v.start:v.stop].clone() if v.partitioned else whole.clone()
        states[v.id] = {slot: t[v.start:v.stop].clone() if _per_row(t, whole.shape) and v.partitioned else
                        t.clone() if isinstance(t, torch.Tensor) else t
                        for slot, t in slots[v.parameter].items()}
    return values, states


def export_state_dict(ckpt: Checkpoint, path) -> Path:
    """Write the checkpoint's model state as a plain ``state_dict`` file that ``torch.load`` reads without
    pscluster (a dict of tensors, ``weights_only`` safe; ``load_state_dict(..., strict=True)`` takes it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt.state_dict(), path)
    return path
