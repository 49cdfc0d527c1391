"""The pscluster error family.

Every message is one line that says what to do about it; the magics print it
without a traceback.
"""

import traceback


class PSClusterError(Exception):
    """Base class of every error pscluster raises on purpose."""


class ConfigError(PSClusterError, ValueError):
    """A bad argument, option or configuration value."""


class ClusterStateError(PSClusterError, RuntimeError):
    """The cluster is not in a state that allows the request (not started, already running...)."""


class ProtocolError(PSClusterError):
    """A data-plane message was malformed, unsigned, wrongly signed, replayed or of another protocol version.

    ``counter``: the ps counter a dropped message of this kind is counted under.
    """

    counter = "malformed"


class MalformedMessage(ProtocolError):
    """A message that does not fit the wire format or its limits, or a signed request a ps cannot serve."""


class Refused(ProtocolError):
    """A signed request that fits the protocol but not the moment: a checkpoint of a step the ps has passed, or
    past the run's end (the controller's own, racing the run). Answered with an error, and never counted as a
    rejection: nobody sent it in malice."""

    counter = None


class UnsignedMessage(ProtocolError):
    """A message without a signature frame."""

    counter = "unsigned"


class BadSignature(ProtocolError):
    """A message whose signature does not verify with this cluster's secret."""

    counter = "bad_signature"


class ReplayedMessage(ProtocolError):
    """A correctly signed message that is not fresh: sent before, or from a session this ps did not open."""

    counter = "replayed"


class RuntimeTimeout(PSClusterError, TimeoutError):
    """A peer did not answer within its timeout."""


class TrainingError(PSClusterError, RuntimeError):
    """Training failed on a worker or ps task."""


class NonFiniteUpdate(TrainingError):
    """An update a ps refused, nothing of it applied: it would have made a value or an optimizer slot NaN or
    infinite (see ``runtime.update_guard``)."""


class DamagedStore(PSClusterError, RuntimeError):
    """The run store's file is not a whole SQLite database (truncated, overwritten): SQLite says so when it is
    opened, and it is refused then, with its path and what to do."""


class CheckpointError(PSClusterError, RuntimeError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class OtherRun(ProtocolError):
    """A metrics batch of another run than the collector's (a worker of a run its restarted chief replaced, still
    sending to the same address)."""

    counter = "other_run"


class FencedOff(ProtocolError):
    """A request of a session of a worker the run declared lost (it hung, and was replaced): refused with an
    answer that ends the stale worker, so it never trains beside its replacement."""

    counter = "fenced"


class RunFault(TrainingError):
    """A worker's attempt ended by the run, not by the worker's code (a ps lost, the task replaced, the run started
    again): its engine formats the traceback plainly (``_render_traceback_``, which IPython takes instead of its
    own). IPython's own reads and parses the source of every frame: 0.4-0.8 s on a loaded engine after a lost ps,
    which the worker's next attempt, started on the same engine, waited behind."""

    def _render_traceback_(self) -> list[str]:
        return "".join(traceback.format_exception(self)).splitlines()


class RunOver(RunFault):
    """The ps tasks serve a newer run than the one a request is about: its chief started it again (a script's
    chief restarted), so a worker of the old one joins the new."""


class StaleTask(RunFault):
    """This task was declared lost and replaced while it did not answer: it must end (see ``FencedOff``)."""


class PeerLost(RunFault):
    """A ps task's connection dropped while a request waited on it."""


class NonFiniteError(TrainingError):
    """A worker computed a non-finite loss or gradient (and the run's ``on_nonfinite`` is ``"fail"``)."""


class RunEnded(PSClusterError):
    """The run is over (its step target, a stop from anywhere, ``ctx.request_stop``) and the loop went on:
    ``optimizer.step()`` after the end raises it, and so does an epoch of ``ctx.shard`` begun after it. Not a
    failure: ``cluster.run``, ``%%pscluster run``,
    ``pscluster launch`` and a script's process treat it as the loop's normal end (status ``finished`` or
    ``stopped``, exit 0, one line saying why). ``reason``: why the run ended."""

    def __init__(self, reason: str):
        super().__init__(f"the run has ended ({reason}): the loop's step or epoch after its end was not taken")
        self.reason = reason
