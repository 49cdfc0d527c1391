"""What the fuzz tests share: their hypothesis settings, and strategies for hostile requests.

``make test`` runs each with a bounded number of examples; ``make faults`` runs them ``PSCLUSTER_FUZZ_SCALE``
times longer (its Makefile target sets it)."""

import json
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = int(os.environ.get("PSCLUSTER_FUZZ_SCALE", "1"))


def fuzz_settings(examples: int):
    """Settings of a fuzz test of ``examples`` examples (times ``SCALE``): no deadline (a live server under load
    answers in its own time), its module's fixtures shared by every example."""
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16)
ENCODINGS = st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1", "cp1252"])


def nested(depth: int, opener: bytes, closer: bytes) -> bytes:
    """A JSON document ``depth`` levels deep: ``{"a":{"a":...1...}}`` or ``[[...1...]]``."""
    return opener * depth + b"1" + closer * depth


def encoded(value, encoding: str) -> bytes:
    """``value`` as JSON text in ``encoding`` (characters it cannot hold replaced)."""
    return json.dumps(value, ensure_ascii=False).encode(encoding, "replace")


# a JSON document nested up to 10,000 levels (at most 60,001 bytes: under the servers' 64 KiB request limit)
NESTED = st.tuples(st.integers(1, 10_000), st.sampled_from([(b'{"a":', b"}"), (b"[", b"]")])).map(
    lambda drawn: nested(drawn[0], *drawn[1]))
