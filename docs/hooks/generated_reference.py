"""MkDocs hook: the reference pages that are generated from the code, so that they never differ from it.

Each page holds a marker line that this hook replaces at build time:

- ``<!-- magics -->`` (``reference/magics.md``): each ``%pscluster`` command's ``--help`` text, from the argparse
  parsers the magics parse their lines with (``pscluster.magics.parsers``);
- ``<!-- options -->`` (``reference/options.md``): every option of a run, its default, its magic's flag and the
  entries that take it, from ``pscluster.runtime.options.OPTIONS``, where each option is defined once;
- ``<!-- launch -->`` (``reference/scripts.md``): ``pscluster launch --help``.
"""

from __future__ import annotations

import contextlib
import io
import os

WIDTH = 100  # argparse wraps its help to $COLUMNS: the same text on every machine

# the magics page's order: the lifecycle first, then what a running cluster answers
MAGICS = ("start", "train", "run", "status", "placement", "checkpoint", "kill", "scale", "attach", "tensorboard",
          "stop")
CELL_MAGICS = ("train", "run")


@contextlib.contextmanager
def _columns(width: int):
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def _code(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def magics_markdown() -> str:
    """Each command's heading, whether it is a line or a cell magic, and its ``--help`` text."""
    from pscluster.magics.parsers import parsers

    with _columns(WIDTH):
        by_command = parsers()
        missing = set(by_command) - set(MAGICS)
        if missing:  # a command added to the magics must be placed on the page
            raise RuntimeError(f"magics reference: place {sorted(missing)} in MAGICS of {__file__}")
        sections = []
        for name in MAGICS:
            prefix = "%%pscluster" if name in CELL_MAGICS else "%pscluster"
            kind = "cell magic: the options on its line, the code in its cell" if name in CELL_MAGICS else "line magic"
            sections.append(f"## `{prefix} {name}`\n\n*{kind}*\n\n{_code(by_command[name].format_help())}")
    return "\n".join(sections)


def options_markdown() -> str:
    """One table row per option of a run, in definition order."""
    from pscluster.runtime import options

    entries = [(options.TRAIN, "`train`"), (options.RUN, "`run`"), (options.SESSION, "`session`"),
               (options.SCRIPT, "`init`"), (options.TRAIN_SCRIPT, "`train_from_environment`")]
    read_by = {options.PLAN: "the workers and ps", options.START: "the run's start", options.BUILD: "the plan"}
    rows = ["| option | default | flag | taken by | read by | meaning |", "|---|---|---|---|---|---|"]
    for name, option in options.OPTIONS.items():
        by = ", ".join(label for entry, label in entries if entry in option.entries)
        flag = f"`{option.flag_name}`" if options.TRAIN in option.entries or options.RUN in option.entries else ""
        meaning = option.help.replace("|", "\\|")
        if option.choices:
            meaning += " (" + ", ".join(f"`{c}`" for c in option.choices) + ")"
        rows.append(f"| `{name}` | `{option.default!r}` | {flag} | {by} | {read_by[option.scope]} | {meaning} |")
    return "\n".join(rows) + "\n"


def launch_markdown() -> str:
    """``pscluster launch --help``, as its parser prints it."""
    from pscluster.launch import main

    out = io.StringIO()
    with _columns(WIDTH), contextlib.redirect_stdout(out):
        try:
            main(["--help"])
        except SystemExit:
            pass
    return _code(out.getvalue())


GENERATED = {
    "reference/magics.md": ("<!-- magics -->", magics_markdown),
    "reference/options.md": ("<!-- options -->", options_markdown),
    "reference/scripts.md": ("<!-- launch -->", launch_markdown),
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri not in GENERATED:
        return markdown
    marker, generate = GENERATED[page.file.src_uri]
    if marker not in markdown:
        raise RuntimeError(f"{page.file.src_uri} lost its marker {marker}: its generated part has nowhere to go")
    return markdown.replace(marker, generate())
