"""What a worker's request holds, read and checked against its run before anything of it is used: a push's
gradients and buffer values, the rows of a sparse variable. Sparse variables (embedding tables) are never sent whole
after INIT: workers pull the rows their batch touches (PULL_ROWS) and push (row indices, row gradients) pairs.
Anything that does not fit the run is a ProtocolError: the ps refuses the request, counted as malformed."""

from __future__ import annotations

import torch

from ..errors import ProtocolError


def read_push(run, ids: list[int], tensors: list[torch.Tensor], ps: int, optimizer_set: int = 0) -> tuple[list, list]:
    """(per trained variable of ``run`` in its order: a dense gradient, or for a sparse variable a list of one
    (row indices, row values) pair, None for one of another of a user's optimizers; per buffer: its value on the
    worker) from the ``ids`` and ``tensors`` of a push to ps ``ps``. A push holds each buffer and each trained
    variable of ``optimizer_set`` (with one optimizer: all of them) once, a sparse one as two tensors in a row
    (rows, then values)."""
    grads: list = [None] * len(run.ids)
    k = 0
    while k < len(ids):
        i = run.position.get(ids[k])
        if i is None or grads[i] is not None or run.kinds[i] == "frozen" or \
                (run.kinds[i] == "param" and run.optimizer_of[i] != optimizer_set):
            raise ProtocolError(f"push holds variables {ids}: ps {ps} takes {run.dense_ids} and its "
                                "sparse ones, each once")
        param = run.params[i]
        if not run.sparse[i]:
            grad = tensors[k]
            if grad.shape != param.shape or not (grad.dtype == param.dtype or run.kinds[i] == "param" and
                                                 param.dtype == torch.float32 and grad.dtype == run.half):
                raise ProtocolError(f"gradients of variable {ids[k]} have the wrong shape or dtype: "
                                    "the worker's model differs from the chief's")
            grads[i], k = (grad if grad.dtype == param.dtype else grad.float()), k + 1  # mixed precision
            continue
        if k + 1 >= len(ids) or ids[k + 1] != ids[k]:
            raise ProtocolError(f"sparse variable {ids[k]}: rows and values expected")
        rows, values = _checked_rows(tensors[k], param.shape[0], ids[k]), tensors[k + 1]
        if values.shape != (len(rows), *param.shape[1:]) or values.dtype != param.dtype:
            raise ProtocolError(f"sparse gradient of variable {ids[k]}: {tuple(values.shape)} values "
                                f"for {len(rows)} rows of shape {tuple(param.shape[1:])}")
        grads[i], k = [(rows, values)], k + 2
    if any(g is None for g, kind, k in zip(grads, run.kinds, run.optimizer_of)
           if kind == "buffer" or kind == "param" and k == optimizer_set):
        raise ProtocolError(f"push holds variables {ids}: ps {ps} takes {run.dense_ids} and its "
                            "sparse ones, each once")
    return [grads[i] for i in run.trained], [g for g, kind in zip(grads, run.kinds) if kind == "buffer"]


def sparse_rows(run, vid: int, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` (a PULL_ROWS request's indices) of sparse variable ``vid`` of ``run``."""
    i = run.position.get(vid)
    if i is None or not run.sparse[i]:
        raise ProtocolError(f"variable {vid} is not a sparse variable of this ps")
    param = run.params[i]
    return param.detach()[_checked_rows(rows, param.shape[0], vid)]


def _checked_rows(rows: torch.Tensor, num_rows: int, vid: int) -> torch.Tensor:
    """``rows`` as row indices of a variable of ``num_rows`` rows, or ProtocolError (rows on the meta device
    have not arrived yet: their range is checked once they have)."""
    if rows.dtype != torch.int64 or rows.dim() != 1 or len(rows) > num_rows:
        raise ProtocolError(f"rows of variable {vid}: a 1-D int64 tensor of at most {num_rows} rows expected")
    if len(rows) and not rows.is_meta and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ProtocolError(f"rows of variable {vid} out of range 0..{num_rows - 1}")
    return rows
