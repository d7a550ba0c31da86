"""The read-bandwidth probe and cache evictor: ``libcim_int4_bwprobe.so`` through ctypes, sized from /sys."""

from __future__ import annotations

import ctypes
import os
import statistics
from pathlib import Path

import numpy as np

from ..ops import library_path, physical_cores, thread_affinities
from .errors import BenchError

BWPROBE_NAME = "libcim_int4_bwprobe.so"
BWPROBE_ENV = "CIM_INT4_BWPROBE"

# Eviction reads this multiple of the last-level cache; the bandwidth probe reads the larger one.
EVICT_FACTOR = 1.5
PROBE_FACTOR = 4.0
MIN_PROBE_BYTES = 256 << 20
FALLBACK_LLC_BYTES = 32 << 20
PROBE_PASSES = 5


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
