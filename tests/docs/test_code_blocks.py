"""Every ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` runs, as a doctest of its page.

- The blocks of one page run in order in one IPython shell, as the cells of one notebook: a later block sees what an
  earlier one defined, the magics work, and ``_`` is the last cell's value.
- Only the pages of ``CLUSTER_PAGES`` may start a cluster (marker ``integration``); they run with
  ``PSCLUSTER_SMOKE=1``, the small size their blocks read from ``pscluster.environ.smoke()`` or state themselves, so
  that this module stays within about 90 s on 2 cores. On any other page ``Cluster.start`` is refused: its blocks are
  pure examples (configuration, placement plans, errors).
- A block whose fence names a file (```` ```python title="train.py" ````) is a script, not a cell of its page: every
  task of a cluster runs it, one process each, so it cannot run in the page's shell. It must be in ``SCRIPTS``, which
  says why and what runs a script of its kind; here it is compiled.
- A ``text`` block of ``%pscluster`` lines alone shows clusters of other machines (SSH hosts, Slurm, MPI), which
  cannot start here: each line goes through its magic with ``Cluster.start`` left out, so that its flags are parsed
  and its cluster and launcher are built and checked as the magic builds them.
- Other blocks (``bash``, ``text``) are not run.

Everything runs in a temporary folder; every cluster a page started is stopped, and its processes checked dead.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import pscluster
from pscluster.cluster.handle import Cluster
from pscluster.cluster.reaper import alive

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# the pages whose blocks start a cluster: the landing page's quickstart and the guide, one cluster each
CLUSTER_PAGES = {"README.md", "docs/guide.md"}

# scripts (fences with a title): why each is not a cell of its page, and which test runs a script of its kind (a
# job of processes costs more than this module's whole budget: the tasks' start, and the ps tasks' end)
SCRIPTS = {
    "estimator.py": "seed 000's Distributed Estimator, train_from_environment() in every task of a TF_CONFIG job: "
                    "tests/integration/test_standalone.py runs that job, four processes",
    "train.py": "a script's own loop, pscluster.init() in every task: tests/integration/test_script_loop.py runs "
                "such a script under `pscluster launch` and as a TF_CONFIG job",
}

FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
PYTHON_ALIASES = ("py", "python3", "ipython", "pycon")  # write ```python, so that every Python block is run


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, from 1
    lang: str
    title: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, in order (a fence closes on a line of the same fence characters, at
    least as many, at the same indentation)."""
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        words = shlex.split(opened["info"].strip())
        lang = words[0] if words else ""
        attrs = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        body, j = [], i + 1
        while j < len(lines):
            closing = lines[j][len(indent):] if lines[j].startswith(indent) else None
            if closing is not None and closing.rstrip() and set(closing.rstrip()) == {fence[0]} and \
                    len(closing.rstrip()) >= len(fence):
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        assert j < len(lines), f"{page_name(path)}:{i + 1}: a fence that never closes"
        found.append(Block(page_name(path), i + 1, lang, attrs.get("title"), "\n".join(body) + "\n"))
        i = j + 1
    return found


ALL = {page_name(p): blocks(p) for p in PAGES}


def cells(page: str) -> list[Block]:
    return [b for b in ALL[page] if b.lang == "python" and b.title is None]


def scripts() -> list[Block]:
    return [b for page in ALL.values() for b in page if b.lang == "python" and b.title is not None]


def test_every_python_block_is_a_cell_or_a_named_script():
    """No Python block escapes: written ```python, and a titled one is a script this module knows."""
    for page in ALL.values():
        for b in page:
            assert b.lang not in PYTHON_ALIASES, f"{b.where}: write ```python (```{b.lang} blocks are not run)"
            if b.lang == "python" and b.title is not None:
                assert b.title in SCRIPTS, f"{b.where}: script {b.title!r} is not in SCRIPTS: say why it is not run"
    assert set(CLUSTER_PAGES) <= set(ALL), f"CLUSTER_PAGES names pages that do not exist: {CLUSTER_PAGES - set(ALL)}"
    assert all(cells(page) for page in CLUSTER_PAGES), "a page of CLUSTER_PAGES lost its blocks: update the list"


def test_scripts_compile():
    named = scripts()
    assert {b.title for b in named} == set(SCRIPTS), "SCRIPTS lists a script no page holds any more"
    for b in named:
        compile(b.code, b.where, "exec")


@pytest.fixture(scope="module")
def shell():
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    return get_ipython() or start_ipython()  # one shell a process: another module (test_magics, unit) may have made it


def _stop_clusters(shell) -> list[int]:
    """Stop every cluster the page left running (the magics' and any in its namespace), and leave the magics with
    no cluster and no run, as a new kernel has them; the clusters' pids."""
    found = [v for v in shell.user_ns.values() if isinstance(v, Cluster)]
    magics = shell.magics_manager.registry.get("PSClusterMagics")
    if magics is not None and magics.cluster is not None:
        found.append(magics.cluster)
    pids = []
    for cluster in {id(c): c for c in found}.values():
        pids += cluster.pids
        if cluster.running:
            cluster.stop()
    if magics is not None:
        magics.cluster, magics.last_run = None, None
    return pids


def run_page(shell, page: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PSCLUSTER_SMOKE", "1")
    if page not in CLUSTER_PAGES:
        def refuse(self):
            raise AssertionError(f"{page} starts a cluster: keep its blocks pure, or add it to CLUSTER_PAGES "
                                 "(each such page costs a cluster's start and runs)")

        monkeypatch.setattr(Cluster, "start", refuse)
    environ = dict(os.environ)
    shell.reset(new_session=False)
    started = time.monotonic()
    pids = []
    try:
        for block in cells(page):
            began = time.monotonic()
            result = shell.run_cell(block.code, store_history=True)
            error = result.error_before_exec or result.error_in_exec
            if error is not None:
                raise AssertionError(f"{block.where}: the block failed ({type(error).__name__}: {error}); its "
                                     "traceback is in the captured output") from error
            print(f"[{block.where}: {time.monotonic() - began:.1f} s]")
    finally:
        pids = _stop_clusters(shell)
        shell.reset(new_session=False)
        os.environ.clear()
        os.environ.update(environ)
    print(f"{page}: {len(cells(page))} blocks in {time.monotonic() - started:.1f} s")
    assert not [p for p in pids if alive(p)], f"{page}: cluster processes left running after stop()"


@pytest.mark.parametrize("page", [pytest.param(page, marks=pytest.mark.integration) if page in CLUSTER_PAGES else page
                                  for page in ALL if cells(page)])
def test_page_runs(page, shell, tmp_path, monkeypatch):
    run_page(shell, page, tmp_path, monkeypatch)


def magic_lines(block: Block) -> list[str]:
    """The lines of a ``text`` block that holds ``%pscluster`` lines alone (continuations joined); else none."""
    lines = [line.strip() for line in block.code.replace("\\\n", " ").splitlines() if line.strip()]
    return lines if block.lang == "text" and lines and all(line.startswith("%pscluster ") for line in lines) else []


def test_magic_lines_for_other_machines_build_their_cluster(shell, monkeypatch):
    found = [(b, line) for page in ALL.values() for b in page for line in magic_lines(b)]
    assert found, "no block of %pscluster lines: the multi-host examples moved, or this test is stale"
    monkeypatch.setattr(Cluster, "start", lambda self, **options: self)  # built and checked, never started
    shell.run_line_magic("load_ext", "pscluster")
    magics = shell.magics_manager.registry["PSClusterMagics"]
    monkeypatch.setattr(magics, "cluster", None)
    for block, line in found:
        command = line[len("%pscluster "):]
        try:
            cluster = shell.run_line_magic("pscluster", command)
        except Exception as e:
            raise AssertionError(f"{block.where}: {line}: {type(e).__name__}: {e}") from e
        assert isinstance(cluster, Cluster) and not cluster.running, f"{block.where}: {line}"
        magics.cluster = None


def test_pscluster_is_the_package_under_test():
    """The blocks import the checkout's package, not another installed copy."""
    assert Path(pscluster.__file__).resolve().is_relative_to(ROOT)
