"""The user's error first: a failed worker's traceback, as the notebook shows it.

A worker's exception arrives as ipyparallel's ``RemoteError``: its type, its message, and the traceback the
engine formatted (IPython's, with the source lines the engine has: those ``cluster.shipping`` sent along). Its
outer frames are ipyparallel's and pscluster's, which call the user's function. ``training_error`` turns it
into the ``TrainingError`` that ``Run.wait`` raises: the user's error and where it happened on the first line,
then the user's frames with their lines, an IPython cell named as IPython names it (``Cell In[4], line 13``),
and each run of library frames folded into one line. IPython shows that error as its message alone: the
controller's frames that raised it (the cell's ``run.wait()``, ``Run.wait``) say nothing of the user's error.
"""

from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..errors import TrainingError

_HEADER = re.compile(r"^File (?P<file>.+?):(?P<line>\d+)(?:, in (?P<function>.+))?$")  # IPython's frame header
_LIBRARIES = sorted({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("purelib", "platlib", "stdlib")},
                    key=len, reverse=True)  # site-packages may lie inside the standard library's folder
_PACKAGE = str(Path(__file__).resolve().parents[1])


class UserCodeError(TrainingError):
    """Training failed in the user's code on a worker: the message holds the user's error and frames (see
    ``training_error``), which is all IPython shows of it (``_render_traceback_``, the protocol by which an
    exception gives IPython its own traceback)."""

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()


@dataclass(frozen=True)
class Frame:
    """One frame of an engine's traceback: its file, line, function (with its arguments) and source lines."""

    file: str
    line: int
    function: str
    source: tuple[str, ...]

    @property
    def library(self) -> str | None:
        """The library the frame is code of (``pscluster``, ``ipyparallel``, ``python``...), None for the user's."""
        if self.file.startswith("<") and not self.file.startswith("<ipython-input-"):
            return "python"  # exec'd strings (<string>) and frozen modules: never the user's shipped code
        if self.file.startswith(_PACKAGE + "/"):
            return "pscluster"
        for root in _LIBRARIES:
            if self.file.startswith(root + "/"):
                rest = Path(self.file).relative_to(root).parts
                return rest[0].removesuffix(".py") if "site-packages" in root else "python"
        match = re.search(r"/(?:site|dist)-packages/([^/]+)", self.file)  # an engine installed elsewhere
        return match.group(1).removesuffix(".py") if match else None

    def place(self) -> str:
        """Where the frame is, as IPython names it: ``Cell In[4], line 13`` or ``File /path/x.py:13``."""
        cell = _cell_name(self.file)
        return f"Cell {cell}, line {self.line}" if cell else f"File {self.file}:{self.line}"


def frames(traceback_text: str) -> list[Frame]:
    """The frames of the last traceback in an engine's formatted ``traceback_text``, outermost first (an exception
    raised while handling another: the one raised)."""
    lines = traceback_text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    found: list[Frame] = []
    for i in range(starts[-1] + 1 if starts else 0, len(lines)):
        header = _HEADER.match(lines[i])
        if header is None:
            continue
        source = []
        for line in lines[i + 1:]:
            if not line.strip() or _HEADER.match(line):
                break
            source.append(line)
        found.append(Frame(header["file"], int(header["line"]), header["function"] or "<module>", tuple(source)))
    return found


def user_first(found: list[Frame]) -> list[str]:
    """The lines of a traceback of ``found`` with the user's frames first, each with its source lines: the library
    frames around them (those that called the user's code last, as one line), each run folded into one line."""
    first_user = next(i for i, f in enumerate(found) if f.library is None)
    shown: list[str] = []
    for run in _runs(found[first_user:]):
        if run[0].library is None:
            for frame in run:
                shown += [f"{frame.place()}, in {frame.function}", *frame.source]
        else:
            shown.append(f"… {_folded(run)}")
    if first_user:
        shown.append(f"… called by {_folded(found[:first_user])}")
    return shown


def training_error(failures: list[tuple[int, BaseException]], fallback: str) -> TrainingError:
    """The error of a run whose workers failed with ``failures`` ((worker index, its error), by index): a
    ``UserCodeError``, its first line the first failure's error and its place in the user's code, with every worker
    that failed so; then the other failures, one line each; then the first failure's traceback, the user's frames
    first (``user_first``). A plain ``TrainingError(fallback)`` when the first failure went through no code of the
    user's (the run's own failure)."""
    described = [(i, _error_line(e), frames(_text(e))) for i, e in failures]
    if not described or not any(f.library is None for f in described[0][2]):
        return TrainingError(fallback)
    line, found = described[0][1], described[0][2]
    user = [f for f in found if f.library is None]
    where = f"{line} (at {user[-1].place()} in {_function_name(user[-1].function)})"
    alike = [i for i, other, other_frames in described if other == line and _same_place(other_frames, user[-1])]
    others = [f"worker {i}: {other}" for i, other, _ in described if i not in alike]
    workers = f"worker {alike[0]}" if len(alike) == 1 else "workers " + ", ".join(map(str, alike))
    return UserCodeError("\n".join([f"{where} on {workers}", *others,
                                    f"worker {alike[0]}'s traceback, your code first (run.error holds each "
                                    "worker's whole traceback):", *user_first(found)]))


def _runs(found: list[Frame]) -> list[list[Frame]]:
    """``found`` in runs of consecutive frames that are all the user's or all a library's."""
    runs: list[list[Frame]] = []
    for frame in found:
        if runs and (runs[-1][0].library is None) == (frame.library is None):
            runs[-1].append(frame)
        else:
            runs.append([frame])
    return runs


def _folded(run: list[Frame]) -> str:
    libraries = sorted({f.library for f in run})
    return f"{len(run)} {'frame' if len(run) == 1 else 'frames'} of {', '.join(libraries)}"


def _same_place(found: list[Frame], place: Frame) -> bool:
    user = [f for f in found if f.library is None]
    return bool(user) and (user[-1].file, user[-1].line) == (place.file, place.line)


def _function_name(function: str) -> str:
    return function.split("(", 1)[0]


def _error_line(e: BaseException) -> str:
    """``ZeroDivisionError: division by zero``: the error's type and the last line of its message."""
    name, value = getattr(e, "ename", type(e).__name__), str(getattr(e, "evalue", e)).strip()
    return f"{name}: {value.splitlines()[-1]}" if value else name


def _text(e: BaseException) -> str:
    """The engine's formatted traceback of ``e`` (ipyparallel's ``RemoteError`` carries it), without terminal
    colours; '' for an error raised here."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(getattr(e, "traceback", None) or ""))


def _cell_name(file: str) -> str | None:
    """``In[4]``: the cell of this kernel that ``file`` names (IPython's compiler knows each cell's file), or None
    (a file on disk, or no IPython here)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    named = shell.compile.format_code_name(file) if shell is not None else None
    return named[1] if named else None
