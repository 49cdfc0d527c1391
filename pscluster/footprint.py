"""A variable's footprint on the ps tasks, as counted and as written for people: the optimizer state a ps keeps
per parameter (``optimizer_slot_names``, ``optimizer_slots``), byte counts (``format_bytes``) and the TF-style
line naming where a variable or a shard of it lives (``placement_line``). Pure functions over plain values;
the runtime, the views and the public ``pscluster.placement`` share them."""

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


# The parameter-sized state tensors each torch.optim optimizer keeps per parameter, by their names in its
# ``state`` (scalars such as Adam's 'step' do not count); options add some, see optimizer_slot_names.
_BASE_SLOTS = {"sgd": (), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
               "sparseadam": ("exp_avg", "exp_avg_sq"), "nadam": ("exp_avg", "exp_avg_sq"),
               "radam": ("exp_avg", "exp_avg_sq"), "adamax": ("exp_avg", "exp_inf"), "adagrad": ("sum",),
               "rmsprop": ("square_avg",), "adadelta": ("square_avg", "acc_delta"), "asgd": ("ax",),
               "rprop": ("prev", "step_size")}
_UNKNOWN_SLOTS = ("slot_0", "slot_1")  # a custom optimizer: most keep two moments


def optimizer_slot_names(optimizer: str, kwargs: dict) -> tuple[str, ...]:
    """The names (as in the optimizer's ``state``) of the parameter-sized tensors ``optimizer`` (a torch.optim
    class name, any case, or a ``module:Class`` path) keeps per parameter with keyword arguments ``kwargs``:
    Adam ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), SGD none (``momentum_buffer``
    with momentum), RMSprop ``square_avg`` (and ``momentum_buffer``, ``grad_avg`` when centered)... An optimizer
    torch does not ship is assumed to keep two, ``slot_0`` and ``slot_1``."""
    name = optimizer.rpartition(":")[2].rpartition(".")[2].lower()
    kwargs = kwargs or {}
    names = _BASE_SLOTS.get(name, _UNKNOWN_SLOTS)
    if name in ("sgd", "rmsprop") and kwargs.get("momentum", 0):
        names += ("momentum_buffer",)
    if name in ("adam", "adamw") and kwargs.get("amsgrad", False):
        names += ("max_exp_avg_sq",)
    if name == "rmsprop" and kwargs.get("centered", False):
        names += ("grad_avg",)
    return names


def optimizer_slots(optimizer: str, kwargs: dict) -> int:
    """How many parameter-sized state tensors ``optimizer`` keeps per parameter (``optimizer_slot_names``);
    used to count bytes per ps with the optimizer state, which lives on the ps."""
    return len(optimizer_slot_names(optimizer, kwargs))
