"""The pscluster error family.

Every message is one line that says what to do about it; the magics print it
without a traceback.
"""


class PSClusterError(Exception):
    """Base class of every error pscluster raises on purpose."""


class ConfigError(PSClusterError, ValueError):
    """A bad argument, option or configuration value."""


class ClusterStateError(PSClusterError, RuntimeError):
    """The cluster is not in a state that allows the request (not started, already running...)."""


class ProtocolError(PSClusterError):
    """A data-plane message was malformed, unsigned or of another protocol version."""


class RuntimeTimeout(PSClusterError, TimeoutError):
    """A peer did not answer within its timeout."""


class TrainingError(PSClusterError, RuntimeError):
    """Training failed on a worker or ps task."""


class CheckpointError(PSClusterError, RuntimeError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class PeerLost(TrainingError):
    """A ps task's connection dropped while a request waited on it."""
