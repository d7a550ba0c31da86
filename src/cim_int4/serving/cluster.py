"""Ray and Serve for the serving commands and tests: start a local instance or join a cluster, start HTTP, stop."""

from __future__ import annotations


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


def stop() -> None:
    """Shut down Serve and this process's Ray connection (a local instance stops with it)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
