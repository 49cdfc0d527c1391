"""Placement: which ps task holds which variable. Pure functions over plain data."""

from __future__ import annotations

from collections.abc import Sequence


def round_robin(names: Sequence[str], num_ps: int) -> dict[str, int]:
    """Variable ``i`` (in model order) goes to ps task ``i % num_ps``, like replica_device_setter."""
    if num_ps < 1:
        raise ValueError("num_ps must be >= 1")
    return {name: i % num_ps for i, name in enumerate(names)}


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
