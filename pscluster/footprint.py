"""A variable's footprint on the ps tasks, as counted and as written for people: the optimizer state a ps keeps
per parameter (``optimizer_slots``), byte counts (``format_bytes``) and the TF-style line naming where a variable
or a shard of it lives (``placement_line``). Pure functions over plain values; the runtime, the views and the
public ``pscluster.placement`` share them."""

from __future__ import annotations


def placement_line(name: str, ps: int, rows: tuple[int, int] | None = None, nbytes: int = 0,
                   kind: str = "param") -> str:
    """The TF-style listing line: ``fc1.weight: /job:ps/task:0`` or, for a shard of rows
    ``[start, stop)``, ``embedding/part_1: /job:ps/task:1 (rows 500000-999999, 32.0 MB)``; a frozen parameter
    or a buffer says so: ``stem.weight: /job:ps/task:0 (frozen)``."""
    line = f"{name}: /job:ps/task:{ps}"
    notes = ([f"rows {rows[0]}-{rows[1] - 1}", format_bytes(nbytes)] if rows is not None else []) + \
        ([kind] if kind != "param" else [])
    if notes:
        line += f" ({', '.join(notes)})"
    return line


def format_bytes(n: float) -> str:
    """``32.0 MB``, ``1.5 KB``, ``40 B`` (powers of 1024, as memory is counted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# Parameter-sized state tensors each torch.optim optimizer keeps per parameter (scalars such as Adam's
# 'step' do not count). Momentum and flags add to the base count; see optimizer_slots.
_BASE_SLOTS = {"sgd": 0, "adam": 2, "adamw": 2, "adagrad": 1, "rmsprop": 1, "adadelta": 2, "asgd": 1}


def optimizer_slots(optimizer: str, kwargs: dict) -> int:
    """How many parameter-sized state tensors ``optimizer`` (a torch.optim class name, any case, or a
    ``module:Class`` path) keeps per parameter with keyword arguments ``kwargs``.

    SGD 0 (1 with momentum), Adam/AdamW 2 (3 with amsgrad), Adagrad 1, RMSprop 1 (+1 with momentum,
    +1 centered), Adadelta 2. Used to count bytes per ps with the optimizer state, which lives on the ps.
    """
    name = optimizer.rpartition(":")[2].rpartition(".")[2].lower()
    kwargs = kwargs or {}
    # Unknown optimizers (Adamax, NAdam, RAdam, Rprop, custom ones) mostly keep two moments: assume 2.
    slots = _BASE_SLOTS.get(name, 2)
    if name == "sgd" and kwargs.get("momentum", 0):
        slots += 1
    if name in ("adam", "adamw") and kwargs.get("amsgrad", False):
        slots += 1
    if name == "rmsprop":
        slots += bool(kwargs.get("momentum", 0)) + bool(kwargs.get("centered", False))
    return slots
