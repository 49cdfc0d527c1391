"""Shipping notebook-defined code to engines with cloudpickle.

cloudpickle sends functions and classes of ``__main__`` (notebook cells) by
value, but those of any other imported module by reference, which fails on an
engine that cannot import that module (a helper file next to the notebook, a
test module). Modules that are not installed (outside site-packages and the
standard library) are therefore sent by value too.

Code sent by value keeps its file name (cloudpickle renames it ``<dynamic-code>``) and carries that file's lines
as the controller reads them (an IPython cell's from IPython's cache), which the engine registers in its
``linecache``: a worker's traceback names the user's file and shows its lines.
"""

from __future__ import annotations

import io
import linecache
import sys
import sysconfig
import types
from collections import ChainMap
from pathlib import Path

import cloudpickle

from ..errors import ConfigError
from ..runtime import remote
from . import ipp_bounds

_INSTALLED = tuple(Path(p).resolve() for p in {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")})


def _local_modules(objs) -> list:
    modules = {}  # by name: each once, however many of the objects come from it
    for obj in objs:
        for candidate in (obj, type(obj)):
            name = getattr(candidate, "__module__", None)
            module = sys.modules.get(name) if name else None
            file = getattr(module, "__file__", None)
            if module is None or name == "__main__" or not file or name.split(".")[0] == "pscluster":
                continue
            path = Path(file).resolve()
            if not any(path.is_relative_to(root) for root in _INSTALLED):
                modules[name] = module
    return list(modules.values())


def _code_reduce(code: types.CodeType):
    """cloudpickle's reduction of ``code``, rebuilt on the engine by ``remote.shipped_code`` under its own file name,
    with the file's lines."""
    _, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return remote.shipped_code, (args, code.co_filename, linecache.getlines(code.co_filename) or None)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def _dumps(objs) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(objs)
    return buffer.getvalue()


def ship(*objs) -> bytes:
    """cloudpickle bytes of ``objs`` (a tuple), local modules' code included by value; a ``ConfigError`` when they
    would not fit one frame of ipyparallel's sockets (``ipp_bounds.MAX_FRAME_BYTES``)."""
    modules = _local_modules(objs)
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        shipped = _dumps(objs)
    except Exception as e:
        raise ConfigError(f"cannot ship the model, dataset or loss to the engines ({e}): "
                          "define them in the notebook or an importable module") from None
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)
    ipp_bounds.check(len(shipped), "the model, dataset and loss shipped to the engines",
                     "give a dataset that reads its samples from files on the engines (a torch Dataset keeping "
                     "paths, not tensors) or a model_fn that builds the model, not a module holding its weights")
    return shipped
