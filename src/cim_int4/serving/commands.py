"""``cim-int4 serve MODEL`` and ``cim-int4 bench-serve``: arguments, Ray started or joined, clean shutdown."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import time

from ..contract import COMPUTE_MODES
from .tensors import DEFAULT_MAX_BODY

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Mirrors app.DEFAULT_MAX_BATCH / DEFAULT_BATCH_WAIT_MS, which import Ray.
DEFAULT_MAX_BATCH = 16
DEFAULT_BATCH_WAIT_MS = 5.0
WAKE_S = 0.5  # how often the serving command's main thread wakes to notice a Ctrl-C


class MissingServe(Exception):
    """Ray Serve is not installed; the message says how to get it."""


def require_serve() -> None:
    """Raise MissingServe unless ``ray[serve]`` can be imported."""
    if any(importlib.util.find_spec(name) is None for name in ("ray", "fastapi")) or not _has_serve():
        raise MissingServe("serving needs Ray Serve: pip install 'cim-int4[serve]'")


def _has_serve() -> bool:
    try:
        return importlib.util.find_spec("ray.serve") is not None
    except ModuleNotFoundError:
        return False


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cim-int4 serve``."""
    p.add_argument("model", help="an ONNX file exported by cim-int4, or an onnxruntime-genai folder (cim-int4 genai)")
    p.add_argument("--replicas", type=int, default=1, help="replicas (each one process with one session)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per replica = CPUs Ray reserves for it")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"HTTP address to listen on (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--address",
        default=None,
        help="join a running Ray cluster (auto, or ray://HOST:10001); default: start a local Ray instance",
    )
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="requests per batch at most (1: off)")
    p.add_argument("--batch-wait-ms", type=float, default=DEFAULT_BATCH_WAIT_MS, help="how long a batch may wait")
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, metavar="BYTES", help="largest request body")
    _add_compute(p)
    p.add_argument("--access-log", action="store_true", help="log a line per request (Serve's access log)")


def _add_compute(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument(
        "--compute",
        choices=COMPUTE_MODES,
        default=default,
        help="compute mode of every CimInt4MatMul (session override; default: " + (default or "each node's own") + ")",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serve ``args.model`` until Ctrl-C, then shut down Serve and Ray."""
    require_serve()
    from .app import ServeConfig, build_app, deploy
    from .cluster import start_http, start_ray, stop

    config = ServeConfig(
        args.replicas, args.threads, args.max_batch, args.batch_wait_ms, args.max_body, compute=args.compute
    )
    take_stop_signals()  # before the server is up: a Ctrl-C as soon as it answers is never lost
    app = build_app(args.model, config)  # checks the model path before Ray starts
    start_ray(args.address)
    take_stop_signals()  # again: Ray's start replaced the SIGTERM handler
    try:
        start_http(args.host, args.port, args.access_log)
        deploy(app, args.access_log)
        where = "a local Ray instance" if args.address is None else f"the Ray cluster at {args.address}"
        print(
            f"cim-int4: serving {args.model} on http://{args.host}:{args.port} ({config.replicas} replica(s) x "
            f"{config.threads} thread(s), on {where}); Ctrl-C stops",
            flush=True,
        )
        wait_for_ctrl_c()
    except KeyboardInterrupt:
        print("cim-int4: shutting down", flush=True)
        return 0
    finally:
        stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def take_stop_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM raise KeyboardInterrupt in the main thread (call from it).

    A process started in the background of a script inherits SIGINT ignored, and SIGTERM (``kill``,
    ``docker stop``) should stop the server as cleanly; Ray's start installs its own SIGTERM handler.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def wait_for_ctrl_c() -> None:
    """Sleep until a KeyboardInterrupt, in short sleeps.

    A signal the kernel hands to another thread (Ray's) only sets Python's flag, which the main
    thread checks when its sleep ends: one long sleep never noticed it.
    """
    while True:
        time.sleep(WAKE_S)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cim-int4 bench-serve``."""
    p.add_argument("--model", default=None, help="an ONNX file exported by cim-int4 (default: the demo decoder)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per replica")
    p.add_argument("--clients", type=_ints, default=(1, 4, 16), metavar="N,N,..", help="concurrent clients per point")
    p.add_argument("--replicas", type=_ints, default=(1, 2), metavar="N,N,..", help="replica counts to measure")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="batch size when batching is on")
    p.add_argument("--batch-wait-ms", type=float, default=DEFAULT_BATCH_WAIT_MS)
    p.add_argument("--requests", type=int, default=3000, help="requests per point, at most")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per point, at most")
    p.add_argument("--rounds", type=int, default=2, help="repeats of the whole sequence (medians reported)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port on 127.0.0.1")
    _add_compute(p, "int8")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw latency vs load")


def run_bench(args: argparse.Namespace) -> int:
    """Run ``cim-int4 bench-serve`` and print its table."""
    require_serve()
    from ..report import check_plotting, write_json
    from .bench import BenchOptions, bench_serve, format_report, write_plot

    if args.plot:
        check_plotting()
    options = BenchOptions(
        model=args.model,
        threads=args.threads,
        clients=args.clients,
        replicas=args.replicas,
        max_batch=args.max_batch,
        batch_wait_ms=args.batch_wait_ms,
        requests=args.requests,
        seconds=args.seconds,
        rounds=args.rounds,
        port=args.port,
        compute=args.compute,
    )
    report = bench_serve(options)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
    if args.plot:
        write_plot(report, args.plot)
        print(f"cim-int4: wrote {args.plot}")
    return 0
