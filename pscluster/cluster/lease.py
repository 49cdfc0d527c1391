"""The lease a run's owner holds on its row of the run store.

The process that follows a run (its ``Supervisor``: a notebook's kernel, a script's chief, a process that
adopted a detached cluster's run) renews the lease every ``RENEW_S`` from a thread of its own, whatever its
monitor is doing (a recovery may take longer than the lease), until the run has ended. A process killed
outright renews nothing: its run, not ended, reads ``failed`` ("owner lost") to every reader of the store
within ``store.LEASE_S`` (see ``RunStore.runs``), with no process left to write it.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import weakref

from ..metrics.store import LEASE_S, RunStore

RENEW_S = LEASE_S / 4  # three renewals may be late (a loaded machine, a busy store) before the lease runs out


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
