"""What every benchmark shares: alternating repetitions, statistics, targets, the machine, results.

A comparison is always a ratio of two things measured in the same run: ``alternate`` runs the contenders
in turn, one repetition of each per round, the order reversed from round to round, so that a machine
getting slower or faster weighs on both alike; ``ratio`` is then taken per round and summarized.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPETITIONS = 5  # the least number of rounds of any comparison


def repetitions(tiny: bool, times: int = 1) -> int:
    """Rounds of a comparison: ``times`` the usual number (more for comparisons of short, noisy rounds); one at the
    tiny size, which checks that a benchmark runs, not what it measures."""
    return 1 if tiny else times * REPETITIONS


def summary(values: list[float]) -> dict:
    """Median, quartiles, extremes and count of ``values`` (NaN-free)."""
    values = sorted(float(v) for v in values)
    if not values:
        return {"n": 0}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": values[0], "max": values[-1],
            "n": len(values), "values": values}


def alternate(contenders: dict[str, Callable[[], float]], rounds: int, warmup: bool = False) -> dict[str, list[float]]:
    """Call each contender once per round, in an order reversed every other round; returns the values
    each returned, by name. ``warmup``: one round first whose values are left out (a contender's first call
    pays for its processes' first allocations and connections)."""
    names = list(contenders)
    if warmup:
        for name in names:
            contenders[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(contenders[name]())
    return out


def ratio(numerator: list[float], denominator: list[float]) -> dict:
    """The summary of the per-round ratios ``numerator[i] / denominator[i]``."""
    return summary([a / b for a, b in zip(numerator, denominator) if b])


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Target:
    """A goal for a ratio: ``ratio >= goal`` (``higher``) or ``ratio <= goal`` (not ``higher``)."""

    goal: float
    higher: bool = True

    def judge(self, value: float) -> dict:
        """met, and by how much the value is off the goal (a fraction of the goal; > 0 is better)."""
        margin = (value - self.goal) / self.goal if self.higher else (self.goal - value) / self.goal
        return {"goal": f"{'>=' if self.higher else '<='} {self.goal:g}", "met": margin >= 0, "margin": margin}


@dataclass
class Row:
    """One comparison: ``a`` against ``b`` (each a summary in ``unit``), their per-round ratio, a target."""

    case: str
    a_label: str
    b_label: str
    unit: str
    a: dict
    b: dict
    ratio: dict
    target: dict | None = None
    note: str = ""


def compare(case: str, a_label: str, a: list[float], b_label: str, b: list[float], unit: str,
            target: Target | None = None, *, invert: bool = False, note: str = "") -> Row:
    """A row for ``a`` against ``b``; the ratio is a/b, or b/a with ``invert`` (for times: speed ratio)."""
    r = ratio(b, a) if invert else ratio(a, b)
    return Row(case, a_label, b_label, unit, summary(a), summary(b), r,
               target.judge(r["median"]) if target and r.get("n") else None, note)


def machine() -> dict:
    """Cores, CPU model, memory, GPU, OS, and the versions that matter here."""
    import torch
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "cpu": model,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpu": gpu, "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__}


def commit() -> str | None:
    """The commit measured, with "+uncommitted" when pscluster/ has changes not committed yet."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              timeout=10).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        return sha and sha + ("+uncommitted" if git("status", "--porcelain", "--", "../pscluster") else "")
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class Result:
    """What one benchmark writes to ``results/<name>.json``."""

    name: str
    title: str
    tiny: bool
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None  # why a benchmark (or part) could not run here
    extra: dict = field(default_factory=dict)  # raw numbers a benchmark keeps besides its rows

    def to_dict(self, *, load_before, load_after, seconds: float) -> dict:
        return {**asdict(self), "machine": machine(), "commit": commit(),
                "date": time.strftime("%Y-%m-%d %H:%M", time.localtime()),
                "load_before": list(load_before), "load_after": list(load_after), "seconds": round(seconds, 1)}


def run_benchmark(name: str, fn: Callable[[bool, Path], Result], tiny: bool, out_dir: Path) -> dict:
    """Run one benchmark (``fn(tiny, out_dir)``), with the load average before and after, and write its JSON
    to ``out_dir``; returns it (when it failed: no rows, the error in ``skipped``, ``extra["failed"]``). One
    this machine cannot run at all (skipped with no rows, say for want of a GPU) leaves an earlier result with
    rows in place; one run in part (rows, and a part skipped) replaces it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before, start = os.getloadavg(), time.monotonic()
    try:
        result = fn(tiny, out_dir)
    except Exception as e:  # one benchmark failing leaves the others' results, and says why in its own
        result = Result(name, f"{name} (failed)", tiny, skipped=f"failed: {type(e).__name__}: {e}",
                        extra={"failed": True})
    data = result.to_dict(load_before=before, load_after=os.getloadavg(), seconds=time.monotonic() - start)
    path = out_dir / f"{name}.json"
    if result.skipped and not result.rows and not result.extra.get("failed") and path.exists():
        earlier = json.loads(path.read_text())
        if earlier["rows"]:  # measured where this machine cannot (a GPU's): kept, not replaced by "not run"
            return earlier
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data
