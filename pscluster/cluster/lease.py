"""The lease a run's owner holds on its row of the run store.

The process that follows a run (its ``Supervisor``: a notebook's kernel, a script's chief, a process that
adopted a detached cluster's run) renews the lease every ``RENEW_S`` from a thread of its own, whatever its
monitor is doing (a recovery may take longer than the lease), until the run has ended. A process killed
outright renews nothing: its run, not ended, reads ``failed`` ("owner lost") to every reader of the store
within ``store.LEASE_S`` (see ``RunStore.runs``), with no process left to write it.

A script's run holds a lease on its ps tasks too (``hold_ps_tasks``): a ps serving that one run ends once
``PS_LEASE_S`` of its serving pass without a renewal (``runtime.ps``: ``owner_lost``), instead of listening with
nobody left.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import weakref

from ..metrics.store import LEASE_S, RunStore
from ..runtime.client import PSClient
from ..runtime.protocol import Op
from ..spec import ClusterSpec

RENEW_S = LEASE_S / 4  # three renewals may be late (a loaded machine, a busy store) before the lease runs out
# how long a ps outlives its run's owner: a chief started again by its scheduler (or by hand) takes the ps tasks
# over by then (it imports torch, loads its data and starts its run, on a loaded machine too)
PS_LEASE_S = 30.0


class Lease:
    """This process's lease on run ``run_id`` of ``store``, taken now and renewed while ``holder`` (the run's
    supervisor) exists, until ``release()``."""

    def __init__(self, store: RunStore, run_id: int, holder: object):
        self.owner = f"pid {os.getpid()} on {socket.gethostname()}"
        self._store, self._run_id = store, run_id
        self._holder = weakref.ref(holder)  # a supervisor never started (its run failed to start) lets it go
        self._released = threading.Event()
        store.renew_lease(run_id, self.owner)
        threading.Thread(target=self._renew, name=f"pscluster-lease-{run_id}", daemon=True).start()

    def _renew(self) -> None:
        while not self._released.wait(RENEW_S) and self._holder() is not None:
            try:
                self._store.renew_lease(self._run_id, self.owner)
            except sqlite3.Error:  # the store busy past its timeout, or closed: the next renewal may pass
                pass

    def release(self) -> None:
        """Stop renewing (the run has ended and says so)."""
        self._released.set()


def hold_ps_tasks(spec: ClusterSpec, run_id: int, owner: str, ended: threading.Event) -> None:
    """Renew ``owner``'s lease on run ``run_id`` on every ps task of ``spec``, now and every ``RENEW_S``, from a
    thread of its own, until ``ended`` is set. A ps that does not answer within ``RENEW_S / 2`` (lost, or busy)
    holds up none of the others."""

    def renew():
        while True:
            for ps in spec.ps:
                try:
                    with PSClient(spec, run_id=run_id, timeout=RENEW_S / 2, only=[ps.index]) as client:
                        client.request(Op.STATS, meta={"lease": {"owner": owner, "seconds": PS_LEASE_S}})
                except Exception:  # noqa: BLE001 - lost or busy: a later renewal may pass
                    pass
            if ended.wait(RENEW_S):
                return

    threading.Thread(target=renew, name=f"pscluster-ps-lease-{run_id}", daemon=True).start()
