"""The serving load benchmark (``cim-int4 bench-serve``): clients on 127.0.0.1 against Serve, and a plain loop.

Closed loop: ``clients`` threads, each with one keep-alive connection, send the next request
as soon as the last is answered, until ``max_requests`` are sent or ``max_seconds`` pass
(both bounds always hold). Requests/s is answered requests over the wall time; latencies
are per request, client side. The plain baselines run the same requests on a direct ORT
session: in this process (1 thread), and in two processes at once pinned to two CPUs, whose
combined rate over the single one says how independent the two CPUs were during the round
(2.0: fully; about 1.2-1.4: they shared a physical core or others kept one busy).
"""

from __future__ import annotations

import http.client
import io
import itertools
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..ops import make_session
from .tensors import NPZ_MEDIA_TYPE, concat

HOST = "127.0.0.1"  # the benchmark and the tests only ever send to this machine
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Exchange:
    """One request: its index in the run, HTTP status (0: no answer), latency and response body."""

    index: int
    status: int
    seconds: float
    body: bytes


def npz_body(feeds: dict[str, np.ndarray]) -> bytes:
    """An .npz request body of ``feeds``."""
    buffer = io.BytesIO()
    np.savez(buffer, **feeds)
    return buffer.getvalue()


def send_load(
    port: int,
    bodies: Sequence[bytes],
    clients: int,
    max_requests: int,
    max_seconds: float,
    path: str = "/v1/infer",
    content_type: str = NPZ_MEDIA_TYPE,
    on_answer: Callable[[int], None] | None = None,
) -> tuple[list[Exchange], float]:
    """Send requests (request i has body ``bodies[i % len]``) from ``clients`` threads; (exchanges, wall seconds).

    ``on_answer(count)`` is called after each answer with the number answered so far.
    """
    counter = itertools.count()
    lock = threading.Lock()
    exchanges: list[Exchange] = []
    deadline = time.monotonic() + max_seconds

    def client() -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
        try:
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter)
                if i >= max_requests:
                    return
                t0 = time.perf_counter()
                try:
                    conn.request("POST", path, body=bodies[i % len(bodies)], headers={"Content-Type": content_type})
                    response = conn.getresponse()
                    status, body = response.status, response.read()
                except (OSError, http.client.HTTPException) as e:
                    conn.close()  # reconnect on the next request
                    status, body = 0, str(e).encode()
                done = Exchange(i, status, time.perf_counter() - t0, body)
                with lock:
                    exchanges.append(done)
                    answered = len(exchanges)
                if on_answer is not None:
                    on_answer(answered)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + REQUEST_TIMEOUT_S)
    return sorted(exchanges, key=lambda e: e.index), time.perf_counter() - t0


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p95 and p99 of latencies in seconds, in ms."""
    if not seconds:
        return {"p50_ms": float("nan"), "p95_ms": float("nan"), "p99_ms": float("nan")}
    p = np.percentile(np.asarray(seconds) * 1e3, [50, 95, 99])
    return {"p50_ms": float(p[0]), "p95_ms": float(p[1]), "p99_ms": float(p[2])}


@dataclass(frozen=True)
class Point:
    """One measured load point."""

    label: str
    clients: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @classmethod
    def of(cls, label: str, clients: int, latencies: Sequence[float], errors: int, wall: float) -> Point:
        n = len(latencies)
        return cls(label, clients, n, errors, wall, n / wall if wall > 0 else 0.0, **percentiles_ms(latencies))


def serve_point(label: str, port: int, bodies: Sequence[bytes], clients: int, requests: int, seconds: float) -> Point:
    """Requests/s and latency of Serve at ``clients`` concurrent clients."""
    exchanges, wall = send_load(port, bodies, clients, requests, seconds)
    ok = [e.seconds for e in exchanges if e.status == 200]
    return Point.of(label, clients, ok, len(exchanges) - len(ok), wall)


def direct_point(
    model: str, feeds: Sequence[dict], requests: int, seconds: float, compute: str | None = None, batch: int = 1
) -> Point:
    """The plain single-process loop (1 thread): the same requests run on a direct session, ``batch`` per call.

    With ``batch`` > 1 consecutive requests are concatenated along axis 0 (as Serve's batching
    does), so the point shows what the kernels give without any serving around them.
    """
    session = make_session(model, threads=1, compute=compute)
    names = [o.name for o in session.get_outputs()]
    calls = [concat([feeds[(i + j) % len(feeds)] for j in range(batch)]) for i in range(0, len(feeds), batch)]
    session.run(names, calls[0])  # warm-up
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    t0 = time.perf_counter()
    for i in range(0, requests, batch):
        if time.monotonic() >= deadline:
            break
        t = time.perf_counter()
        session.run(names, calls[(i // batch) % len(calls)])
        latencies += [time.perf_counter() - t] * batch
    label = "plain loop, 1 process" + (f", {batch} requests per call" if batch > 1 else "")
    return Point.of(label, batch, latencies, 0, time.perf_counter() - t0)


def _plain_rate(model: str, feeds: dict, compute: str | None, cpu: int, seconds: float, start: float) -> float:
    os.sched_setaffinity(0, {cpu})
    session = make_session(model, threads=1, compute=compute)
    names = [o.name for o in session.get_outputs()]
    session.run(names, feeds)
    while time.time() < start:  # both processes measure the same window
        time.sleep(0.001)
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        session.run(names, feeds)
        runs += 1
    return runs / (time.perf_counter() - t0)


def cpu_independence(model: str, feeds: dict, compute: str | None = None, seconds: float = 2.0) -> float | None:
    """Runs/s of two plain processes at once on CPUs 0 and 1 over one process alone (None with < 2 CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        alone = pool.apply(_plain_rate, (model, feeds, compute, cpus[0], seconds, 0.0))
        start = time.time() + 3.0  # time for both to load the model
        both = [pool.apply_async(_plain_rate, (model, feeds, compute, cpu, seconds, start)) for cpu in cpus[:2]]
        together = sum(r.get(timeout=60 + seconds) for r in both)
    return together / alone


def median_point(points: Sequence[Point]) -> Point:
    """Per-field median of the same point measured in several rounds."""
    fields = {k: statistics.median(getattr(p, k) for p in points) for k in asdict(points[0]) if k not in ("label",)}
    fields["clients"] = points[0].clients
    return Point(label=points[0].label, **fields)
