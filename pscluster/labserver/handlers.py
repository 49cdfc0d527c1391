"""Thin tornado handlers under ``<base_url>/pscluster/api/``: parse, call LabService, answer JSON.

A run is named by its id and, as the query argument ``store``, the path of its run store (the
``store`` of its RunInfo; default: the default store).

Every verb is authenticated like any Jupyter API handler. Store and control calls may wait
(a lock, a busy kernel), so they run in a thread and never block the server.
"""

from __future__ import annotations

import json

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import IOLoop

from .models import ErrorReply, to_json
from .service import ApiError, LabService

TASK = r"clusters/(?P<name>[^/]+)/tasks/(?P<role>ps|chief|worker)/(?P<index>\d+)"


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
        await self.answer(self.service.task_action, name, role, int(index), action)


class RunsHandler(_Handler):
    @web.authenticated
    async def get(self):
        await self.answer(self.service.runs)


class MetricsHandler(_Handler):
    @web.authenticated
    async def get(self, run_id: str):
        after = self.get_query_argument("after", "0")
        if not after.isdigit():
            raise web.HTTPError(400, reason=f"after={after!r}: give the cursor of the previous answer (0 to start)")
        await self.answer(self.service.metrics, int(run_id), int(after), self.get_query_argument("store", None))


class StopRunHandler(_Handler):
    @web.authenticated
    async def post(self, run_id: str):
        await self.answer(self.service.stop_run, int(run_id), self.get_query_argument("store", None))


def routes(base_url: str, service: LabService) -> list:
    """The API's routes under ``base_url``."""
    api = url_path_join(base_url, "pscluster", "api")
    return [(url_path_join(api, path), handler, {"service": service}) for path, handler in (
        ("clusters", ClustersHandler),
        (r"clusters/(?P<name>[^/]+)/stop", StopClusterHandler),
        (TASK + r"/(?P<action>kill|restart)", TaskActionHandler),
        ("runs", RunsHandler),
        (r"runs/(?P<run_id>\d+)/metrics", MetricsHandler),
        (r"runs/(?P<run_id>\d+)/stop", StopRunHandler),
    )]
