"""The machine a run measures on: CPU, versions, settings, and the load other processes put on it."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..ops import library_path, physical_cores
from .probe import BandwidthProbe, last_level_cache_bytes
from .workloads import Suite

KERNEL_ENV = "CIM_INT4_KERNEL"
# A case during which other processes kept more CPUs than this busy (on average) is measured
# again, up to Suite.retries times, after a pause; the least disturbed measurement is kept.
BUSY_CPUS = 0.1
MIN_LOAD_WINDOW_S = 1.0


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for every reported figure."""
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
        "cpu": cpu_model(),
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
