"""Ray and Serve for the serving commands and tests: start a local instance or join a cluster, start HTTP, stop."""

from __future__ import annotations

import sys
import threading


def start_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at ``address``, or start a local Ray instance (``num_cpus`` CPUs, default all)."""
    import ray

    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    else:
        ray.init(address=address, configure_logging=False)


def start_http(host: str, port: int, access_log: bool = False) -> None:
    """Start Serve with its HTTP proxy on ``host:port``; ``access_log``: a log line per request (costs CPU)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": access_log})


# Serve's own graceful stop waits up to 30 s for its controller, then Ray's stop follows: on a loaded
# machine the two took over a minute after a Ctrl-C once. Serve gets this long; Ray's stop ends the rest.
SERVE_STOP_S = 15.0


def stop(serve_timeout_s: float = SERVE_STOP_S) -> None:
    """Shut down Serve (waiting ``serve_timeout_s`` at most) and this process's Ray connection.

    A local Ray instance stops with the connection, its Serve actors with it.
    """
    import ray
    from ray import serve

    done, abandoned = threading.Event(), threading.Event()

    def shutdown_serve() -> None:
        try:
            serve.shutdown()
        except Exception as e:  # noqa: BLE001 - reported; Ray's stop below still runs
            if not abandoned.is_set():  # after the timeout Ray's stop may well make it fail: no noise then
                print(f"cim-int4: Serve did not shut down cleanly ({type(e).__name__}: {e})", file=sys.stderr)
        finally:
            done.set()

    threading.Thread(target=shutdown_serve, name="serve-shutdown", daemon=True).start()
    try:
        if not done.wait(serve_timeout_s):
            abandoned.set()
            print(f"cim-int4: Serve did not stop within {serve_timeout_s:g} s; stopping Ray", file=sys.stderr)
    finally:  # a second Ctrl-C during the wait still stops Ray
        ray.shutdown()
