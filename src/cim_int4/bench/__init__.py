"""Benchmarks: one FP32 graph run as FP32 ORT, ORT MatMulNBits and CimInt4MatMul, against the read bandwidth.

This package is the one engine behind ``cim-int4 bench`` and the pytest-benchmark tests
in tests/bench, one module per concern:

* ``workloads``: the graphs, cases and suites; ``variants``: how each is run (FP32,
  MatMulNBits, CimInt4MatMul per compute mode) and its weight bytes;
* ``probe``: the bandwidth probe and cache evictor; ``timing``: interleaved rounds;
* ``memory``: the resident memory a loaded session adds, each in a fresh process;
* ``machine``: CPU, versions and the load of other processes; ``runner``: a suite's run;
* ``results``: what was measured and derived; ``tables``: table, header, legend, plot
  (rendered with ``cim_int4.report``, shared with ``cim-int4 validate``); ``cli``.

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
* Memory (per workload and variant, once, 1 thread): see ``memory``.
"""

from .cli import add_arguments, main, run
from .errors import BenchError
from .machine import BUSY_CPUS, KERNEL_ENV, LoadMeter, machine_meta
from .memory import MemoryResult, measure_memory
from .probe import BWPROBE_ENV, BWPROBE_NAME, BandwidthProbe, bwprobe_path, last_level_cache_bytes
from .results import REL_ERROR_BOUND, Report, Result, Row
from .runner import Progress, bench_session, run_suite
from .tables import format_header, format_legend, format_memory, format_table, memory_legend, write_plot
from .timing import interleaved, relative_error
from .variants import (
    BASELINE,
    BASELINES,
    BLOCK_SIZE,
    COMPUTE_MODES,
    VARIANTS,
    Variant,
    constant_bytes,
    int4_weight_bytes,
    nbits_quantizer,
    quantize_cim_int4,
    quantize_nbits,
    select_variants,
)
from .workloads import DEFAULT_THREADS, SUITES, Case, Suite, Workload, chain, decoder, layer

__all__ = [
    "BASELINE",
    "BASELINES",
    "BLOCK_SIZE",
    "BUSY_CPUS",
    "BWPROBE_ENV",
    "BWPROBE_NAME",
    "COMPUTE_MODES",
    "DEFAULT_THREADS",
    "KERNEL_ENV",
    "REL_ERROR_BOUND",
    "SUITES",
    "VARIANTS",
    "BandwidthProbe",
    "BenchError",
    "Case",
    "LoadMeter",
    "MemoryResult",
    "Progress",
    "Report",
    "Result",
    "Row",
    "Suite",
    "Variant",
    "Workload",
    "add_arguments",
    "bench_session",
    "bwprobe_path",
    "chain",
    "constant_bytes",
    "decoder",
    "format_header",
    "format_legend",
    "format_memory",
    "format_table",
    "int4_weight_bytes",
    "interleaved",
    "last_level_cache_bytes",
    "layer",
    "machine_meta",
    "main",
    "measure_memory",
    "memory_legend",
    "nbits_quantizer",
    "quantize_cim_int4",
    "quantize_nbits",
    "relative_error",
    "run",
    "run_suite",
    "select_variants",
    "write_plot",
]
