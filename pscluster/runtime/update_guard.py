"""No update leaves a NaN or an infinity on a ps: one that would is refused whole (``NonFiniteUpdate``), every
value and optimizer slot as it was before it.

Plain SGD (the ps's own ``p -= lr * g``, see ``updates``) is decided by a bound, at the cost of one read of the
gradients: with every |g| ≤ G (G is their Euclidean norm, the cheapest read, which also finds a NaN or an infinity
in them) and every |p| ≤ P, no value can leave the dtype's range while P + |lr|·G stays below half its largest
finite value. P is carried from update to update (it grows by |lr|·G each time) and measured again only when the
sum nears that limit; past it, the update is refused.

Every other update (an optimizer's ``step``, whose state may overflow where the values do not: Adam's squared
gradient of a float32 gradient above 1.8e19) runs under ``kept``: the values it may change and their optimizer
slots are copied first (for a sparse gradient, its rows only), checked after, and put back when one is not finite.
Most steps need no copy (``bounded``): one of torch's SGD, Adam, AdamW, Adagrad or (uncentered) RMSprop with sane
options, whose every value, gradient and slot is at most ``SAFE_MAGNITUDE``, cannot leave a NaN or an infinity, which
one read of them shows; only the others pay for the copies (3 N with Adam, beside its own 3 N).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..errors import NonFiniteUpdate


def largest(tensors: list[torch.Tensor]) -> float:
    """The largest magnitude of any element of ``tensors`` (0 for none): NaN when one is NaN, inf when one is
    infinite."""
    # the ends of each tensor (aminmax is NaN when any element is), not the infinity norm: this runs before every
    # plain SGD update, and on a CPU the infinity norm is 10-20 times slower
    ends = [torch.stack(torch.aminmax(t.detach())) for t in tensors if t.numel()]
    return float(torch.cat(ends).abs().max()) if ends else 0.0  # cat promotes mixed dtypes to the widest


def magnitude_bound(tensors: list[torch.Tensor]) -> float:
    """An upper bound of the magnitude of every element of ``tensors`` (0 for none): their joint Euclidean norm,
    NaN when one is NaN, inf when one is infinite (``largest`` where the norm is not finite, so that a norm past its
    dtype's range is not taken for an infinity)."""
    present = [t.detach() for t in tensors if t.numel()]
    if not present:
        return 0.0
    # one fused pass over each tensor, and a third of what ``largest`` costs on a CPU (its aminmax and the stacking)
    bound = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(present))))
    return bound if math.isfinite(bound) else largest(present)


def limit(tensors: list[torch.Tensor]) -> float:
    """Half the largest finite value of the narrowest floating dtype among ``tensors``."""
    return min((torch.finfo(t.dtype).max for t in tensors if t.is_floating_point()), default=math.inf) / 2


def sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor], lr: float, bound: float | None) -> float:
    """``p -= lr * g`` for each pair, or NonFiniteUpdate with nothing changed when a gradient is not finite or a
    value could leave its dtype's range. ``bound``: a known upper bound of every |p| (None: not known); returns
    one for the values after the update."""
    if not params:
        return 0.0
    growth = abs(lr) * magnitude_bound(grads)
    if not math.isfinite(growth):
        raise NonFiniteUpdate(f"a gradient (times lr={lr}) is NaN or infinite")
    ceiling = limit(params)
    if bound is None or bound + growth >= ceiling:
        bound = largest(params)
    if bound + growth >= ceiling:
        raise NonFiniteUpdate(f"a value would reach {bound + growth:.3g}, past the range of "
                              f"{min(p.dtype.itemsize for p in params) * 8}-bit floats")
    torch._foreach_add_(params, grads, alpha=-lr)
    return bound + growth


# Inputs (values, gradients, slots) at most this large in magnitude, with the options ``_sane`` allows, keep every
# intermediate of a step of the ``_BOUNDED`` optimizers below ~1e32, inside float32's range (3.4e38): with
# lr <= 1e2, weight decay <= 1e2, eps >= 1e-12 and 1 - beta >= 1e-4, Adam's decayed gradient is at most 1e14, its
# squared-gradient slot 1e28 and its move lr / (1 - beta1) * |m| / eps at most 1e32; SGD's, Adagrad's and RMSprop's
# are smaller. Every denominator is at least eps > 0, so no 0 / 0 either.
SAFE_MAGNITUDE = 1e12
_BOUNDED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop)
_SAFE_DTYPES = (torch.float32, torch.float64)


def _sane(group: dict) -> bool:
    """Whether a group's options are within the bounds ``SAFE_MAGNITUDE``'s reasoning assumes."""
    def number(key, default=0.0):
        value = group.get(key, default)
        return float(value) if isinstance(value, int | float | torch.Tensor) else math.nan

    betas = group.get("betas", (0.0, 0.0))
    coefficients = [float(b) for b in betas] + [number("momentum"), number("alpha"), number("dampening")]
    return (abs(number("lr")) <= 1e2 and abs(number("weight_decay")) <= 1e2 and number("eps", 1e-8) >= 1e-12
            and all(0.0 <= c <= 1.0 - 1e-4 for c in coefficients) and not group.get("centered", False)
            and abs(number("lr_decay")) <= 1e2 and abs(number("initial_accumulator_value")) <= SAFE_MAGNITUDE)


def bounded(optimizers: list[torch.optim.Optimizer]) -> bool:
    """Whether the pending step of ``optimizers`` (their parameters whose ``.grad`` is set) cannot leave a NaN or an
    infinity (see ``SAFE_MAGNITUDE``): each of a ``_BOUNDED`` class, with sane options, its values, gradients and
    slots float32 or float64, finite and at most ``SAFE_MAGNITUDE`` (one read of each). False says nothing."""
    tensors = []
    for optimizer in optimizers:
        if type(optimizer) not in _BOUNDED:
            return False
        for group in optimizer.param_groups:
            pending = [p for p in group["params"] if p.grad is not None]
            if pending and not _sane(group):
                return False
            for p in pending:
                grad = p.grad._values() if p.grad.is_sparse else p.grad
                slots = [v for v in optimizer.state.get(p, {}).values()
                         if isinstance(v, torch.Tensor) and v.is_floating_point()]
                if any(t.dtype not in _SAFE_DTYPES for t in (p, grad, *slots)):
                    return False
                tensors += [p.detach(), grad, *slots]
    return largest(tensors) <= SAFE_MAGNITUDE  # False for a NaN too


@contextmanager
def kept(optimizers: list[torch.optim.Optimizer]):
    """Run the block (an update of the parameters of ``optimizers`` whose ``.grad`` is set) with those values and
    their optimizer state kept: when any of them is NaN or infinite after it, every one is put back as it was and
    NonFiniteUpdate raised. A step that cannot leave one (``bounded``) runs without the copies."""
    if bounded(optimizers):
        yield
        return
    saved = [_Kept(opt, p) for opt in optimizers for group in opt.param_groups for p in group["params"]
             if p.grad is not None]
    yield
    bad = next((k for k in saved if not k.finite()), None)
    if bad is not None:
        for k in saved:
            k.restore()
        raise NonFiniteUpdate(f"the {bad.what} of a {tuple(bad.param.shape)} variable would be NaN or infinite")


class _Kept:
    """One parameter's values and optimizer slots before an update: whole, or the rows of its sparse gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer, param: torch.Tensor):
        self.optimizer, self.param, self.what = optimizer, param, "value"
        grad = param.grad
        self.rows = grad.coalesce().indices()[0] if grad.is_sparse else None
        self.had_state = param in optimizer.state
        self.values = self._part(param.detach())
        self.state = {k: self._part(v) if self._per_row(v) else v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in optimizer.state.get(param, {}).items()}

    def _per_row(self, v) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == self.param.shape

    def _part(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self.rows) if self.rows is not None else t.clone()

    def _current(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self.rows) if self.rows is not None else t

    def finite(self) -> bool:
        if not all_finite(self._current(self.param.detach())):
            return False
        for k, v in self.optimizer.state.get(self.param, {}).items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                    not all_finite(self._current(v) if self._per_row(v) else v):
                self.what = f"optimizer slot {k!r}"
                return False
        return True

    def restore(self) -> None:
        with torch.no_grad():
            self._put(self.param.detach(), self.values)
            if not self.had_state:
                self.optimizer.state.pop(self.param, None)
                return
            state = self.optimizer.state[self.param]
            for k, v in self.state.items():
                if self._per_row(state.get(k)):
                    self._put(state[k], v)
                else:
                    state[k] = v

    def _put(self, target: torch.Tensor, kept: torch.Tensor) -> None:
        if self.rows is not None:
            target.index_copy_(0, self.rows, kept)
        else:
            target.copy_(kept)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (a norm first: one pass without a temporary of ``t``'s size)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return bool(torch.isfinite(torch.linalg.vector_norm(t))) or bool(torch.isfinite(t).all())
