"""What a ``%%pscluster`` cell is made into: the function of a ``run`` cell, the names a ``train`` cell binds."""

from __future__ import annotations

import ast
import textwrap

TRAIN_FN = "train_fn"  # the name a %%pscluster run cell's function has in its tracebacks


def cell_function(cell: str, namespace: dict):
    """``def train_fn(ctx): <the cell>``, defined in ``namespace`` (the notebook's, so that the cell sees its names
    and the function is shipped to the engines with those it uses), without binding a name there."""
    source = f"def {TRAIN_FN}(ctx):\n" + (textwrap.indent(cell, "    ") if cell.strip() else "    pass\n")
    scope: dict = {}
    exec(compile(source, "<%%pscluster run>", "exec"), namespace, scope)
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
