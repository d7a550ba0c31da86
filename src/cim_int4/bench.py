"""Benchmarks: one FP32 graph run as FP32 ORT, ORT MatMulNBits and CimInt4MatMul, against the read bandwidth.

This is the one engine behind ``cim-int4 bench`` and the pytest-benchmark tests in
tests/bench: case definitions, variant builders (including ORT's MatMulNBitsQuantizer),
cache eviction, interleaved timing with medians, the bandwidth probe, table, JSON, plot.

How a case is timed:

* Every variant of a case gets a session built the same way (``session_options(threads,
  pin=True)`` as ``make_session`` uses: same intra-op thread count, same pinning, our
  library registered), plus ``session.force_spinning_stop`` so that one variant's idle
  pool threads do not spin on the cores the next variant runs on.
* One untimed call per variant warms it up and gives the outputs that are checked against
  FP32.
* Rounds then call every variant once, in an order rotated each round (A B C, B C A, ...),
  so slow drift of the machine hits all variants alike; the statistic is the median.
* Before each timed call, outside the timed region, the probe library reads a buffer of
  1.5x the last-level cache (size from /sys at run time) with all cores: the weights come
  from DRAM as in a real model, whose layers do not all fit in the cache. ``--warm``
  instead makes four untimed calls of the same variant first (weights in cache, as a
  benchmark of back-to-back calls sees them), to show the difference.
* After each round the probe reads a buffer of 4x the last-level cache with the case's
  thread count, pinned like the session's threads: DRAM bandwidth drifts on a shared
  host, so each case is compared with the bandwidth measured in its own rounds.
* Effective bandwidth = the variant's own constant bytes (weights with scales and zero
  points) / median latency, also as a percentage of that probe bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from .exporter import export_with_summary
from .graphs import LlamaConfig, llama_decoder, matmul_chain, random_input, single_matmul
from .ops import library_path, make_session, physical_cores, thread_affinities

BWPROBE_NAME = "libcim_int4_bwprobe.so"
BWPROBE_ENV = "CIM_INT4_BWPROBE"
KERNEL_ENV = "CIM_INT4_KERNEL"
BLOCK_SIZE = 32

# Eviction reads this multiple of the last-level cache; the bandwidth probe reads the larger one.
EVICT_FACTOR = 1.5
PROBE_FACTOR = 4.0
MIN_PROBE_BYTES = 256 << 20
FALLBACK_LLC_BYTES = 32 << 20
PROBE_PASSES = 5
# A case during which other processes kept more CPUs than this busy (on average) is measured
# again, up to Suite.retries times, after a pause; the least disturbed measurement is kept.
BUSY_CPUS = 0.1
RETRY_PAUSE_S = 3.0
MIN_LOAD_WINDOW_S = 1.0
# Untimed calls of the same variant before each timed one in a warm run (--warm).
WARM_CALLS = 4

# Largest relative RMS error vs FP32 an INT4 (block 32) variant may show on the bench graphs.
# Measured: 0.09-0.10 on single layers, 0.34-0.37 through the 16-layer chain, 0.21-0.40 on the
# decoder (the graphs plant 10x outlier columns, see graphs/_common.py). Wrong nibble order or
# scales give ~1.4, all zeros 1.0.
REL_ERROR_BOUND = 0.7


class BenchError(Exception):
    """The benchmark cannot run as asked; the message says what to install or change."""


# ---------------------------------------------------------------- cases


def _matrix_dims(m: int) -> dict[str, int]:
    return {"M": m}


def _decoder_dims(m: int) -> dict[str, int]:
    return {"batch": 1, "seq": m}


@dataclass(frozen=True)
class Workload:
    """One FP32 graph from graphs/; ``dims(M)`` maps the token count M to its symbolic input dims."""

    name: str
    build: Callable[[], onnx.ModelProto] = field(compare=False)
    dims: Callable[[int], dict[str, int]] = field(compare=False)


def layer(k: int, n: int) -> Workload:
    """A single MatMul [M, k] x [k, n]."""
    return Workload(f"matmul {k}x{n}", partial(single_matmul, k, n), _matrix_dims)


def chain(layers: int, dim: int) -> Workload:
    """``layers`` MatMuls [dim, dim] in series."""
    return Workload(f"chain {layers}x{dim}x{dim}", partial(matmul_chain, layers, dim), _matrix_dims)


def decoder(cfg: LlamaConfig) -> Workload:
    """The graphs/ Llama decoder stack; M is the sequence length (batch 1, no KV cache)."""
    name = f"llama {cfg.layers}L h{cfg.hidden} i{cfg.intermediate}"
    return Workload(name, partial(llama_decoder, cfg), _decoder_dims)


@dataclass(frozen=True)
class Case:
    """One timed configuration: a workload at M tokens with ``threads`` pinned intra-op threads."""

    workload: Workload
    m: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.workload.name} M={self.m} t={self.threads}"

    @property
    def id(self) -> str:
        """The name with no spaces, for pytest ids and benchmark groups."""
        return f"{self.workload.name.replace(' ', '-')}-M{self.m}-t{self.threads}"


@dataclass(frozen=True)
class Suite:
    """Workloads x token counts, and how long to time each case."""

    name: str
    workloads: tuple[Workload, ...]
    ms: tuple[int, ...]
    min_rounds: int
    max_rounds: int
    max_time: float  # seconds per case; rounds stop after this once min_rounds are done
    buffer_cap: int | None = None  # caps the probe/eviction buffer (tiny shapes need no DRAM-sized one)
    retries: int = 1  # times a case is measured again when other processes kept CPUs busy during it

    def cases(self, threads: Sequence[int]) -> list[Case]:
        """Every (workload, threads, M), in the order they are run."""
        return [Case(w, m, t) for w in self.workloads for t in threads for m in self.ms]


SUITES: dict[str, Suite] = {
    "full": Suite(
        "full",
        (layer(4096, 4096), layer(4096, 11008), layer(11008, 4096), chain(16, 4096), decoder(LlamaConfig())),
        ms=(1, 32, 128),
        min_rounds=7,
        max_rounds=60,
        max_time=10.0,
    ),
    "quick": Suite(
        "quick",
        (layer(4096, 4096), decoder(LlamaConfig())),
        ms=(1,),
        min_rounds=7,
        max_rounds=60,
        max_time=8.0,
    ),
    # Smoke test of every code path in seconds (CI): tiny shapes, a few rounds.
    "tiny": Suite(
        "tiny",
        (
            layer(128, 256),
            layer(256, 64),
            chain(3, 128),
            decoder(LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4)),
        ),
        ms=(1, 5),
        min_rounds=3,
        max_rounds=3,
        max_time=0.0,
        buffer_cap=64 << 20,
        retries=0,
    ),
}
DEFAULT_THREADS = (1, 2)


# ---------------------------------------------------------------- variants


def _quiet_quantizer_logs() -> contextlib.AbstractContextManager:
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")

    @contextlib.contextmanager
    def quiet() -> Iterator[None]:
        level = logger.level
        logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.setLevel(level)

    return quiet()


def nbits_quantizer() -> type:
    """ORT's MatMulNBitsQuantizer class, or BenchError saying how to get it."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        hint = "pip install onnx-ir" if "onnx_ir" in str(missing) else f"({e})"
        raise BenchError(
            "the MatMulNBits baseline needs ORT's MatMulNBitsQuantizer, which imports the onnx-ir package "
            f"that the onnxruntime wheel does not declare: {hint}"
        ) from e
    finally:
        # The module calls logging.basicConfig(level=INFO) on import; keep the root logger as it was.
        root.setLevel(level)
        root.handlers[:] = handlers
    return MatMulNBitsQuantizer


def quantize_nbits(model: onnx.ModelProto, accuracy_level: int) -> onnx.ModelProto:
    """``model`` with its constant-weight MatMuls as ORT MatMulNBits (4 bits, block 32, symmetric)."""
    quantizer_class = nbits_quantizer()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer edits the model it is given
    with _quiet_quantizer_logs():
        quantizer = quantizer_class(
            copy, bits=4, block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=accuracy_level
        )
        quantizer.process()
    return quantizer.model.model


def quantize_cim_int4(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its constant-weight MatMuls as CimInt4MatMul (group 32)."""
    return export_with_summary(model, group_size=BLOCK_SIZE)[0]


def _unchanged(model: onnx.ModelProto) -> onnx.ModelProto:
    return model


@dataclass(frozen=True)
class Variant:
    """One way to run a workload's graph."""

    name: str
    description: str
    build: Callable[[onnx.ModelProto], onnx.ModelProto] = field(compare=False)
    # The MatMulNBits variant of the same accuracy (activation precision), for the "vs nbits" column.
    peer: str | None = None
    # Environment set while the variant's session is created (the op reads CIM_INT4_KERNEL then).
    env: tuple[tuple[str, str], ...] = ()
    # Raises BenchError when something the variant needs is missing; run before any measuring.
    check: Callable[[], object] | None = field(default=None, compare=False)


BASELINE = "fp32"
BASELINES: tuple[Variant, ...] = (
    Variant(BASELINE, "FP32 MatMul in plain ORT", _unchanged),
    Variant(
        "nbits-acc0",
        "ORT MatMulNBits, 4 bits, block 32, symmetric, accuracy_level 0 (FP32 compute)",
        partial(quantize_nbits, accuracy_level=0),
        check=nbits_quantizer,
    ),
    Variant(
        "nbits-acc4",
        "ORT MatMulNBits, 4 bits, block 32, symmetric, accuracy_level 4 (int8 activations)",
        partial(quantize_nbits, accuracy_level=4),
        check=nbits_quantizer,
    ),
)
# CimInt4MatMul, one entry per compute mode; a new mode (e.g. int8 activations, peer
# "nbits-acc4") is one more entry.
COMPUTE_MODES: tuple[Variant, ...] = (
    Variant(
        "cim-int4",
        "CimInt4MatMul, group 32, FP32 activations, kernel by CPUID (CIM_INT4_KERNEL overrides)",
        quantize_cim_int4,
        peer="nbits-acc0",
    ),
)
VARIANTS: tuple[Variant, ...] = BASELINES + COMPUTE_MODES


def select_variants(names: Sequence[str] | None) -> tuple[Variant, ...]:
    """The variants named (all if None), always with fp32 first as the reference; ValueError for unknown names."""
    if not names:
        return VARIANTS
    known = {v.name: v for v in VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    wanted = [BASELINE, *(n for n in names if n != BASELINE)]
    return tuple(known[n] for n in dict.fromkeys(wanted))


def _tensor_bytes(t: TensorProto) -> int:
    count = int(np.prod(t.dims, dtype=np.int64))
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (count + 1) // 2
    return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def constant_bytes(model: onnx.ModelProto) -> int:
    """Bytes of every constant a forward pass reads: initializers and tensor attributes (packed weights, scales)."""
    total = sum(_tensor_bytes(t) for t in model.graph.initializer)
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                total += _tensor_bytes(a.t)
            elif a.type == onnx.AttributeProto.TENSORS:
                total += sum(_tensor_bytes(t) for t in a.tensors)
    return total


@contextlib.contextmanager
def _environment(overrides: Mapping[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- bandwidth probe and eviction


def _parse_cache_size(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def last_level_cache_bytes() -> int | None:
    """Size of CPU 0's last-level data cache from /sys (None if not reported)."""
    best: tuple[int, int] | None = None
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Unified", "Data") and (best is None or level > best[0]):
            best = (level, size)
    return None if best is None else best[1]


def bwprobe_path() -> str:
    """Path of libcim_int4_bwprobe.so: env CIM_INT4_BWPROBE, else next to the op library."""
    override = os.environ.get(BWPROBE_ENV)
    path = Path(override) if override else Path(library_path()).with_name(BWPROBE_NAME)
    if not path.is_file():
        where = f"{BWPROBE_ENV}={override}" if override else f"next to the op library ({library_path()})"
        raise BenchError(
            f"bandwidth probe library not found at {path} ({where}); it is built and installed with the "
            f"package ('pip install .'), or set {BWPROBE_ENV} to a build's {BWPROBE_NAME}"
        )
    return str(path)


def _aligned_ones(nbytes: int, align: int = 4096) -> np.ndarray:
    # Ones, not zeros: calloc'd zero pages all map to one physical page, which stays cached.
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    buf = raw[offset : offset + nbytes]
    buf.fill(1)
    return buf


class BandwidthProbe:
    """The read-bandwidth probe and cache evictor (``libcim_int4_bwprobe.so``, through ctypes)."""

    def __init__(self, probe_bytes: int, evict_bytes: int, path: str | None = None) -> None:
        self._lib = ctypes.CDLL(path or bwprobe_path())
        self._lib.cim_bwprobe_read.restype = ctypes.c_double
        self._lib.cim_bwprobe_read.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_uint64),
        ]
        self._lib.cim_bwprobe_isa.restype = ctypes.c_char_p
        self.probe_bytes = probe_bytes
        self.evict_bytes = min(evict_bytes, probe_bytes)
        self._buffer = _aligned_ones(probe_bytes)
        self._cores = physical_cores()

    @classmethod
    def for_this_machine(cls, cap: int | None = None, path: str | None = None) -> BandwidthProbe:
        """A probe sized from the last-level cache: evicts 1.5x it, measures over 4x it (``cap`` limits both)."""
        llc = last_level_cache_bytes() or FALLBACK_LLC_BYTES
        probe = max(int(PROBE_FACTOR * llc), MIN_PROBE_BYTES)
        evict = int(EVICT_FACTOR * llc)
        if cap is not None:
            probe, evict = min(probe, cap), min(evict, cap)
        return cls(probe, evict, path)

    @property
    def isa(self) -> str:
        """Instruction set the probe reads with."""
        return self._lib.cim_bwprobe_isa().decode()

    def read(self, nbytes: int, threads: int) -> tuple[float, int]:
        """Read the first ``nbytes`` of the buffer once with ``threads`` pinned threads: (bytes/s, checksum)."""
        if not 0 < nbytes <= self.probe_bytes:
            raise ValueError(f"nbytes must be in 1..{self.probe_bytes}, got {nbytes}")
        cpus, _ = thread_affinities(threads, self._cores)
        cpu_array = (ctypes.c_int * threads)(*cpus)
        checksum = ctypes.c_uint64(0)
        rate = self._lib.cim_bwprobe_read(self._buffer.ctypes.data, nbytes, threads, cpu_array, ctypes.byref(checksum))
        if rate <= 0:
            raise BenchError(f"bandwidth probe failed (threads={threads}, cpus={cpus}, bytes={nbytes})")
        return rate, checksum.value

    def bandwidth(self, threads: int, passes: int = PROBE_PASSES) -> float:
        """Median read bandwidth in bytes/s over the whole buffer, with ``threads`` threads pinned like a session's."""
        self.read(self.probe_bytes, threads)  # first pass: page-table and TLB warm-up
        return statistics.median(self.read(self.probe_bytes, threads)[0] for _ in range(passes))

    def evict(self) -> None:
        """Push the caches' contents out by reading 1.5x the last-level cache with every core."""
        self.read(self.evict_bytes, len(self._cores))


# ---------------------------------------------------------------- timing


def interleaved(
    calls: Mapping[str, Callable[[], object]],
    *,
    min_rounds: int,
    max_rounds: int,
    max_time: float,
    before_each: Callable[[str], None] | None = None,
    between_rounds: Callable[[], None] | None = None,
    on_round: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each entry, one call of each per round in an order rotated every round.

    ``before_each(name)`` (cache eviction, or warm-up calls) runs before every call and
    ``between_rounds`` (a bandwidth sample) after every round, both outside the timed region. Rounds stop at
    ``max_rounds``, or once ``min_rounds`` are done and ``max_time`` seconds have passed.
    """
    if min_rounds < 1 or max_rounds < min_rounds:
        raise ValueError(f"need 1 <= min_rounds <= max_rounds, got {min_rounds}, {max_rounds}")
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = clock()
    for r in range(max_rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if before_each is not None:
                before_each(name)
            t0 = clock()
            calls[name]()
            samples[name].append(clock() - t0)
        if between_rounds is not None:
            between_rounds()
        if on_round is not None:
            on_round(r + 1)
        if r + 1 >= min_rounds and clock() - start >= max_time:
            break
    return samples


def relative_error(y: np.ndarray, reference: np.ndarray) -> float:
    """RMS of ``y - reference`` over RMS of ``reference``."""
    ref = np.asarray(reference, dtype=np.float64)
    diff = np.asarray(y, dtype=np.float64) - ref
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny))


# ---------------------------------------------------------------- results


@dataclass
class Result:
    """Timings of one variant in one case."""

    case: str
    case_id: str
    workload: str
    m: int
    threads: int
    variant: str
    weight_bytes: int
    rel_error: float
    samples: list[float]
    # Probe read bandwidth (bytes/s) sampled once per round of this case, at its thread count;
    # empty for a warm run, whose case bandwidth is the run's.
    bandwidth_samples: list[float] = field(default_factory=list)
    # CPUs that other processes (and the hypervisor) kept busy during the case, on average.
    other_load: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Half the interquartile range over the median: the noise of this measurement."""
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q3 - q1) / 2 / self.median


@dataclass
class Row:
    """One line of the table."""

    result: Result
    vs_fp32: float | None
    vs_nbits: float | None
    peer: str | None
    gbps: float
    pct_bandwidth: float | None
    accurate: bool


@dataclass
class Report:
    """Everything one run measured, with the machine it ran on."""

    meta: dict
    bandwidth: dict[int, float]  # threads -> bytes/s
    results: list[Result]

    def rows(self) -> list[Row]:
        """The results with speed-ups, effective bandwidth and accuracy verdicts, in run order."""
        peers = {v.name: v.peer for v in VARIANTS}
        by_case: dict[str, dict[str, Result]] = {}
        for r in self.results:
            by_case.setdefault(r.case, {})[r.variant] = r
        rows = []
        for r in self.results:
            same = by_case[r.case]
            fp32 = same.get(BASELINE)
            peer = peers.get(r.variant)
            nbits = same.get(peer) if peer else None
            gbps = r.weight_bytes / r.median / 1e9
            bw = statistics.median(r.bandwidth_samples) if r.bandwidth_samples else self.bandwidth.get(r.threads)
            rows.append(
                Row(
                    result=r,
                    vs_fp32=fp32.median / r.median if fp32 else None,
                    vs_nbits=nbits.median / r.median if nbits else None,
                    peer=peer if nbits else None,
                    gbps=gbps,
                    pct_bandwidth=100.0 * gbps * 1e9 / bw if bw else None,
                    accurate=r.rel_error <= REL_ERROR_BOUND,
                )
            )
        return rows

    def case_bandwidth(self, threads: int) -> list[float]:
        """Median probe bandwidth (bytes/s) of each case run with ``threads`` threads (empty for a warm run)."""
        per_case = {r.case: r.bandwidth_samples for r in self.results if r.threads == threads and r.bandwidth_samples}
        return [statistics.median(v) for v in per_case.values()]

    def to_json(self) -> dict:
        """A JSON-ready dict: meta, bandwidth per thread count, one entry per row with its raw samples."""
        entries = []
        for row in self.rows():
            entry = dataclasses.asdict(row.result)
            entry.update(
                median_s=row.result.median,
                spread=row.result.spread,
                speedup_vs_fp32=row.vs_fp32,
                speedup_vs_nbits=row.vs_nbits,
                nbits_peer=row.peer,
                effective_gbps=row.gbps,
                pct_of_bandwidth=row.pct_bandwidth,
                case_bandwidth_gbps=statistics.median(row.result.bandwidth_samples) / 1e9
                if row.result.bandwidth_samples
                else None,
                accurate=row.accurate,
            )
            entries.append(entry)
        return {
            "meta": self.meta,
            "bandwidth_gbps": {str(t): bw / 1e9 for t, bw in self.bandwidth.items()},
            "results": entries,
        }


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_table(report: Report) -> str:
    """The results as a text table: one block per case, one line per variant."""
    header = ("case", "variant", "median ms", "spread", "vs fp32", "vs nbits", "GB/s", "% bw", "rel err", "busy")
    lines: list[tuple[str, ...]] = []
    last_case = None
    for row in report.rows():
        r = row.result
        lines.append(
            (
                r.case if r.case != last_case else "",
                r.variant,
                f"{r.median * 1e3:.3f}",
                f"±{100 * r.spread:.0f}%",
                _times(row.vs_fp32),
                _times(row.vs_nbits),
                f"{row.gbps:.1f}",
                "-" if row.pct_bandwidth is None else f"{row.pct_bandwidth:.0f}%",
                f"{r.rel_error:.3f}" + ("" if row.accurate else " !"),
                "?" if r.other_load is None else f"{r.other_load:.2f}" + (" !" if r.other_load >= BUSY_CPUS else ""),
            )
        )
        last_case = r.case
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    left = {0, 1}

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [fmt(header), "  ".join("-" * w for w in widths)]
    for line in lines:
        if line[0] and len(out) > 2:
            out.append("")
        out.append(fmt(line))
    return "\n".join(out)


def format_header(report: Report) -> str:
    """Machine, versions and bandwidth lines printed above the table."""
    m = report.meta
    bw = ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in sorted(report.bandwidth.items()))
    ranges = []
    for t in sorted(report.bandwidth):
        per_case = report.case_bandwidth(t)
        if per_case:
            ranges.append(f"{t} thread(s) {min(per_case) / 1e9:.1f}-{max(per_case) / 1e9:.1f} GB/s")
    drift = (
        [f"read bandwidth during the cases (median per case, sampled every round; % bw uses it): {', '.join(ranges)}"]
        if ranges
        else []
    )
    return "\n".join(
        [
            f"cim-int4 bench ({m['suite']}), {m['date']}",
            f"CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs, {m['physical_cores']} cores), "
            f"last-level cache {m['llc_bytes'] / 2**20:.0f} MiB (sysfs)",
            f"onnxruntime {m['onnxruntime']}, {KERNEL_ENV}={m['kernel_env'] or 'auto'}",
            f"read bandwidth at start ({m['probe_bytes'] / 2**20:.0f} MiB buffer, {m['probe_isa']} loads): {bw}",
            *drift,
            _load_line(m),
            "cache: "
            + (
                f"cold, {m['evict_bytes'] / 2**20:.0f} MiB read before every timed call"
                if m["cold"]
                else f"warm, {WARM_CALLS} untimed calls of the same variant before every timed call"
            ),
        ]
    )


def _load_line(meta: Mapping) -> str:
    other = meta.get("other_load_cpus")
    if other is None:
        return "other load: unknown (run under a second, or no /proc/stat)"
    verdict = "quiet" if other < 0.1 else "BUSY: timings are unreliable, stop other work and run again"
    return f"other load: other processes kept {other:.2f} of {meta['logical_cpus']} CPUs busy on average ({verdict})"


def format_legend() -> str:
    """What the columns and variants mean, printed below the table."""
    lines = [
        "median ms: median latency of one run; spread: half the interquartile range of the rounds;",
        "vs fp32 / vs nbits: speed-up over FP32 ORT / over MatMulNBits of the same accuracy;",
        "GB/s: the variant's constant bytes (weights + scales) / median; % bw: of the probe's read bandwidth;",
        f"rel err: RMS error vs FP32 output / RMS of FP32 output ('!' above {REL_ERROR_BOUND});",
        f"busy: CPUs other processes kept busy during the case ('!' from {BUSY_CPUS}: measured on a busy machine).",
    ]
    lines += [f"  {v.name}: {v.description}" for v in VARIANTS]
    return "\n".join(lines)


def write_plot(report: Report, path: str | os.PathLike) -> None:
    """Latency by variant per case (log scale) and % of read bandwidth, side by side, as an image."""
    from matplotlib.figure import Figure  # lazily: only --plot needs matplotlib

    rows = report.rows()
    cases = list(dict.fromkeys(r.result.case for r in rows))
    variants = list(dict.fromkeys(r.result.variant for r in rows))
    cell = {(r.result.case, r.result.variant): r for r in rows}
    height = max(3.0, 0.28 * len(cases) * max(len(variants), 2) / 2 + 1.5)
    fig = Figure(figsize=(14, height), layout="constrained")
    ax_lat, ax_bw = fig.subplots(1, 2, sharey=True)
    bar = 0.8 / len(variants)
    ypos = np.arange(len(cases))
    for i, name in enumerate(variants):
        offs = ypos - 0.4 + bar * (i + 0.5)
        lat = [cell[(c, name)].result.median * 1e3 if (c, name) in cell else np.nan for c in cases]
        pct = [
            cell[(c, name)].pct_bandwidth if (c, name) in cell and cell[(c, name)].pct_bandwidth else np.nan
            for c in cases
        ]
        ax_lat.barh(offs, lat, height=bar, label=name)
        ax_bw.barh(offs, pct, height=bar, label=name)
    ax_lat.set_xscale("log")
    ax_lat.set_xlabel("median latency, ms (log scale; shorter is faster)")
    ax_bw.set_xlabel("effective weight-read bandwidth, % of probe")
    ax_bw.axvline(100, color="grey", linewidth=0.8, linestyle="--")
    ax_lat.set_yticks(ypos, cases)
    ax_lat.invert_yaxis()
    fig.legend(*ax_lat.get_legend_handles_labels(), loc="outside lower center", ncols=len(variants))
    m = report.meta
    fig.suptitle(f"cim-int4 bench ({m['suite']}) - {m['cpu']} - {m['date'][:10]}")
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- the run


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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class LoadMeter:
    """CPU time that other processes (and the hypervisor, as steal time) took while we ran, from /proc/stat."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal ...; guest time is already in user.
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
        own = resource.getrusage(resource.RUSAGE_SELF)
        return busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime, time.monotonic()

    def other_cpus(self) -> float | None:
        """CPUs kept busy by others since creation, on average (0 on a quiet machine); None under a second."""
        end = self._sample()
        # /proc/stat counts in clock ticks (10 ms): shorter windows cannot tell.
        if self._start is None or end is None or end[2] - self._start[2] < MIN_LOAD_WINDOW_S:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start, strict=True))
        return max(0.0, (busy - own) / wall)


def _package_version() -> str:
    try:
        return importlib.metadata.version("cim-int4")
    except importlib.metadata.PackageNotFoundError:
        return "not installed (source tree)"


def machine_meta(suite: Suite, probe: BandwidthProbe, cold: bool, threads: Sequence[int]) -> dict:
    """Date, CPU, cache, versions and settings of a run, for the table header and the JSON."""
    import onnxruntime as ort

    return {
        "suite": suite.name,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "logical_cpus": sum(len(core) for core in physical_cores()),  # not this thread's affinity: sessions pin it
        "physical_cores": len(physical_cores()),
        "llc_bytes": last_level_cache_bytes() or 0,
        "probe_bytes": probe.probe_bytes,
        "evict_bytes": probe.evict_bytes,
        "probe_isa": probe.isa,
        "cold": cold,
        "threads": list(threads),
        "min_rounds": suite.min_rounds,
        "max_rounds": suite.max_rounds,
        "max_time_s": suite.max_time,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "kernel_env": os.environ.get(KERNEL_ENV, ""),
        "op_library": library_path(),
        "cim_int4": _package_version(),
        "other_load_cpus": None,  # filled in at the end of the run
        "command": " ".join(sys.argv),
    }


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
    models = {}
    for v in variants:
        t0 = time.perf_counter()
        models[v.name] = v.build(fp32)
        if v.build is not _unchanged:
            progress.step(f"  {v.name}: built in {time.perf_counter() - t0:.1f} s")
    return models


def bench_session(model: onnx.ModelProto, threads: int):
    """A session as ``make_session(model, threads, pin=True)`` makes it, whose pool threads stop spinning after a run.

    By default ORT's pool threads spin for tens of milliseconds after Run() returns; here
    they would take the core from the next variant's threads and from the probe. Every
    variant (FP32, MatMulNBits, ours) gets the same options.
    """
    return make_session(model, threads, pin=True, config={"session.force_spinning_stop": "1"})


def _make_sessions(models: Mapping[str, onnx.ModelProto], variants: Sequence[Variant], threads: int) -> dict:
    sessions = {}
    for v in variants:
        with _environment(dict(v.env)):
            sessions[v.name] = bench_session(models[v.name], threads)
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


# ---------------------------------------------------------------- command line


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``cim-int4 bench`` to ``parser``."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="a subset in 1-2 minutes: a 4096x4096 layer and the decoder at M=1 (default: the full run, ~15 min)",
    )
    size.add_argument("--tiny", action="store_true", help="tiny shapes in seconds: checks that everything runs")
    parser.add_argument("--json", metavar="OUT.json", help="write every result, with raw timings, as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="draw latency and %% of bandwidth per case (matplotlib)")
    parser.add_argument(
        "--threads",
        type=_int_list,
        default=list(DEFAULT_THREADS),
        metavar="1,2",
        help="intra-op thread counts, each pinned to its own core (default: 1,2)",
    )
    parser.add_argument(
        "--variants",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        metavar="NAMES",
        help=f"comma-separated subset of {','.join(v.name for v in VARIANTS)} (fp32 is always run)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="time with the weights in cache (four untimed calls first) instead of evicting: shows the cache effect",
    )
    parser.add_argument("--min-rounds", type=int, metavar="N", help="rounds per case at least (default: by suite)")
    parser.add_argument(
        "--retries",
        type=int,
        metavar="N",
        help="measure a case again up to N times when other processes disturbed it (default: 1; --tiny: 0)",
    )
    parser.add_argument(
        "--max-time", type=float, metavar="S", help="seconds per case after which rounds stop (default: by suite)"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``cim-int4 bench``: print the table (and write JSON / plot); 0 if all ran and all outputs are accurate."""
    suite = SUITES["quick" if args.quick else "tiny" if args.tiny else "full"]
    if args.retries is not None:
        suite = dataclasses.replace(suite, retries=max(0, args.retries))
    if args.min_rounds is not None or args.max_time is not None:
        min_rounds = args.min_rounds if args.min_rounds is not None else suite.min_rounds
        suite = dataclasses.replace(
            suite,
            min_rounds=min_rounds,
            max_rounds=max(suite.max_rounds, min_rounds),
            max_time=args.max_time if args.max_time is not None else suite.max_time,
        )
    try:
        variants = select_variants(args.variants)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise BenchError("--plot needs matplotlib: pip install matplotlib")
        report = run_suite(suite, threads=args.threads, variants=variants, cold=not args.warm)
    except (BenchError, ValueError, FileNotFoundError) as e:
        print(f"cim-int4 bench: error: {e}", file=sys.stderr)
        return 2
    print(format_header(report))
    print()
    print(format_table(report))
    print()
    print(format_legend())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
        print(f"cim-int4 bench: wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"cim-int4 bench: wrote {args.plot}")
    inaccurate = [row for row in report.rows() if not row.accurate]
    for row in inaccurate:
        r = row.result
        print(
            f"cim-int4 bench: {r.variant} on {r.case}: output differs from FP32 by {r.rel_error:.3f} "
            f"(relative RMS), above the INT4 bound {REL_ERROR_BOUND}",
            file=sys.stderr,
        )
    return 1 if inaccurate else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cim_int4.bench``: the same as ``cim-int4 bench``."""
    parser = argparse.ArgumentParser(prog="cim-int4 bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
