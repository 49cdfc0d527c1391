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

from ..errors import ConfigError, NonFiniteError


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


def compute(model: torch.nn.Module, loss_fn, step_fn, batch, device: torch.device, step: int = 0,
            autocast=contextlib.nullcontext, backward=torch.Tensor.backward) -> Computed:
    """Forward and backward of one batch on ``device``, on the parameters of global ``step``: forward and loss
    under ``autocast()``, then ``backward(loss)`` (a worker's: ``ctx.autocast``, ``ctx.backward``)."""
    batch = to_device(batch, device)
    model.zero_grad(set_to_none=True)  # fresh .grad tensors: the last ones may still be in flight
    with autocast():
        loss, output, target, metrics = forward(model, loss_fn, step_fn, batch)
    backward(loss)
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
    if not target.numel():
        return None
    if logits.dim() >= 2 and logits.shape[-1] > 1 and logits.shape[:-1] == target.shape \
            and not target.is_floating_point() and target.dtype is not torch.bool:
        return logits.argmax(-1).eq(target).sum().item() / target.numel()
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


def nonfinite(loss: torch.Tensor | None, norm: torch.Tensor,
              named: list[tuple[str, torch.nn.Parameter]]) -> str | None:
    """What is not finite in a step: its ``loss`` (None: not known), its gradients given their total ``norm``
    (``grad_norm``) and the ``named_parameters()`` they are of: ``"loss nan"``, ``"gradient of fc.weight"`` (the
    first such parameter), or None when all is finite."""
    if loss is not None:
        value = loss.detach().item()
        if not math.isfinite(value):
            return f"loss {value}"
    finite = math.isfinite(norm.item())  # of the dense gradients; sparse ones are checked below
    for name, p in named:
        g = p.grad
        if g is None or (finite and not g.is_sparse):
            continue
        values = g.coalesce().values() if g.is_sparse else g
        if not bool(torch.isfinite(values).all()):
            return f"gradient of {name}"
    return None


MAX_SKIPS = 100  # steps in a row a worker may leave out (non-finite, or fp16 overflows) before it fails anyway


class GradientRules:
    """What becomes of a step's gradients before they leave, the same in every loop (``optimizer.step()`` applies
    it, see ``context``), in this order:

    1. clipped to the run's ``max_grad_norm`` (torch's ``clip_grad_norm_``), their total norm taken;
    2. with fp16 loss scaling (``ctx.backward``), a step whose loss or gradients are not finite overflowed the
       scale: the scale is halved (``Precision.overflowed``) and the step left out, as torch's GradScaler does;
    3. a non-finite loss (the one given to ``ctx.backward``) or gradient fails the run with a ``NonFiniteError``
       naming the worker, the step and what (``on_nonfinite="fail"``), or leaves the step out (``"skip"``);
    4. ``MAX_SKIPS`` steps left out in a row fail the run anyway.

    ``emit``: the worker's metric events (``loss_scale``, ``nonfinite``)."""

    def __init__(self, precision: Precision, index: int, emit):
        self.precision, self.index, self.emit = precision, index, emit
        self.skipped = 0  # steps left out for a non-finite value (3.)
        self._in_a_row = 0

    def passes(self, plan, loss: torch.Tensor | None, params: list, named: list, *, scaled: bool, step: int,
               local_step: int, checked: frozenset = frozenset()) -> bool:
        """Whether the step of these gradients goes (see the class): ``params``, the parameters it pushes (named
        in ``named``); ``scaled``: its loss went through the loss scale; ``checked``: ids of parameters whose
        gradients are known finite; ``step``, ``local_step``: the global step they were computed on, this
        worker's steps so far."""
        norm = grad_norm(None, plan.max_grad_norm, checked, params=params)
        problem = nonfinite(loss, norm, named)
        overflowed = scaled and self.precision.overflowed(problem is None)
        if overflowed:
            self.emit("loss_scale", global_step=step, scale=self.precision.scale, problem=problem)
        elif problem is None:
            self._in_a_row = 0
            return True
        if (plan.on_nonfinite == "fail" and not overflowed) or self._in_a_row == MAX_SKIPS:
            raise self._failure(problem, step, local_step)
        self._in_a_row += 1
        if not overflowed:
            self.skipped += 1
            self.emit("nonfinite", global_step=step, local_step=local_step + 1, problem=problem)
        return False

    def _failure(self, problem: str, step: int, local_step: int) -> NonFiniteError:
        skipped = self._in_a_row
        return NonFiniteError(
            f"worker {self.index} computed a non-finite {problem} at global step {step} (its local step "
            f"{local_step + 1}{f', after skipping {skipped} batches' if skipped else ''}): lower the learning "
            "rate, clip with max_grad_norm=..., or train with on_nonfinite='skip'")


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
