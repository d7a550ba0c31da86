"""The kernel tuner: times the op library's decode variants on this CPU and keeps the winner in a per-CPU profile.

The op library reads the profile when it creates a kernel (and tunes once by itself when
the profile has no entry for this CPU); ``cim-int4 tune`` runs the tuner explicitly and
prints its table. Both come from ``libcim_int4_tune.so``, built and installed beside the
op library. Environment: ``CIM_INT4_PROFILE`` (profile path), ``CIM_INT4_VARIANT``
(force one variant), ``CIM_INT4_TUNE=off`` (never tune implicitly), ``CIM_INT4_KERNEL``,
``CIM_INT4_TUNE_STREAM_MIB=<n>`` (the explicit tuner's synthetic stream in MiB instead of twice
the last-level cache; for tests and measurements, the op's implicit tuning ignores it).
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

from ..contract import COMPUTE_MODES
from .library import library_path

TUNE_LIBRARY_NAME = "libcim_int4_tune.so"
PROFILE_ENV = "CIM_INT4_PROFILE"
VARIANT_ENV = "CIM_INT4_VARIANT"
TUNE_ENV = "CIM_INT4_TUNE"
TUNE_STREAM_ENV = "CIM_INT4_TUNE_STREAM_MIB"


class TuneError(ValueError):
    """The tuner library refused a request (unknown kernel, bad CIM_INT4_VARIANT, ...)."""


def tune_library_path() -> str:
    """Path of libcim_int4_tune.so: beside the op library (so ``CIM_INT4_LIBRARY`` moves both)."""
    path = Path(library_path()).with_name(TUNE_LIBRARY_NAME)
    if not path.is_file():
        raise FileNotFoundError(f"cim-int4 tuner library not found at {path}; rebuild the package")
    return str(path)


def _call(name: str, *args: Any) -> dict[str, Any]:
    lib = ctypes.CDLL(tune_library_path())
    fn = getattr(lib, name)
    size = 1 << 14
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, ctypes.c_size_t(size))
        if n < size:
            break
        size = n + 1
    reply = json.loads(buf.value.decode())
    if "error" in reply:
        raise TuneError(reply["error"])
    return reply


def tune(kernel: str = "auto", seconds: float = 0.8, save: bool = True) -> dict[str, Any]:
    """Times ``kernel``'s variants (``auto``: the best ISA path of this CPU) for about ``seconds``; saves the choice.

    Returns the report: cpu, key, kernel, stream_bytes, windows, window_bytes (each pass reads
    the next of ``windows`` equal windows), rounds, read_seconds, variants (name, fp32_seconds,
    int8_seconds: medians of one M = 1 decode of the stream, 1 thread, a window's time x windows),
    default, chosen, profile, saved, save_error, budget_seconds, extended (rounds ran past the
    budget, up to extend_factor times it, while the choice was open), setup_seconds,
    elapsed_seconds, longest_round_seconds.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return _call("cim_int4_tune", kernel.encode(), ctypes.c_double(seconds), ctypes.c_int(int(save)))


def current_variants(kernel: str = "auto") -> dict[str, Any]:
    """The variants the op would run for ``kernel`` in a new process: {kernel, fp32, int8, default, source, ...}.

    ``default``: {fp32, int8}, the table's untuned variants (what runs with CIM_INT4_TUNE=off and no profile).
    """
    return _call("cim_int4_variants", kernel.encode())


def format_report(report: dict[str, Any]) -> str:
    """The tuner's table: per variant and mode, time, share of the streaming read, and the choice."""
    gb = report["stream_bytes"] / 1e9
    read = report["read_seconds"]
    window_mib = report["window_bytes"] / 2**20
    windows = f"in {report['windows']} windows of {window_mib:.0f} MiB " if report["windows"] > 1 else ""
    lines = [
        f"CPU: {report['cpu']}",
        f"kernel: {report['kernel']}; stream {report['stream_bytes'] / 2**20:.0f} MiB {windows}"
        f"(last-level cache {report['llc_bytes'] / 2**20:.0f} MiB), {report['rounds']} interleaved rounds "
        f"in {report['elapsed_seconds']:.2f} s (+{report['setup_seconds']:.2f} s set-up), 1 thread, M = 1",
        f"streaming read: {gb / read:.1f} GB/s" if read > 0 else "streaming read: not measured",
        "",
        f"{'variant':<14} {'fp32 ms':>8} {'/dflt':>6} {'/read':>6}  {'int8 ms':>8} {'/dflt':>6} {'/read':>6}",
    ]
    for row in report["variants"]:
        cells = []
        for mode in COMPUTE_MODES:
            t = row[f"{mode}_seconds"]
            share = read / t if t > 0 else 0.0
            name = row["name"]
            dropped = row[f"{mode}_rounds"] < report["rounds"]
            mark = (
                "x"
                if dropped
                else "*"
                if report["chosen"][mode] == name
                else ("d" if report["default"][mode] == name else " ")
            )
            cells.append(f"{t * 1e3:8.2f} {row[f'{mode}_vs_default']:6.3f} {share:5.2f}{mark}")
        lines.append(f"{row['name']:<14} {cells[0]}  {cells[1]}")
    lines += [
        "",
        "/dflt: median over rounds of the time over the default's in the same round; /read: the streaming "
        "read's time (the faster of a read with and without software prefetch) over the variant's",
        f"x: timed in fewer rounds, dropped as more than {report['drop_factor']:.2f}x the best one's /dflt",
        f"* chosen, d default (kept unless another is > {report['margin'] * 100:.0f}% faster, in the median and "
        f"in 3 of 4 rounds, over >= {report['min_rounds']} rounds): "
        f"fp32 {report['chosen']['fp32']}, int8 {report['chosen']['int8']}",
    ]
    if report["saved"]:
        lines.append(f"saved to {report['profile']}")
    elif report["save_error"]:
        lines.append(f"not saved: {report['save_error']}")
    else:
        lines.append("not saved (--no-save)")
    return "\n".join(lines)
