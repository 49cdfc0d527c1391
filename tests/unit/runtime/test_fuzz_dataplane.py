"""Fuzzing a live ps: thousands of hostile frames while two real sync workers train.

Frames are built by hypothesis strategies (structure) and byte-level mutation of real signed frames:
garbage and truncated messages (unsigned), flipped bytes, cut payloads and other clusters' keys (wrongly
signed), frames sent before, on this connection, an earlier one or an earlier ps (replayed), and signed,
fresh requests that do not fit the run (malformed: beyond its limits, unknown variables, negative steps,
wrong dtypes, bad headers and JSON). The ps must count each under its reason, answer the signed requests it
refuses with ERROR, and end the run on the very parameters of the same run without fuzzing.

The workers are held on their data by a gate the fuzzer opens one step at a time, so every chunk of frames
arrives while the run trains (sync, two replicas: the sum of two gradients does not depend on their order).
"""

import threading

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pscluster.datasets import digits
from pscluster.runtime import protocol
from pscluster.runtime.protocol import Message, Op
from pscluster.runtime.ps import ParameterServer
from pscluster.runtime.router import REJECTED
from pscluster.runtime.waiting import wait_until
from pscluster.runtime.worker import run_worker

from ..conftest import RUN_ID, make_spec
from .rawpeer import RawPeer
from .test_worker_inprocess import make_plan, mlp

CHUNKS, CHUNK = 100, 110  # hypothesis examples, frames per example: over 10,000 frames
STEPS = CHUNKS + 20


class Gated:
    """A dataset whose batches are handed out only as the gate releases them (``open``: all at once)."""

    supports_batch_index = True

    def __init__(self, dataset, *, opened: bool = False):
        self.dataset = dataset
        self.tokens = threading.Semaphore(0)
        self.opened = threading.Event()
        if opened:
            self.open()

    def open(self) -> None:
        self.opened.set()
        self.tokens.release(10**6)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, torch.Tensor) and not self.opened.is_set():
            assert self.tokens.acquire(timeout=60), "the fuzzer stopped releasing steps"
        return self.dataset[index]


def train(spec, server: ParameterServer, gate: Gated, fuzz=None) -> dict[int, torch.Tensor]:
    """A sync run of two workers on ``server`` (while ``fuzz()`` runs, if given); its final parameters."""
    plan = make_plan(spec, steps=STEPS, replicas=2)
    done, errors = {}, []

    def work(i):
        try:
            done[i] = run_worker(spec, i, plan, mlp, gate, torch.nn.CrossEntropyLoss())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    gate.tokens.release(2)  # each worker draws its first batch before the run starts
    workers[0].start()
    # worker 1 builds its model once the chief has sent its own: both seed and draw from torch's global RNG
    assert wait_until(lambda: server.run is not None or errors, 30) and not errors, errors
    workers[1].start()
    try:
        if fuzz is not None:
            fuzz()
    finally:
        gate.open()
        for w in workers:
            w.join(180)
    assert not errors, errors
    assert sorted(done) == [0, 1] and all(s["global_step"] == STEPS for s in done.values())
    assert server.run.applied == STEPS
    return {vid: p.detach().clone() for vid, p in zip(server.run.ids, server.run.params)}


def push(values: list[torch.Tensor], **fields) -> Message:
    return Message(**{"op": Op.PUSH, "task": 0, "run_id": RUN_ID, "ids": list(range(len(values))),
                      "tensors": values, **fields})


# --- the cases: each names the counter it must land in ---------------------------------------------

garbage = st.lists(st.binary(max_size=48), min_size=1, max_size=6)
CASES = st.one_of(
    st.tuples(st.just("garbage"), garbage),
    st.tuples(st.just("truncated"), st.integers(1, 3)),
    st.tuples(st.just("flipped"), st.integers(0, 7), st.integers(0, 2**20), st.integers(1, 255)),
    st.tuples(st.just("cut-payload"), st.integers(3, 6), st.integers(1, 64)),
    st.tuples(st.just("frame-dropped"), st.integers(0, 6)),
    st.tuples(st.just("other-key"), st.binary(min_size=16, max_size=16)),
    st.tuples(st.just("replay"), st.integers(0, 2**16)),
    st.tuples(st.just("unknown-variable"), st.integers(4, 2**32 - 1), st.integers(-2**40, 2**40)),
    st.tuples(st.just("negative-step"), st.integers(-2**63, -1)),
    st.tuples(st.just("wrong-dtype"), st.sampled_from([torch.float64, torch.float16, torch.int32])),
    st.tuples(st.just("rows-of-dense"), st.integers(0, 3)),
    st.tuples(st.just("header"), st.sampled_from(["magic", "version", "op", "flags", "count"]), st.integers(1, 200)),
    st.tuples(st.just("json"), st.binary(max_size=40)),
    st.tuples(st.just("oversized"), st.integers(30_000, 60_000)),
    st.tuples(st.just("too-many-tensors"), st.integers(9, 24)),
)


class Fuzzer:
    """Builds and sends the frames of the cases; tallies the counter each must land in."""

    def __init__(self, spec, server: ParameterServer, template: list[torch.Tensor], captured: list):
        self.key = spec.key
        self.address = spec.ps[0].address
        self.server = server
        self.peer = RawPeer(self.address, self.key)
        earlier = RawPeer(self.address, self.key)  # a connection of this ps, closed before the fuzzing
        self.captured = captured + [earlier.hello(), *(self._accepted(earlier) for _ in range(3))]
        earlier.close()
        self.captured += [self.peer.hello(), *(self._accepted(self.peer) for _ in range(3))]
        self.template = template  # a correct gradient of every variable: never sent as such
        self.expected = dict.fromkeys(REJECTED, 0)
        self.errors = 0  # signed requests that must be answered with ERROR
        self.replies = 0
        self.sent = 0

    @staticmethod
    def _accepted(peer: RawPeer) -> list:
        frames = peer.signed(Message(op=Op.STATS))
        peer.send(frames)
        assert peer.reply(5000).op is Op.OK
        return frames

    def signed_push(self) -> list:
        """A correct push, signed in the fuzzer's session: only ever sent mutated."""
        return [bytes(memoryview(f)) for f in self.peer.signed(push(self.template, step=0))]

    def send(self, case) -> None:
        kind, *args = case
        counter, frames = self._build(kind, *args)
        self.peer.send(frames)
        self.expected[counter] += 1
        self.sent += 1

    def _build(self, kind, *args):
        if kind == "garbage":
            frames = list(args[0])
            if len(frames) >= 4 and len(frames[-1]) == protocol.MAC_SIZE:
                frames[-1] += b"x"
            return "unsigned", frames
        if kind == "truncated":
            return "unsigned", self.signed_push()[:args[0]]
        if kind == "flipped":
            frames = [bytearray(f) for f in self.signed_push()]
            frame = frames[args[0] % len(frames)]
            if not frame:
                frame += b"\x00"
            frame[args[1] % len(frame)] ^= args[2]
            return "bad_signature", frames
        if kind == "cut-payload":
            frames = self.signed_push()
            payload = 3 + (args[0] - 3) % (len(frames) - 4)  # one of the payload frames (the pack first)
            frames[payload] = frames[payload][:-args[1]]
            return "bad_signature", frames
        if kind == "frame-dropped":
            frames = self.signed_push()
            dropped = args[0] % (len(frames) - 1)  # any frame but the signature
            return "bad_signature", frames[:dropped] + frames[dropped + 1:]
        if kind == "other-key":  # another cluster's secret, in a session of this ps
            msg = push(self.template, step=0, nonce=self.peer.nonce, request_id=10**12)
            return "bad_signature", protocol.encode(msg, args[0])
        if kind == "replay":
            return "replayed", self.captured[args[0] % len(self.captured)]
        return self._malformed(kind, *args)

    def _malformed(self, kind, *args):
        """Signed by the fuzzer's session, fresh, and wrong: refused with ERROR or dropped undecoded."""
        answered = kind in ("unknown-variable", "negative-step", "wrong-dtype", "rows-of-dense")
        if kind == "unknown-variable":
            values = [t.clone() for t in self.template]
            frames = self.peer.signed(push(values, ids=[0, 1, 2, args[0]], step=max(0, args[1])))
        elif kind == "negative-step":
            frames = self.peer.signed(push(self.template, step=args[0]))
        elif kind == "wrong-dtype":
            frames = self.peer.signed(push([t.to(args[0]) for t in self.template], step=0))
        elif kind == "rows-of-dense":
            frames = self.peer.signed(Message(op=Op.PULL_ROWS, task=0, run_id=RUN_ID, ids=[args[0]],
                                              tensors=[torch.zeros(1, dtype=torch.int64)]))
        elif kind == "header":
            frames = self._bad_header(*args)
        elif kind == "json":
            frames = self._resigned(self.signed_push(), 2, b"}" + args[0])  # starts with "}" in any encoding
        elif kind == "oversized":
            frames = self.peer.signed(push([torch.zeros(args[0])], step=0))
        else:  # too-many-tensors
            frames = self.peer.signed(push([torch.zeros(1)] * args[0], step=0))
        self.errors += answered
        return "malformed", frames

    def _bad_header(self, field: str, n: int) -> list:
        fields = dict(zip(("magic", "version", "op", "flags", "task", "run_id", "nonce", "request_id", "step",
                           "value", "wait_us", "count", "salt"), protocol._HEADER.unpack(self.signed_push()[0])))
        fields[field] = {"magic": b"XSCL", "version": protocol.PROTOCOL_VERSION + n, "op": 100 + n % 100,
                         "flags": 8 + n % 200, "count": fields["count"] + n}[field]
        return self._resigned(self.signed_push(), 0, protocol._HEADER.pack(*fields.values()))

    def _resigned(self, frames: list, index: int, replacement: bytes) -> list:
        frames = frames[:-1]
        frames[index] = replacement
        return [*frames, protocol.mac(self.key, frames)]


@pytest.fixture(scope="module")
def dataset():
    ds = digits("train")
    ds.tensors()
    return ds


def test_a_live_ps_survives_fuzzing_and_trains_as_without_it(dataset):
    spec = make_spec(num_ps=1, num_workers=2)
    servers = [ParameterServer(spec.key).start() for _ in range(2)]  # the same cluster twice: a run, then its rerun
    try:
        quiet = spec.with_ps_ports([servers[0].port])
        expected = train(quiet, servers[0], Gated(dataset, opened=True))
        earlier = RawPeer(quiet.ps[0].address, quiet.key)  # frames of the earlier run, accepted there
        earlier.hello()
        template = [expected[vid] * 0.01 for vid in sorted(expected)]
        late_push = earlier.signed(push(template, step=STEPS))
        earlier.send(late_push)
        assert earlier.reply(5000).op is Op.OK
        earlier.close()

        fuzzed = spec.with_ps_ports([servers[1].port])
        server, gate = servers[1], Gated(dataset)
        fuzzer = None

        @settings(max_examples=CHUNKS, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(CASES, min_size=CHUNK, max_size=CHUNK))
        def fuzz(cases):
            gate.tokens.release(2)  # one more step for each worker, trained while this chunk arrives
            for case in cases:
                fuzzer.send(case)
            fuzzer.replies += fuzzer.peer.drain()  # its ERROR replies, read before its queue fills up

        def run_fuzz():
            nonlocal fuzzer
            fuzzer = Fuzzer(fuzzed, server, template, [late_push])
            fuzz()
            # every case refused before the run may end: an oversized push the ps reads once the run is over is
            # held to the server's limits, not the run's, and answered instead of dropped
            assert wait_until(lambda: sum(server.rejected.values()) >= sum(fuzzer.expected.values()), 60)

        got = train(fuzzed, server, gate, run_fuzz)
        total = sum(fuzzer.expected.values())
        assert fuzzer.sent == total >= 10_000
        assert wait_until(lambda: sum(server.rejected.values()) >= total, 30)
        assert dict(server.rejected) == fuzzer.expected
        # every reason was exercised (but fencing, which needs a worker declared lost: test_ps_server's)
        assert all(n for reason, n in fuzzer.expected.items() if reason != "fenced")
        assert server.running and server.failed_requests == 0

        def answered():
            fuzzer.replies += fuzzer.peer.drain()
            return fuzzer.replies >= fuzzer.errors
        assert wait_until(answered, 10) and fuzzer.replies == fuzzer.errors  # each refused request, answered
        assert got.keys() == expected.keys()
        for vid, value in expected.items():
            assert torch.equal(got[vid], value), vid
        fuzzer.peer.close()
    finally:
        for s in servers:
            s.shutdown()
