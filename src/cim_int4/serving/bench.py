"""``cim-int4 bench-serve``: the demo decoder (or a given model) at M = 1 through Ray Serve, beside a plain loop.

Each round measures, in this order: the plain single-process loop, the two-process CPU
independence check (see ``load``), then every serving configuration (replicas x batching,
``threads`` threads per replica) at each client count. Rounds repeat the whole order, so
drift of a shared machine hits every configuration alike; the tables give medians over
rounds. Targets checked: 2 replicas vs 1 (batching off, most clients), batching on vs off
(1 replica, most clients), and the serving overhead (p50 at 1 client minus the plain p50).
"""

from __future__ import annotations

import datetime
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from ..bench.machine import LoadMeter, cpu_model
from ..exporter import export_with_summary, save_model
from ..graphs import LlamaConfig, llama_decoder, model_feeds
from .load import Point, cpu_independence, direct_point, median_point, npz_body, serve_point


@dataclass(frozen=True)
class BenchOptions:
    """What ``bench-serve`` measures, and its bounds."""

    model: str | None = None  # None: the demo decoder (LlamaConfig defaults), exported here
    threads: int = 1
    clients: tuple[int, ...] = (1, 4, 16)
    replicas: tuple[int, ...] = (1, 2)
    max_batch: int = 16
    batch_wait_ms: float = 5.0
    requests: int = 3000  # per point, at most
    seconds: float = 6.0  # per point, at most
    rounds: int = 2
    port: int = 8000
    compute: str | None = "int8"  # the int8 kernels: what batching turns M = 1 calls into


def _configs(o: BenchOptions) -> list[tuple[str, int, int]]:
    out = []
    for batch in (1, o.max_batch):
        for replicas in o.replicas:
            label = f"{replicas} replica(s) x {o.threads} thread(s), batching {'on' if batch > 1 else 'off'}"
            out.append((label, replicas, batch))
    return out


def _model(o: BenchOptions, folder: Path) -> tuple[str, str]:
    if o.model is not None:
        return o.model, Path(o.model).name
    cfg = LlamaConfig()
    int4, _ = export_with_summary(llama_decoder(cfg), group_size=32)
    path = folder / "decoder.int4.onnx"
    save_model(int4, path)
    return str(path), f"demo decoder (llama {cfg.layers}L h{cfg.hidden} i{cfg.intermediate}, int4)"


def bench_serve(o: BenchOptions, progress=print) -> dict:  # noqa: ANN001
    """Run the benchmark (starts and stops a local Ray instance); the results as a JSON-ready dict."""
    from ray import serve

    from .app import ServeConfig, build_app, deploy
    from .cluster import start_http, start_ray, stop

    with tempfile.TemporaryDirectory(prefix="cim-int4-bench-serve.") as tmp:
        model, name = _model(o, Path(tmp))
        proto = onnx.load(model, load_external_data=False)
        dims = {"batch": 1, "seq": 1, "M": 1}
        feeds = [model_feeds(proto, shape_overrides=dims, seed=i) for i in range(64)]
        bodies = [npz_body(f) for f in feeds]
        meter = LoadMeter()
        rounds: list[dict] = []
        start_ray(None)
        try:
            start_http("127.0.0.1", o.port)
            for r in range(o.rounds):
                points = [
                    direct_point(model, feeds, o.requests, o.seconds, compute=o.compute, batch=batch)
                    for batch in sorted({1, o.max_batch})
                ]
                independence = cpu_independence(model, feeds[0], o.compute)
                progress(
                    f"round {r + 1}: plain loop {points[0].rps:.0f} req/s ({points[-1].rps:.0f} in batches of "
                    f"{o.max_batch}); two plain processes at once "
                    f"{independence and f'{independence:.2f}x'} one"
                )
                for label, replicas, batch in _configs(o):
                    deploy(
                        build_app(model, ServeConfig(replicas, o.threads, batch, o.batch_wait_ms, compute=o.compute))
                    )
                    serve_point(label, o.port, bodies, 4, 50, 10.0)  # warm-up
                    for clients in o.clients:
                        p = serve_point(label, o.port, bodies, clients, o.requests, o.seconds)
                        points.append(p)
                        progress(
                            f"  {label}, {clients} clients: {p.rps:.0f} req/s, p50 {p.p50_ms:.2f} ms, "
                            f"p99 {p.p99_ms:.2f} ms, {p.errors} errors"
                        )
                    serve.delete("cim-int4")
                rounds.append({"points": [asdict(p) for p in points], "cpu_independence": independence})
        finally:
            stop()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "model": name,
        "options": asdict(o),
        "other_load_cpus": meter.other_cpus(),
        "rounds": rounds,
    }


def medians(report: dict) -> list[Point]:
    """Each point's median over the rounds, in measurement order."""
    by_key: dict[tuple[str, int], list[Point]] = {}
    for r in report["rounds"]:
        for p in r["points"]:
            by_key.setdefault((p["label"], p["clients"]), []).append(Point(**p))
    return [median_point(ps) for ps in by_key.values()]


def targets(report: dict) -> dict[str, float]:
    """The ratios and the overhead the issue's targets name, from the medians."""
    pts = {(p.label, p.clients): p for p in medians(report)}
    o = report["options"]
    most, t = max(o["clients"]), o["threads"]

    def rps(replicas: int, on: bool, clients: int = most) -> float:
        return pts[(f"{replicas} replica(s) x {t} thread(s), batching {'on' if on else 'off'}", clients)].rps

    plain = pts[("plain loop, 1 process", 1)]
    one = pts[(f"1 replica(s) x {t} thread(s), batching off", 1)]
    out = {"serving_overhead_ms": one.p50_ms - plain.p50_ms}
    if 2 in o["replicas"] and 1 in o["replicas"]:
        out["two_vs_one_replica"] = rps(2, False) / rps(1, False)
    out["batching_on_vs_off"] = rps(1, True) / rps(1, False)
    batched = pts.get((f"plain loop, 1 process, {o['max_batch']} requests per call", o["max_batch"]))
    if batched is not None:  # the kernels' own gain from batching, without serving
        out["plain_batched_vs_single"] = batched.rps / plain.rps
    out["batching_on_p99_ms"] = pts[(f"1 replica(s) x {t} thread(s), batching on", most)].p99_ms
    return out


def format_report(report: dict) -> str:
    """The table of medians, the CPU-independence checks and the target figures, as text."""
    o = report["options"]
    lines = [
        f"cim-int4 bench-serve: {report['model']}, M = 1, compute {o['compute'] or 'as exported'}",
        f"on {report['cpu']}, {report['date']}",
        f"{o['rounds']} round(s); each point <= {o['requests']} requests and <= {o['seconds']} s; medians over rounds; "
        f"other processes kept {report['other_load_cpus'] or 0:.2f} CPUs busy on average",
        "two plain processes at once vs one, per round (2.0 = the two CPUs were independent): "
        + ", ".join(
            "n/a" if r["cpu_independence"] is None else f"{r['cpu_independence']:.2f}" for r in report["rounds"]
        ),
        "",
        f"{'configuration':<48} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'errors':>6}",
    ]
    for p in medians(report):
        lines.append(
            f"{p.label:<48} {p.clients:>7} {p.rps:>8.1f} {p.p50_ms:>8.2f} {p.p95_ms:>8.2f} {p.p99_ms:>8.2f} "
            f"{p.errors:>6.0f}"
        )
    lines.append("")
    lines += [f"{k}: {v:.2f}" for k, v in targets(report).items()]
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """p50 and p99 latency against the requests/s each configuration carried, one line per configuration."""
    from ..report import plot_lines

    panels: dict[str, dict[str, tuple[list[float], list[float]]]] = {"p50": {}, "p99": {}}
    for p in medians(report):
        for q, series in panels.items():
            xs, ys = series.setdefault(p.label, ([], []))
            xs.append(p.rps)
            ys.append(getattr(p, f"{q}_ms"))
    clients = ", ".join(map(str, report["options"]["clients"]))
    plot_lines(
        path,
        [(f"{q} latency, ms (log scale)", series) for q, series in panels.items()],
        xlabel=f"requests/s carried at {clients} concurrent clients (closed loop)",
        title=f"{report['model']}, M = 1, through Ray Serve - {report['cpu']}, {report['date'][:16]}",
        log_y=True,
    )
