"""The training step: batches of any structure, the default step or the user's ``step_fn``, and its metrics.

A batch is a tensor, or any nesting of tuples, lists and dicts of tensors (other values are left as they are).

- Default step (no ``step_fn``): ``batch = (inputs, target)``; ``inputs`` a tensor (``model(inputs)``), a tuple or
  list (``model(*inputs)``) or a dict (``model(**inputs)``); the loss is ``loss_fn(output, target)``.
- ``step_fn(model, batch)`` for everything else: it returns the loss, or ``(loss, {"name": value, ...})`` whose
  values (numbers or one-element tensors) are logged, stored and plotted beside the loss.

Accuracy is reported only where it means something: class logits against integer class targets (a tensor
output, the first of a tuple, or a dict's ``"logits"``), or one logit per binary 0/1 target.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..errors import ConfigError


class Computed(NamedTuple):
    """One batch's forward and backward: the gradients are in the model's ``.grad``."""

    loss: torch.Tensor
    output: object  # the model's output (None with a step_fn)
    target: object  # the batch's target (None with a step_fn)
    samples: int
    metrics: dict  # a step_fn's own metrics, name -> tensor or number
    step: int  # the global step of the parameters they were computed on


def to_device(batch, device: torch.device):
    """``batch`` with every tensor in it moved to ``device`` (tuples, named tuples, lists and dicts rebuilt); to a GPU
    without waiting (from pinned memory, a DMA copy)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def samples_in(batch) -> int:
    """The number of samples of ``batch``: the first dimension of its first tensor (1 for a 0-d tensor, 0 when
    there is none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for v in values:
        n = samples_in(v)
        if n:
            return n
    return 0


def describe(batch) -> str:
    """A short description of a batch's structure for error messages: ``dict(image, label)``, ``tuple of 3``."""
    if isinstance(batch, torch.Tensor):
        return f"tensor {tuple(batch.shape)}"
    if isinstance(batch, Mapping):
        return f"dict({', '.join(map(str, list(batch)[:5]))})"
    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__} of {len(batch)}"
    return type(batch).__name__


def call_model(model: torch.nn.Module, inputs):
    """``model(inputs)``, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)) and not hasattr(inputs, "_fields"):
        return model(*inputs)
    return model(inputs)


def traceable_inputs(batch, step_fn) -> tuple[torch.Tensor, ...] | None:
    """The positional tensors the default step calls the model with on ``batch`` (what ``torch.jit.trace``
    takes), or None: a ``step_fn`` calls the model its own way, and keyword or nested inputs do not trace."""
    if step_fn is not None or not isinstance(batch, (tuple, list)) or len(batch) != 2:
        return None
    inputs = batch[0]
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
        return tuple(inputs)
    return None


def forward(model: torch.nn.Module, loss_fn, step_fn, batch) -> tuple:
    """(loss, output, target, metrics) of one batch by the default step or ``step_fn`` (see the module)."""
    if step_fn is not None:
        result = step_fn(model, batch)
        loss, metrics = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(f"step_fn returned {type(result).__name__}: return the loss (a one-element tensor) "
                              "or (loss, {'metric': value, ...})")
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"step_fn's metrics are a {type(metrics).__name__}: return (loss, {{'name': value}})")
        return loss, None, None, dict(metrics)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ConfigError(f"a batch of the dataset is a {describe(batch)}: the default step takes (inputs, target) "
                          "batches; give step_fn=f(model, batch) -> loss for any other")
    inputs, target = batch
    output = call_model(model, inputs)
    loss = loss_fn(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(f"loss_fn returned {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}: it must "
                          "return one number (a reduced loss), e.g. torch.nn.CrossEntropyLoss()")
    return loss, output, target, {}


class Precision:
    """A worker's mixed precision (``PRECISIONS``): ``bf16`` and ``fp16`` run forward and loss under
    ``torch.autocast`` with that dtype (the parameters stay fp32: the ps keeps fp32 master values and optimizer
    state) and send the gradients in it; ``fp16`` also scales the loss dynamically, as torch's GradScaler
    does: ``scale`` doubles after ``GROWTH_INTERVAL`` steps with finite gradients and halves at an overflow,
    whose batch is left out."""

    GROWTH_INTERVAL = 2000

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.dtype = PRECISIONS[name]
        self.device_type = device.type
        self.scale = 2.0 ** 16 if name == "fp16" else None
        self._good = 0

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        """Gradients of ``loss`` in the model's ``.grad``, unscaled."""
        if self.scale is None:
            loss.backward()
            return
        (loss.float() * self.scale).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None and not p.grad.is_sparse]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def overflowed(self, finite: bool) -> bool:
        """Whether a step's gradients overflowed the fp16 loss scale (then the scale is halved and the batch
        is to be left out); ``finite``: whether they were all finite."""
        if self.scale is None:
            return False
        if not finite:
            self.scale, self._good = self.scale / 2, 0
            return True
        self._good += 1
        if self._good == self.GROWTH_INTERVAL:
            self.scale, self._good = self.scale * 2, 0
        return False


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute(model: torch.nn.Module, loss_fn, step_fn, batch, device: torch.device, step: int,
            precision: Precision | None = None, before_backward=None) -> Computed:
    """Forward and backward of one batch on ``device``, on the parameters of global ``step`` (in ``precision``);
    ``before_backward(loss)`` is called in between."""
    precision = precision or Precision("fp32", device)
    batch = to_device(batch, device)
    model.zero_grad(set_to_none=True)  # fresh .grad tensors: the last ones may still be in flight
    with precision.autocast():
        loss, output, target, metrics = forward(model, loss_fn, step_fn, batch)
    if before_backward is not None:
        before_backward(loss)
    precision.backward(loss, model)
    return Computed(loss, output, target, samples_in(batch), metrics, step)


def logits_of(output) -> torch.Tensor | None:
    """The class scores of a model's output: the tensor itself, the first element of a tuple or list, or a
    dict's ``logits``; None when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        value = output.get("logits")
    elif isinstance(output, (tuple, list)) and output:
        value = output[0]
    else:
        return None
    return value if isinstance(value, torch.Tensor) else None


def batch_accuracy(output, target) -> float | None:
    """Fraction of correct predictions where that means something, else None: class logits ``(N, C)`` (or
    ``(N, T, C)``) against integer targets ``(N,)`` (``(N, T)``); or one logit per sample against 0/1 targets."""
    logits = logits_of(output)
    if logits is None or not isinstance(target, torch.Tensor) or target.is_complex():
        return None
    logits, target = logits.detach(), target.detach()
    if logits.dim() >= 2 and logits.shape[-1] > 1 and logits.shape[:-1] == target.shape \
            and not target.is_floating_point() and target.dtype is not torch.bool:
        return (logits.argmax(-1) == target).float().mean().item()
    if logits.numel() == target.numel() and logits.numel() and (logits.shape == target.shape or
                                                                 logits.shape == (*target.shape, 1)):
        flat = target.reshape(-1).float()
        if bool(((flat == 0) | (flat == 1)).all()):
            return ((logits.reshape(-1) > 0).float() == flat).float().mean().item()
    return None


def metric_values(metrics: dict) -> dict[str, float]:
    """A step's metrics as plain floats; ConfigError naming a metric that is not one number."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigError(f"metric {name!r} of step_fn has shape {tuple(value.shape)}: return one number")
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"metric {name!r} of step_fn is a {type(value).__name__}: return a number")
        out[str(name)] = float(value)
    return out


def grad_norm(model: torch.nn.Module, max_norm: float | None = None, skip: set[int] = frozenset(),
              params=None) -> torch.Tensor:
    """The total 2-norm of the model's dense gradients (as ``clip_grad_norm_`` computes it); with ``max_norm``,
    the gradients are clipped to it first, by torch's own ``clip_grad_norm_``. ``skip``: ids of parameters left
    out (without ``max_norm``: those whose gradients are known to be finite, for the non-finite check);
    ``params``: those to take (default: the model's)."""
    grads = [p for p in (model.parameters() if params is None else params)
             if p.grad is not None and not p.grad.is_sparse and id(p) not in skip]
    if not grads:
        return torch.zeros(())
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)
    norms = torch._foreach_norm([p.grad for p in grads])
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def nonfinite(computed: Computed, norm: torch.Tensor, named: list[tuple[str, torch.nn.Parameter]]) -> str | None:
    """What is not finite in a computed step, given its gradients' total ``norm`` (``grad_norm``) and the model's
    ``named_parameters()``: ``"loss nan"``, ``"gradient of fc.weight"`` (the first such parameter), or None when
    all is finite."""
    loss = computed.loss.detach().item()
    if not math.isfinite(loss):
        return f"loss {loss}"
    finite = bool(torch.isfinite(norm))  # of the dense gradients; sparse ones are checked below
    for name, p in named:
        g = p.grad
        if g is None or (finite and not g.is_sparse):
            continue
        values = g.coalesce().values() if g.is_sparse else g
        if not bool(torch.isfinite(values).all()):
            return f"gradient of {name}"
    return None


def check_loss(loss_fn, step_fn) -> None:
    """A one-line ConfigError unless the default step has a loss to call (``step_fn`` given: it computes its own):
    a loss class (``torch.nn.CrossEntropyLoss``) is not one, its instance is."""
    if step_fn is not None:
        return
    if isinstance(loss_fn, type):
        raise ConfigError(f"loss_fn={loss_fn.__name__} is a class: pass an instance, loss_fn={loss_fn.__name__}()")
    if not callable(loss_fn):
        raise ConfigError("loss_fn must be callable, e.g. torch.nn.CrossEntropyLoss(), or give "
                          "step_fn=f(model, batch) -> loss")


def check_step(model: torch.nn.Module, loss_fn, step_fn, batch) -> None:
    """Run the training step once on ``batch`` (a couple of the dataset's items, on the controller's own copy of
    the model, at ``train()``): a ConfigError that keeps the cause and names what to fix, instead of a failure
    on every worker later."""
    try:
        metric_values(compute(model, loss_fn, step_fn, batch, torch.device("cpu"), 0).metrics)
    except ConfigError:
        raise
    except Exception as e:
        culprit = "model_fn or step_fn" if step_fn is not None else "model_fn, loss_fn or the batch structure"
        raise ConfigError(f"the training step fails on a batch of the dataset ({describe(batch)}): "
                          f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} — fix "
                          f"{culprit}" + ("" if step_fn is not None else ", or give step_fn=f(model, batch) -> loss"))\
            from None
