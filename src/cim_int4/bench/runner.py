"""Runs a suite: builds every variant, measures each case interleaved against the probe, collects a Report."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np
import onnx

from ..graphs import random_input
from ..ops import make_session, physical_cores
from .machine import BUSY_CPUS, LoadMeter, machine_meta
from .memory import MemoryResult, empty_session_bytes, measure_memory
from .probe import BandwidthProbe
from .results import Report, Result
from .timing import interleaved, relative_error
from .variants import (
    BASELINE,
    VARIANTS,
    Variant,
    _environment,
    _unchanged,
    constant_bytes,
    int4_weight_bytes,
    quantize_cim_int4,
)
from .workloads import DEFAULT_THREADS, Case, Suite, Workload

RETRY_PAUSE_S = 3.0
# Untimed calls of the same variant before each timed one in a warm run (--warm).
WARM_CALLS = 4


class Progress:
    """Progress lines on a stream (stderr by default); silent when ``quiet``."""

    def __init__(self, stream=None, quiet: bool = False) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._open = False

    def _emit(self, text: str, final: bool) -> None:
        if self.quiet:
            return
        if self._tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
            self._open = not final
        elif final:
            self.stream.write(text + "\n")
        self.stream.flush()

    def step(self, text: str) -> None:
        """A line that stays."""
        self._emit(text, final=True)

    def update(self, text: str) -> None:
        """A line the next one overwrites (on a terminal; elsewhere not shown)."""
        self._emit(text, final=False)


def run_suite(
    suite: Suite,
    *,
    threads: Sequence[int] = DEFAULT_THREADS,
    variants: Sequence[Variant] = VARIANTS,
    cold: bool = True,
    probe: BandwidthProbe | None = None,
    progress: Progress | None = None,
) -> Report:
    """Measure every case of ``suite`` for every variant; see the module docstring for the method."""
    progress = progress or Progress()
    if variants[0].name != BASELINE:
        raise ValueError(f"the first variant must be {BASELINE!r}, the reference of speed-ups and errors")
    for v in variants:
        if v.check is not None:
            v.check()  # fail now, not after minutes of measuring
    affinity = os.sched_getaffinity(0)
    load = LoadMeter()
    try:
        physical_cores()  # read the allowed CPUs before any session narrows this thread's affinity
        if probe is None:
            progress.step("preparing the bandwidth probe buffer ...")
            probe = BandwidthProbe.for_this_machine(cap=suite.buffer_cap)
        bandwidth = {}
        for t in threads:
            bandwidth[t] = probe.bandwidth(t)
            progress.step(f"read bandwidth, {t} thread(s): {bandwidth[t] / 1e9:.1f} GB/s")
        report = Report(machine_meta(suite, probe, cold, threads), bandwidth, [])
        cases = suite.cases(threads)
        done = 0
        for workload in suite.workloads:
            progress.step(f"{workload.name}: building the graph and its variants ...")
            models = _build_variants(workload, variants, progress)
            weight_bytes = {name: constant_bytes(model) for name, model in models.items()}
            if suite.memory:
                if "empty_session_bytes" not in report.meta:
                    report.meta["empty_session_bytes"] = empty_session_bytes()
                progress.step(f"{workload.name}: resident memory of each variant's session (a process each) ...")
                report.memory += _memory(workload, variants, models, report.meta["empty_session_bytes"], progress)
            inputs = _inputs_only(models[BASELINE])
            for t in threads:
                sessions = _make_sessions(models, variants, t)
                for m in suite.ms:
                    case = Case(workload, m, t)
                    done += 1
                    feeds = random_input(inputs, workload.dims(m))
                    tag = f"[{done}/{len(cases)}]"
                    kept: list[Result] = []
                    for attempt in range(suite.retries + 1):
                        results = _measure_case(case, sessions, feeds, weight_bytes, suite, probe, cold, progress, tag)
                        other = results[0].other_load
                        if not kept or (other is not None and other < (kept[0].other_load or 0.0)):
                            kept = results
                        if other is None or other < BUSY_CPUS or attempt == suite.retries:
                            break
                        progress.step(
                            f"{tag} other processes kept {other:.2f} CPUs busy: measuring again in "
                            f"{RETRY_PAUSE_S:.0f} s ({attempt + 1}/{suite.retries})"
                        )
                        time.sleep(RETRY_PAUSE_S)
                    report.results += kept
                del sessions
            del models
        report.meta["other_load_cpus"] = load.other_cpus()
        return report
    finally:
        os.sched_setaffinity(0, affinity)


def _build_variants(workload: Workload, variants: Sequence[Variant], progress: Progress) -> dict[str, onnx.ModelProto]:
    fp32 = workload.build()
    models: dict[str, onnx.ModelProto] = {}
    built: dict[object, onnx.ModelProto] = {}  # compute modes share one exported model
    for v in variants:
        if v.build in built:
            models[v.name] = built[v.build]
            continue
        t0 = time.perf_counter()
        models[v.name] = built[v.build] = v.build(fp32)
        if v.build is not _unchanged:
            progress.step(f"  {v.name}: built in {time.perf_counter() - t0:.1f} s")
    return models


def _memory(
    workload: Workload,
    variants: Sequence[Variant],
    models: Mapping[str, onnx.ModelProto],
    empty_bytes: int,
    progress: Progress,
) -> list[MemoryResult]:
    int4 = next((n for n in map(int4_weight_bytes, models.values()) if n), 0)
    if not int4:  # no CimInt4MatMul variant chosen: the denominator is still its export's bytes
        int4 = int4_weight_bytes(quantize_cim_int4(models[BASELINE]))
    feeds = random_input(_inputs_only(models[BASELINE]), workload.dims(1))
    # The first CimInt4MatMul variant once more from a file with external data, where ORT keeps
    # one copy of the weights instead of two (both compute modes hold the same bytes).
    runs = [(v, False) for v in variants]
    runs += [(v, True) for v in variants if int4_weight_bytes(models[v.name])][:1]
    results = []
    for v, external in runs:
        r = measure_memory(workload.name, v, models[v.name], feeds, int4, empty_bytes, external_data=external)
        progress.step(
            f"  {r.variant}: session holds {r.session_bytes / 2**20:.1f} MiB ({r.session_ratio:.2f}x the int4 "
            f"weights, {r.net_ratio:.2f}x without an empty session's), peak {r.peak_bytes / 2**20:.1f} MiB"
        )
        results.append(r)
    return results


def bench_session(model: onnx.ModelProto, threads: int, config: Mapping[str, str] | None = None):
    """A session as ``make_session(model, threads, pin=True)`` makes it, whose pool threads stop spinning after a run.

    By default ORT's pool threads spin for tens of milliseconds after Run() returns; here
    they would take the core from the next variant's threads and from the probe. Every
    variant (FP32, MatMulNBits, ours) gets the same options, plus its own ``config`` entries.
    """
    return make_session(model, threads, pin=True, config={"session.force_spinning_stop": "1", **(config or {})})


def _make_sessions(models: Mapping[str, onnx.ModelProto], variants: Sequence[Variant], threads: int) -> dict:
    sessions = {}
    for v in variants:
        with _environment(dict(v.env)):
            sessions[v.name] = bench_session(models[v.name], threads, dict(v.config))
    return sessions


def _measure_case(
    case: Case,
    sessions: Mapping,
    feeds: dict[str, np.ndarray],
    weight_bytes: Mapping[str, int],
    suite: Suite,
    probe: BandwidthProbe,
    cold: bool,
    progress: Progress,
    tag: str,
) -> list[Result]:
    # Warm-up call of each variant, which also gives the outputs checked against FP32.
    outputs = {name: sess.run(None, feeds)[0] for name, sess in sessions.items()}
    calls = {name: partial(sess.run, None, feeds) for name, sess in sessions.items()}
    bandwidth: list[float] = []

    def evict(name: str) -> None:
        probe.evict()

    def warm_up(name: str) -> None:
        # Steady state of back-to-back calls: what a benchmark without eviction measures.
        for _ in range(WARM_CALLS):
            calls[name]()

    def sample_bandwidth() -> None:
        # DRAM bandwidth drifts on shared machines; sample it in the same rounds as the variants.
        bandwidth.append(probe.read(probe.probe_bytes, case.threads)[0])

    load = LoadMeter()
    start = time.perf_counter()

    def on_round(r: int) -> None:
        progress.update(f"{tag} {case.name}: round {r} ({time.perf_counter() - start:.1f} s)")

    samples = interleaved(
        calls,
        min_rounds=suite.min_rounds,
        max_rounds=suite.max_rounds,
        max_time=suite.max_time,
        before_each=evict if cold else warm_up,
        # A probe pass reads 4x the cache, so a warm run cannot take one.
        between_rounds=sample_bandwidth if cold else None,
        on_round=on_round,
    )
    rounds = len(next(iter(samples.values())))
    other = load.other_cpus()
    results = [
        Result(
            case=case.name,
            case_id=case.id,
            workload=case.workload.name,
            m=case.m,
            threads=case.threads,
            variant=name,
            weight_bytes=weight_bytes[name],
            rel_error=relative_error(outputs[name], outputs[BASELINE]),
            samples=samples[name],
            bandwidth_samples=list(bandwidth),
            other_load=other,
        )
        for name in sessions
    ]
    medians = "  ".join(f"{r.variant} {r.median * 1e3:.2f}" for r in results)
    bw = f", {statistics.median(bandwidth) / 1e9:.1f} GB/s" if bandwidth else ""
    progress.step(f"{tag} {case.name}: {rounds} rounds in {time.perf_counter() - start:.1f} s{bw}; ms: {medians}")
    return results


def _inputs_only(model: onnx.ModelProto) -> onnx.ModelProto:
    # random_input reads only the graph inputs; keep them without the weights.
    out = onnx.ModelProto()
    out.graph.input.extend(model.graph.input)
    return out
