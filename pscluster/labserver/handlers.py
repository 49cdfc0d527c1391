"""Thin tornado handlers under ``<base_url>/pscluster/api/``: parse, call LabService, answer JSON (or a file:
a run's metrics as CSV or Parquet); and under ``<base_url>/pscluster/static/``, plotly.js (``plotly.min.js``) and
the notebook's own drawing of its figures for the side panel (``figures.js``: ``widgets.live.PANEL_SCRIPT``).

A run is named by its id and, as the query argument ``store``, the path of its run store (the
``store`` of its RunInfo; default: the default store).

Every verb is authenticated like any Jupyter API handler. Store and control calls may wait
(a lock, a busy kernel), so they run in a thread and never block the server.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import plotly
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import IOLoop

from ..widgets.live import PANEL_SCRIPT
from .models import ErrorReply, to_json
from .service import MAX_POINTS, ApiError, LabService

SERIES_POINTS = 2000        # points per worker of a series when the request does not say
CSV_CHUNK = 20_000          # rows per chunk of a streamed CSV or JSON download
PLOTLY_CACHE_S = 7 * 86400  # plotly.js changes with the plotly package only
TASK = r"clusters/(?P<name>[^/]+)/tasks/(?P<role>ps|chief|worker)/(?P<index>\d+)"
LARGEST_ID = 2**63 - 1      # SQLite's largest integer: no run id (nor task index) is larger
FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")  # a CSV cell beginning so is a formula to a spreadsheet


def digits(value: str) -> bool:
    """Whether ``value`` is ASCII digits only (``str.isdigit`` and the routes' ``\\d`` take ``²`` too, which
    ``int()`` refuses)."""
    return value.isascii() and value.isdigit()


def whole_number(value: str, what: str) -> int:
    """``value`` (digits, as the routes take them) as an int; 400 naming ``what`` for other digits than ASCII's or
    past ``LARGEST_ID`` (a number of thousands of digits included, which ``int()`` itself refuses)."""
    if not digits(value):
        raise web.HTTPError(400, reason=f"{what} {value[:20]!r}: give it in the digits 0-9")
    if len(value) > len(str(LARGEST_ID)) or int(value) > LARGEST_ID:
        raise web.HTTPError(400, reason=f"{what} {value[:20]}{'...' if len(value) > 20 else ''} is larger than "
                                        f"any there can be ({LARGEST_ID}): give one that pscluster lists")
    return int(value)


def spreadsheet_safe(df):
    """``df`` with every column name and text cell that a spreadsheet would run as a formula quoted (``'``
    first, as spreadsheets themselves mark text)."""
    def safe(text):
        return "'" + text if isinstance(text, str) and text.startswith(FORMULA_LEADS) else text
    df = df.rename(columns=safe)
    text_columns = df.select_dtypes(include="object").columns
    return df.assign(**{c: df[c].map(safe) for c in text_columns}) if len(text_columns) else df


class _Handler(APIHandler):
    def initialize(self, service: LabService):
        self.service = service

    async def answer(self, fn, *args) -> None:
        try:
            payload = await IOLoop.current().run_in_executor(None, fn, *args)
        except ApiError as e:
            self.set_status(e.status)
            payload = ErrorReply(e.message)
        self.finish(json.dumps(to_json(payload)))

    def points(self, default: int | None) -> int | None:
        """The query argument ``points``: how many points per worker (2 to MAX_POINTS); ``default`` without it."""
        value = self.get_query_argument("points", "")
        if not value:
            return default
        if not digits(value) or len(value) > 9 or not 2 <= int(value) <= MAX_POINTS:
            raise web.HTTPError(400, reason=f"points={value!r}: give a number of points from 2 to {MAX_POINTS}")
        return int(value)

    def write_error(self, status_code: int, **kwargs) -> None:
        """Errors that tornado raises (a bad route argument...) as ``{"error": ...}`` too."""
        self.finish(json.dumps(to_json(ErrorReply(self._reason))))


class ClustersHandler(_Handler):
    @web.authenticated
    async def get(self):
        await self.answer(self.service.clusters)


class StopClusterHandler(_Handler):
    @web.authenticated
    async def post(self, name: str):
        await self.answer(self.service.stop_cluster, name)


class TaskActionHandler(_Handler):
    @web.authenticated
    async def post(self, name: str, role: str, index: str, action: str):
        await self.answer(self.service.task_action, name, role, whole_number(index, "task index"), action)


class RunsHandler(_Handler):
    @web.authenticated
    async def get(self):
        await self.answer(self.service.runs)


class SeriesHandler(_Handler):
    @web.authenticated
    async def get(self, run_id: str):
        names = self.get_query_argument("names", "")
        x = self.get_query_argument("x", "step")
        if x not in ("step", "time"):
            raise web.HTTPError(400, reason=f"x={x!r}: give x=step (global step) or x=time (seconds)")
        start, stop = self.number("start"), self.number("stop")
        if start is not None and stop is not None and start > stop:
            raise web.HTTPError(400, reason=f"start={start:g} is past stop={stop:g}: "
                                            "give a start no later than the stop")
        await self.answer(self.service.series, whole_number(run_id, "run id"), self.get_query_argument("store", None),
                          names.split(",") if names else None, x, start, stop, self.points(SERIES_POINTS))

    def number(self, name: str) -> float | None:
        """The query argument ``name`` as a finite number, or None without it."""
        value = self.get_query_argument(name, "")
        try:
            number = float(value) if value else None
        except ValueError:
            number = math.nan
        if number is not None and not math.isfinite(number):
            raise web.HTTPError(400, reason=f"{name}={value[:40]!r}: give a finite number, or leave it out")
        return number


class FiguresHandler(_Handler):
    @web.authenticated
    async def get(self, run_id: str):
        await self.answer(self.service.figures, whole_number(run_id, "run id"),
                          self.get_query_argument("store", None))


class CompareHandler(_Handler):
    """``?run=ID:STORE`` once per run (``ID`` alone: of the default store), ``metric`` (default: loss)."""

    @web.authenticated
    async def get(self):
        runs = [self.run(value) for value in self.get_query_arguments("run")]
        if len(runs) < 2:
            raise web.HTTPError(400, reason="give two runs or more to compare, each as run=ID:STORE "
                                            "(its id, then its store)")
        await self.answer(self.service.compare, runs, self.get_query_argument("metric", "loss"))

    def run(self, value: str) -> tuple[int, str | None]:
        run_id, _, store = value.partition(":")
        if not digits(run_id):
            raise web.HTTPError(400, reason=f"run={value[:40]!r}: give a run as ID:STORE, its id and its store")
        return whole_number(run_id, "run id"), store or None


class FiguresScriptHandler(JupyterHandler):
    """The script that draws the side panel's figures as the notebook draws its own (``PANEL_SCRIPT``)."""

    @web.authenticated
    def get(self):
        self.set_header("Content-Type", "text/javascript")
        self.set_header("Cache-Control", "no-cache")  # it changes with pscluster, and is small
        self.finish(PANEL_SCRIPT)


DOWNLOAD_TYPES = {"csv": "text/csv", "json": "application/json", "parquet": "application/vnd.apache.parquet"}


class DownloadHandler(_Handler):
    """The run's metrics as a file: raw rows, or with ``?points=N`` the whole run decimated; the header
    ``X-Pscluster-Content`` says which."""

    @web.authenticated
    async def get(self, run_id: str, kind: str):
        if kind == "parquet" and importlib.util.find_spec("pyarrow") is None:
            raise web.HTTPError(400, reason="metrics.parquet needs pyarrow where the Jupyter server runs: "
                                            "pip install pyarrow (or download metrics.csv)")
        points = self.points(None)
        try:
            df, content = await IOLoop.current().run_in_executor(
                None, self.service.download, whole_number(run_id, "run id"), self.get_query_argument("store", None),
                points)
        except ApiError as e:
            raise web.HTTPError(e.status, reason=e.message) from None
        self.set_header("Content-Type", DOWNLOAD_TYPES[kind])
        self.set_header("Content-Disposition", f'attachment; filename="run-{run_id}-metrics.{kind}"')
        self.set_header("X-Pscluster-Content", content)
        if kind == "parquet":
            self.finish(df.to_parquet(index=False))
            return
        if kind == "json":  # an array of one object per row, NaN as null, streamed as CSV is
            self.write("[")
        for first in range(0, max(len(df), 1), CSV_CHUNK):  # streamed: the header, then a chunk at a time
            chunk = df.iloc[first:first + CSV_CHUNK]
            if kind == "csv":
                self.write(spreadsheet_safe(chunk).to_csv(index=False, header=first == 0))
            elif len(chunk):
                self.write(("," if first else "") + chunk.to_json(orient="records")[1:-1])
            await self.flush()
        self.finish("]" if kind == "json" else None)


class PlotlyHandler(JupyterHandler, web.StaticFileHandler):
    """plotly.js of the installed plotly package, for the side panel and the notebook's live figures;
    cached by the browser for PLOTLY_CACHE_S."""

    @web.authenticated
    def get(self, path: str, include_body: bool = True):
        return web.StaticFileHandler.get(self, path, include_body)

    def get_cache_time(self, path, modified, mime_type) -> int:
        return PLOTLY_CACHE_S


class StopRunHandler(_Handler):
    @web.authenticated
    async def post(self, run_id: str):
        await self.answer(self.service.stop_run, whole_number(run_id, "run id"), self.get_query_argument("store", None))


def routes(base_url: str, service: LabService) -> list:
    """The API's routes under ``base_url``."""
    api = url_path_join(base_url, "pscluster", "api")
    return [(url_path_join(api, path), handler, {"service": service}) for path, handler in (
        ("clusters", ClustersHandler),
        (r"clusters/(?P<name>[^/]+)/stop", StopClusterHandler),
        (TASK + r"/(?P<action>kill|restart)", TaskActionHandler),
        ("runs", RunsHandler),
        (r"runs/(?P<run_id>\d+)/series", SeriesHandler),
        (r"runs/(?P<run_id>\d+)/figures", FiguresHandler),
        ("compare", CompareHandler),
        (r"runs/(?P<run_id>\d+)/metrics\.(?P<kind>csv|json|parquet)", DownloadHandler),
        (r"runs/(?P<run_id>\d+)/stop", StopRunHandler),
    )] + [(url_path_join(base_url, "pscluster", "static", r"(plotly\.min\.js)"), PlotlyHandler,
           {"path": str(pathlib.Path(plotly.__file__).parent / "package_data")}),
          (url_path_join(base_url, "pscluster", "static", r"figures\.js"), FiguresScriptHandler)]
