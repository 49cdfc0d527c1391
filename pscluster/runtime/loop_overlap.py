"""Overlap in a user's loop (``ctx.optimizer(optimizer, overlap=True)``): the library's early pushes (``overlap``)
and a GPU's host copies (``staging``), begun where a user's loop has no call to begin them in.

A loop that calls ``ctx.backward(loss)`` begins them there, between its forward and its backward (``begin``;
``Cluster.train``'s loop, whose gradients are final by construction, has no ``LoopOverlap``: its ``ctx.backward``
calls ``begin_backward`` alone). A loop that calls ``loss.backward()`` itself is watched instead: each forward of
a registered module with gradients enabled hooks its output, whose gradient is the first thing backward computes
through the module; the step's pushes begin there, after every forward of the step (the buffers are final).
Under ``ctx.no_sync()`` (the micro-batches of an accumulation but the last) nothing begins and nothing is pushed.

The pushes take each gradient as backward leaves it, so ``step()`` first makes sure it still is (``check``): a
gradient changed after backward (clipped, unscaled by a GradScaler) or produced by a second backward outside
``no_sync`` fails the step with a ConfigError that names the fix. The checks hold wherever ``overlap=True`` is
asked for, also where no early push or copy applies (async, a small model, a ps sharing memory with the worker),
so a loop that would push what it did not mean to fails on any machine, not only on a large one.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from .overlap import EarlyPush
from .staging import GradientStaging

FIX = ("clip with max_grad_norm=..., accumulate the micro-batches before the last under ctx.no_sync(), or register "
       "the optimizer without overlap=True")


class LoopOverlap:
    """The early pushes and host copies of one user's loop (see the module). ``step_of()``: the global step of the
    values the model holds (what the pushes are computed on)."""

    def __init__(self, modules, shards, early: EarlyPush | None, staging: GradientStaging | None, *, step_of, paused):
        """``paused()``: whether the loop is inside ``ctx.no_sync()``."""
        self._early, self._staging, self._step_of, self._paused = early, staging, step_of, paused
        self._begun = False  # this step's backward has begun
        self._left: dict[int, tuple] = {}  # id of a parameter -> (its name, the parameter, its grad, grad's version)
        self._twice: str | None = None  # a parameter whose gradient backward produced twice this step
        for module in modules:
            module.register_forward_hook(self._forward)
        trained = [v for vs in shards.dense.values() for v in vs if v.kind == "param"]
        self._names = {pid: vs[0].parameter for pid, vs in shards.hook_gradients(trained, self._produced).items()}

    def _forward(self, module, args, output) -> None:
        if self._paused() or self._begun or not torch.is_grad_enabled():
            return
        first = _first_tensor(output)
        if first is not None and first.requires_grad:
            first.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        if not self._paused():
            self.begin()

    def begin(self, loss: torch.Tensor | None = None) -> None:
        """This step's backward begins (``ctx.backward(loss)``, or the hook of a registered module's output):
        its pushes and host copies begin, once a step."""
        if not self._begun:
            self._begun = True
            begin_backward(self._early, self._staging, self._step_of(), loss)

    def _produced(self, param: torch.Tensor) -> None:
        if self._paused() or not self._begun:
            return
        if id(param) in self._left:
            self._twice = self._names[id(param)]
        self._left[id(param)] = (self._names[id(param)], param, param.grad, param.grad._version)

    def unscaled(self) -> None:
        """``ctx.backward`` unscaled this backward's gradients in place (fp16): they are as backward left them."""
        for vid, (name, param, grad, _) in self._left.items():
            self._left[vid] = (name, param, grad, grad._version)

    def check(self) -> None:
        """At ``step()``: ConfigError unless every gradient is as this step's one backward left it; the next step
        begins afresh."""
        twice, left = self._twice, self._left
        self._begun, self._twice, self._left = False, None, {}
        if twice is not None:
            raise ConfigError(f"overlap=True: backward produced the gradient of {twice} twice before step() and "
                              f"the first had been pushed: {FIX}")
        for name, param, grad, version in left.values():
            if param.grad is not grad or grad._version != version:
                raise ConfigError(f"overlap=True: the gradient of {name} changed after backward had pushed it: {FIX}")


def begin_backward(early: EarlyPush | None, staging: GradientStaging | None, step: int,
                   loss: torch.Tensor | None = None) -> None:
    """Before a backward on the values of global ``step``: a GPU's host copies begin (``staging``), and the pushes
    that leave during it (``early``) unless ``loss`` is known not to be finite (the step will not go)."""
    if staging is not None:
        staging.begin()
    if early is not None and (loss is None or math.isfinite(loss.detach().item())):
        early.begin(step)


def _first_tensor(output) -> torch.Tensor | None:
    """The first tensor of a module's output (itself, or the first in a tuple, list or dict)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None
