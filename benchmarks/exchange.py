"""Exchange bandwidth: a pscluster push+pull (one fused PUSH_PULL round trip to every ps, with an SGD update
applied) of 1-256 MB of float32 parameters split over 1, 2 and 4 ps processes, through shared memory (a
worker on the ps's host) and over the socket (signed frames, as between hosts), against raw pyzmq
request/reply of the same bytes to as many server processes (each request sent before any reply is awaited);
and, when Ray is installed, a 100 MB model step (pull, then push-and-apply) against a Ray actor ps on the
same host.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import psutil
import torch
import zmq

from pscluster.runtime import protocol
from pscluster.runtime.client import PSClient

from . import procs
from .common import Result, Target, alternate, compare, repetitions, timed

LR = 1e-6
MB = 2**20


class RawServers:
    """``n`` raw REP server processes and a REQ socket to each."""

    def __init__(self, n: int):
        ports = procs.free_ports(n)
        self.procs = [procs.spawn("raw_zmq", port) for port in ports]
        self.socks = [zmq.Context.instance().socket(zmq.REQ) for _ in ports]
        for s, port in zip(self.socks, ports):
            s.connect(f"tcp://127.0.0.1:{port}")

    def round_trip(self, payloads: list) -> None:
        """Send one payload to each server, then receive every reply."""
        for s, p in zip(self.socks, payloads):
            s.send(p, copy=False)
        for s in self.socks:
            s.recv(copy=False)

    def close(self) -> None:
        for s in self.socks:
            s.send(b"")
            s.recv()
            s.close(linger=0)
        for p in self.procs:
            p.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def split(numel: int, num_ps: int) -> list[tuple[int, ...]]:
    """The shapes of ``numel`` float32 parameters split evenly over ``num_ps`` ps: one variable each."""
    return [(numel // num_ps,)] * num_ps


def cnn_shapes() -> list[tuple[int, ...]]:
    """The tensors of a BatchNorm conv net of 4.8 MB, as a worker exchanges them: 91 of them, 85 of at most
    64 KiB (each 3x3 convolution's BatchNorm weight, bias, running mean and variance, and the vectors of its
    other layers), 6 convolution weights of 7 KB to 1.2 MB and a 2 MB classifier."""
    shapes = []
    for channels, inputs in ((64, 3), (64, 32), (128, 64), (128, 64), (256, 128), (256, 128)):
        shapes += [(channels, inputs, 3, 3)] + [(channels,)] * 4
    return shapes + [(128,)] * 60 + [(1000, 512)]


class PSExchange:
    """A run of float32 variables of ``shapes`` (variable k on ps k modulo the ps count of ``cluster``), and two
    workers' round trips in it: ``shared`` (task 0) through shared-memory lanes, as a worker on the ps's host
    exchanges, and ``socket`` (task 1) over the socket, as between hosts, its replies received into the memory
    they are for (a worker's spares, see ``PSClient.receive_into``)."""

    def __init__(self, cluster: procs.PSProcesses, shapes: list[tuple[int, ...]], run_id: int):
        n = len(cluster.spec.ps)
        on_ps = {i: list(range(i, len(shapes), n)) for i in range(n)}
        self.grads = {i: (ids, [torch.full(shapes[k], 1.0) for k in ids]) for i, ids in on_ps.items()}
        configs = [procs.ps_config(*(f"v{k}" for k in ids), lr=LR, workers=2) for ids in on_ps.values()]
        self.clients = {"shared": PSClient(cluster.spec, task=0, timeout=300),
                        "socket": PSClient(cluster.spec, task=1, timeout=300)}
        received = [torch.empty(shape) for shape in shapes]
        self.clients["socket"].receive_into(lambda vid: received[vid])
        self.clients["shared"].init(run_id, self.grads, configs)
        for client in self.clients.values():
            client.run_id = run_id
        reply = self.clients["shared"].pull()
        self.step = reply.step
        if self.clients["shared"].share(reply) != list(range(n)):
            raise RuntimeError("no shared-memory lane to a ps on this host")

    def round_trip(self, how: str) -> None:
        self.step = self.clients[how].push_pull(self.step, self.grads).step

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def bandwidth(shapes: list[tuple[int, ...]], cluster: procs.PSProcesses, raw: RawServers, run_id: int,
              trips: int, rounds: int) -> dict[str, list[float]]:
    """GB/s (both ways) of a round trip of float32 variables of ``shapes``: pscluster through shared memory
    ("shared") and over the socket ("socket"), and raw ZeroMQ moving each ps's bytes in one frame ("raw");
    ``rounds`` alternating rounds of ``trips`` round trips."""
    ps = PSExchange(cluster, shapes, run_id)
    payloads = [torch.cat([t.reshape(-1) for t in tensors]).numpy() for _, tensors in ps.grads.values()]
    numel = sum(p.size for p in payloads)
    for warm_up in (lambda: ps.round_trip("shared"), lambda: ps.round_trip("socket"), lambda: raw.round_trip(payloads)):
        warm_up()
    gigabytes = 2 * numel * 4 / 1e9  # moved by one round trip, both ways

    def repeat(fn):
        trips_per_s = per_second(fn, trips)
        return lambda: gigabytes * trips_per_s()
    try:
        return alternate({"shared": repeat(lambda: ps.round_trip("shared")),
                          "socket": repeat(lambda: ps.round_trip("socket")),
                          "raw": repeat(lambda: raw.round_trip(payloads))}, rounds)
    finally:
        ps.close()


def stage_costs(megabytes: float, rounds: int) -> dict[str, float]:
    """Milliseconds (median of ``rounds``) of what a round trip does to ``megabytes`` of parameters besides moving
    them: encode + decode of one message (the wire format, signature included), one copy, one SGD apply."""
    t = torch.randn(int(megabytes * MB / 4))
    message = protocol.Message(op=protocol.Op.PUSH_PULL, ids=[0], tensors=[t])
    key = bytes(16)
    param = torch.nn.Parameter(t.clone())
    sgd = torch.optim.SGD([param], lr=LR)

    def apply():
        param.grad = t
        sgd.step()
    stages = {"encode + decode": lambda: protocol.decode(protocol.encode(message, key), key), "copy": t.clone,
              "SGD apply": apply}
    return {name: 1000 * statistics.median(timed(fn) for _ in range(rounds)) for name, fn in stages.items()}


def cpu_per_trip(megabytes: float, trips: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per round trip of ``megabytes`` to 1 server, raw ZeroMQ ("raw") and pscluster over the socket ("socket"):
    the CPU milliseconds of this process and of the server process (every thread, ZeroMQ's I/O threads
    included), the wall milliseconds, and the cores that keeps busy; medians of ``rounds`` alternating rounds of
    ``trips`` round trips (enough to outlast the 10 ms ticks CPU time is counted in)."""
    with RawServers(1) as raw, procs.PSProcesses(1) as cluster:
        ps = PSExchange(cluster, split(int(megabytes * MB / 4), 1), run_id=1)
        payload = [np.ones(int(megabytes * MB), dtype=np.uint8)]
        trip = {"raw": lambda: raw.round_trip(payload), "socket": lambda: ps.round_trip("socket")}
        servers = {"raw": psutil.Process(raw.procs[0].pid), "socket": psutil.Process(cluster.pids[0])}
        samples = {how: {"cpu_ms": [], "wall_ms": []} for how in trip}
        for fn in trip.values():
            fn()
        for _ in range(rounds):
            for how, fn in trip.items():
                processes = [psutil.Process(), servers[how]]
                before = sum(sum(p.cpu_times()[:2]) for p in processes)
                wall = timed(lambda fn=fn: [fn() for _ in range(trips)])
                samples[how]["cpu_ms"].append(1000 * (sum(sum(p.cpu_times()[:2]) for p in processes) - before) / trips)
                samples[how]["wall_ms"].append(1000 * wall / trips)
        ps.close()
    out = {how: {k: statistics.median(v) for k, v in s.items()} for how, s in samples.items()}
    for numbers in out.values():
        numbers["cores_busy"] = numbers["cpu_ms"] / numbers["wall_ms"]
    return out


def per_second(fn, trips: int):
    """A measurement: calls of ``fn`` per second over ``trips`` calls."""
    return lambda: trips / timed(lambda: [fn() for _ in range(trips)])


def ray_step(megabytes: float, rounds: int) -> tuple[dict[str, list[float]], str | None]:
    """Steps/s of a pull + push-and-apply of ``megabytes`` with 1 ps: pscluster (one PUSH_PULL) against a Ray
    actor holding the parameters (pull = get its array, push = send the gradient it applies); or the reason
    it cannot run here."""
    try:
        import ray
    except ImportError as e:
        return {}, f"Ray is not installed ({e}): `make bench` installs it with the bench extra"
    numel = int(megabytes * MB / 4)

    @ray.remote
    class RayPS:
        def __init__(self):
            self.params = np.zeros(numel, dtype=np.float32)

        def pull(self):
            return self.params

        def push(self, grad):
            self.params -= LR * grad

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=max(8 * numel * 4, 2**28))
    try:
        actor = RayPS.remote()
        grad = np.ones(numel, dtype=np.float32)

        def ray_round():
            ray.get(actor.pull.remote())
            ray.get(actor.push.remote(grad))
        ray_round()
        with procs.PSProcesses(1) as cluster:
            ps = PSExchange(cluster, split(numel, 1), run_id=1)
            ps.round_trip("shared")
            try:
                return alternate({"pscluster": per_second(lambda: ps.round_trip("shared"), 3),
                                  "ray": per_second(ray_round, 3)}, rounds), None
            finally:
                ps.close()
    finally:
        ray.shutdown()


def run(tiny: bool, out_dir: Path) -> Result:
    torch.set_num_threads(1)  # as each ps and worker process has: the lane copies are not spread over threads
    sizes = (0.25, 1) if tiny else (1, 4, 16, 64, 256)
    ps_counts = (1, 2) if tiny else (1, 2, 4)
    result = Result("exchange", "Exchange bandwidth: pscluster push+pull against raw ZeroMQ request/reply", tiny)
    run_id = 1
    for num_ps in ps_counts:
        with procs.PSProcesses(num_ps) as cluster:
            with RawServers(num_ps) as raw:
                cases = [(f"{mb:g} MB", split(int(mb * MB / 4) // num_ps * num_ps, num_ps), mb) for mb in sizes]
                if num_ps == 1:  # a model's shape: most of its tensors small
                    cases.append(("4.8 MB in a conv net's 91 tensors", cnn_shapes(), 4.8))
                for case, shapes, mb in cases:
                    trips = 2 if tiny else max(1, int(16 // mb))
                    gbps = bandwidth(shapes, cluster, raw, run_id, trips, repetitions(tiny))
                    run_id += 1
                    target = Target(0.9) if mb >= 4 else None
                    result.rows.append(compare(f"{case}, {num_ps} ps, same host", "pscluster, shared memory",
                                               gbps["shared"], "raw ZeroMQ", gbps["raw"], "GB/s", target))
                    result.rows.append(compare(f"{case}, {num_ps} ps, socket", "pscluster, socket (as between hosts)",
                                               gbps["socket"], "raw ZeroMQ", gbps["raw"], "GB/s", target))
    if tiny:
        result.notes.append("Ray step: not run in tiny mode (starting Ray takes tens of seconds)")
    else:
        steps, reason = ray_step(100, repetitions(tiny))
        if reason:
            result.skipped = f"Ray step: {reason}"
        else:
            result.rows.append(compare("100 MB step, same host, 1 ps", "pscluster", steps["pscluster"],
                                       "Ray actor ps", steps["ray"], "steps/s", Target(1.0)))
    costs = stage_costs(1 if tiny else 16, repetitions(tiny))
    cpu = cpu_per_trip(1 if tiny else 16, 4 if tiny else 32, repetitions(tiny))
    result.extra["stage_ms"] = costs
    result.extra["cpu_per_trip"] = cpu
    mb = 1 if tiny else 16
    raw, sock = cpu["raw"], cpu["socket"]
    cores = psutil.cpu_count()
    result.notes.append(f"What a round trip does to {mb} MB besides moving it, in this process (median ms): "
                        + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()) + ".")
    result.notes.append(f"CPU per {mb} MB round trip to 1 ps (client and server process, every thread): raw ZeroMQ "
                        f"{raw['cpu_ms']:.1f} ms in {raw['wall_ms']:.1f} ms ({raw['cores_busy']:.2f} cores busy), "
                        f"pscluster's socket {sock['cpu_ms']:.1f} ms in {sock['wall_ms']:.1f} ms "
                        f"({sock['cores_busy']:.2f} cores busy). On {cores} cores a round trip of that CPU takes at "
                        f"least {sock['cpu_ms'] / cores:.1f} ms: the socket ratio here is at most "
                        f"{raw['wall_ms'] / max(sock['cpu_ms'] / cores, raw['wall_ms']):.2f}.")
    result.notes.append("ps tasks and raw servers are processes (python -m pscluster.runtime, and raw_zmq.py); "
                        "the client is the benchmark process. GB/s counts bytes both ways. With more processes "
                        "than cores, servers and client share them.")
    return result

