"""The probe's FP32 weights in a temporary file, mapped read-only: pages a run does not read leave the process.

A probe run with many layers at a lower width feeds their dequantized weights in place of
the FP32 ones (exporter.probe): with the FP32 weights in anonymous memory both copies are
resident, 2x the model. Mapped from a file, the FP32 pages can be dropped from the process
before such a run (``evict``: ``MADV_DONTNEED``; the file stays in the page cache, which the
kernel may reclaim) and come back from the cache when a later run reads them. Nothing is
written back: the mapping is read-only and the file is removed with the object.
"""

from __future__ import annotations

import mmap
import tempfile
from collections.abc import Sequence

import numpy as np

_PAGE = mmap.PAGESIZE


class WeightFile:
    """Float32 arrays copied into one temporary file and mapped back read-only (``arrays``), page-aligned each."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // _PAGE) * _PAGE
        self._file = tempfile.TemporaryFile(prefix="cim-int4-weights-")
        try:
            self._file.truncate(max(end, _PAGE))
            for a, offset in zip(arrays, offsets, strict=True):
                self._file.seek(offset)
                self._file.write(np.ascontiguousarray(a, dtype=np.float32).data)
            self._file.flush()
            self._map = mmap.mmap(self._file.fileno(), max(end, _PAGE), access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise
        self.arrays = [
            np.frombuffer(self._map, np.float32, a.size, offset).reshape(a.shape)
            for a, offset in zip(arrays, offsets, strict=True)
        ]
        self.nbytes = end

    def evict(self) -> None:
        """Drop every mapped page from the process (the next read brings a page back from the page cache)."""
        if hasattr(self._map, "madvise"):  # Linux and macOS; elsewhere the pages stay until the OS takes them
            self._map.madvise(mmap.MADV_DONTNEED)


def map_weights(arrays: Sequence[np.ndarray]) -> WeightFile | None:
    """``arrays`` in a WeightFile, or None when the temporary folder cannot take them (they stay in memory)."""
    try:
        return WeightFile(arrays)
    except OSError:
        return None
