"""What a ``%%pscluster`` cell is made into: the function of a ``run`` cell, the names a ``train`` cell binds."""

from __future__ import annotations

import ast

TRAIN_FN = "train_fn"  # the name a %%pscluster run cell's function has in its tracebacks


def cell_function(cell: str, shell):
    """``def train_fn(ctx): <the cell>``, defined in the shell's namespace (so that the cell sees the notebook's
    names and the function is shipped to the engines with those it uses), without binding a name there; a
    SyntaxError where the cell does not parse (its line counted as the notebook counts it, the magic's first).
    Its code is the cell's as IPython caches it, under the magic's line, so that a traceback names it
    ``Cell In[n]`` and shows its lines where the notebook shows them."""
    body = ast.parse("\n" + cell).body or [ast.Pass()]
    function = ast.FunctionDef(name=TRAIN_FN, args=ast.arguments(posonlyargs=[], args=[ast.arg("ctx")],
                                                                 kwonlyargs=[], kw_defaults=[], defaults=[]),
                               body=body, decorator_list=[], lineno=1, col_offset=0)
    module = ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[]))
    filename = shell.compile.cache(f"%%pscluster run\n{cell}", shell.execution_count)
    scope: dict = {}
    exec(compile(module, filename, "exec"), shell.user_ns, scope)
    return scope[TRAIN_FN]


def defined_names(cell: str) -> set[str]:
    """Names a cell binds at top level (assignments, loops, with, defs, imports; not inside
    function or class bodies); empty if the cell does not parse."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return set()
    names: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # names bound inside are local to it
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Lambda):
            continue
        pending.extend(ast.iter_child_nodes(node))
    return names
