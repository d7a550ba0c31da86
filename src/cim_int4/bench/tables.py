"""The benchmark's table, header, legend and plot, rendered with cim_int4.report."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from ..report import plot_bars, text_table
from .machine import BUSY_CPUS, KERNEL_ENV
from .results import REL_ERROR_BOUND, Report
from .runner import WARM_CALLS
from .variants import VARIANTS


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
    return text_table(header, lines, left={0, 1}, block_column=0)


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


def format_memory(report: Report) -> str:
    """Resident memory per workload and variant, as ratios to the int4 weight bytes (empty if not measured)."""
    if not report.memory:
        return ""
    header = ("workload", "variant", "int4 MiB", "session MiB", "session/int4", "net/int4", "peak MiB", "peak/int4")
    lines, last = [], None
    for m in report.memory:
        lines.append(
            (
                m.workload if m.workload != last else "",
                m.variant,
                f"{m.int4_bytes / 2**20:.2f}",
                f"{m.session_bytes / 2**20:.1f}",
                f"{m.session_ratio:.2f}x",
                f"{m.net_ratio:.2f}x",
                f"{m.peak_bytes / 2**20:.1f}" + ("" if m.peak_reset else " ?"),
                f"{m.peak_ratio:.2f}x",
            )
        )
        last = m.workload
    return text_table(header, lines, left={0, 1}, block_column=0)


def memory_legend(report: Report) -> str:
    """What the memory table's columns mean."""
    empty = report.meta.get("empty_session_bytes", 0)
    return "\n".join(
        [
            "memory: each variant's session created from the model file in a fresh process (1 thread) and run once;",
            "session: RSS then minus RSS before loading; peak: highest RSS during load and run minus the same "
            "('?': the peak could not be reset);",
            "ratios to the int4 weight bytes (packed + scales) of the CimInt4MatMul export, for every variant; "
            f"net: session minus an empty session's {empty / 2**20:.1f} MiB; '(external data)': the model's "
            "tensors in <model>.data (export --external-data), so ORT keeps one copy of them, not two.",
        ]
    )


def write_plot(report: Report, path: str | os.PathLike) -> None:
    """Latency by variant per case (log scale) and % of read bandwidth, side by side, as an image (MissingPlotting)."""
    rows = report.rows()
    cases = list(dict.fromkeys(r.result.case for r in rows))
    variants = list(dict.fromkeys(r.result.variant for r in rows))
    cell = {(r.result.case, r.result.variant): r for r in rows}

    def series(value) -> dict[str, list[float]]:
        return {
            v: [value(cell[(c, v)]) if (c, v) in cell and value(cell[(c, v)]) else np.nan for c in cases]
            for v in variants
        }

    m = report.meta
    plot_bars(
        path,
        cases,
        [
            ("median latency, ms (log scale; shorter is faster)", series(lambda r: r.result.median * 1e3), True),
            ("effective weight-read bandwidth, % of probe", series(lambda r: r.pct_bandwidth), False),
        ],
        title=f"cim-int4 bench ({m['suite']}) - {m['cpu']} - {m['date'][:10]}",
        reference_line=(1, 100.0),
    )
