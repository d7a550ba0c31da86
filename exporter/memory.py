"""Memory of a calibrated export: glibc's heap (mapped large blocks, trimming) and the kept FP32 outputs.

``bounded_heap`` and ``release_memory`` keep freed memory from staying resident; a
``ReferenceStore`` keeps the FP32 outputs of the calibration batches for later comparisons, in
memory while small, else in a temporary folder.
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

# FP32 reference outputs of all batches are kept across comparisons up to this size (float32;
# an LLM's logits are 0.1-0.5 GB a window): in memory up to REFERENCE_RAM_BYTES, else on disk.
REFERENCE_BYTES = 4 << 30
REFERENCE_RAM_BYTES = 64 << 20
# Over this size (float32) they are kept as float16 where that stays finite.
REFERENCE_COMPACT_BYTES = 512 << 20

# While a calibrated export runs, blocks from this size on are mapped, and unmapped when freed, instead
# of coming from glibc's heaps: ORT's per-node buffers (the probe session has no arena) and NumPy's
# temporaries of many sizes interleave there, and freed heap pages stay resident. Measured on a
# 0.1B LLM (docs/widths.md): a probe run with every layer quantized peaked at 1.29-1.59 GB, with it 1.0 GB.
HEAP_MMAP_BYTES = 1 << 20
# Afterwards the threshold is left where glibc's own sliding threshold ends after large frees (its
# 64-bit maximum): the process keeps the heap's speed for the mid-sized blocks.
_MMAP_BYTES_AFTER = 32 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@contextmanager
def bounded_heap() -> Iterator[None]:
    """Map blocks of ``HEAP_MMAP_BYTES`` and more while inside (glibc; nothing elsewhere or when the user set it).

    An environment variable (``MALLOC_MMAP_THRESHOLD_``, or the tunable in ``GLIBC_TUNABLES``) wins.
    """
    libc = None
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and "mmap_threshold" not in os.environ.get("GLIBC_TUNABLES", ""):
        libc = _glibc("mallopt")
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_BYTES)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES_AFTER)


def release_memory() -> None:
    """Free what only reference cycles still hold, then hand freed heap pages back to the OS.

    A rewriter's objects refer to each other (bound methods), so the weights it read stay alive
    until the cyclic collector runs; glibc keeps freed pages after a big model copy is dropped
    (``malloc_trim``; a no-op elsewhere).
    """
    gc.collect()
    libc = _glibc("malloc_trim")
    if libc is not None:
        libc.malloc_trim(0)


def _glibc(function: str) -> ctypes.CDLL | None:
    """glibc, when this process has it and it has ``function``; None elsewhere (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        getattr(libc, function)
    except (OSError, AttributeError):
        return None
    return libc


def _compact(x: np.ndarray) -> np.ndarray:
    """A float32 output as float16 when that keeps it finite (a cosine near 1 moves by ~1e-7), else as it is."""
    if x.dtype != np.float32 or x.size == 0 or not np.all(np.abs(x) < 6e4):
        return x
    return x.astype(np.float16)


def compact_outputs(outputs: list[np.ndarray]) -> list[np.ndarray]:
    """Model outputs kept for a later comparison, float16 where that stays finite."""
    return [_compact(o) for o in outputs]


class ReferenceStore:
    """The FP32 outputs of ``batches`` batches, kept for later comparisons.

    Sized from the first batch's outputs: float16 (where that stays finite) when all of them
    in float32 pass REFERENCE_COMPACT_BYTES; in memory when they fit REFERENCE_RAM_BYTES, else
    one .npy file per output in a temporary folder (removed with the store), read back a batch
    at a time, so that an LLM's logits do not sit in memory beside the exported model's session.
    ``for_outputs`` makes one, or None when they are not worth keeping (REFERENCE_BYTES).
    """

    def __init__(self, batches: int, first: Sequence[np.ndarray]) -> None:
        size = sum(o.nbytes for o in first) * batches
        self.compact = size > REFERENCE_COMPACT_BYTES
        self._memory: dict[int, list[np.ndarray]] = {}
        self._files: dict[int, list[Path]] = {}
        self._folder = None
        if size > REFERENCE_RAM_BYTES:
            self._folder = tempfile.TemporaryDirectory(prefix="cim-int4-reference-")

    @classmethod
    def for_outputs(cls, batches: int, first: Sequence[np.ndarray]) -> ReferenceStore | None:
        """A store for ``batches`` batches like ``first``; None when too big to keep (run again when needed)."""
        return cls(batches, first) if sum(o.nbytes for o in first) * batches <= REFERENCE_BYTES else None

    def put(self, index: int, outputs: Sequence[np.ndarray]) -> bool:
        """Keep batch ``index``'s outputs; False (nothing kept) when the temporary folder cannot take them."""
        kept = compact_outputs(list(outputs)) if self.compact else list(outputs)
        if self._folder is None:
            self._memory[index] = kept
            return True
        paths = [Path(self._folder.name) / f"{index}-{j}.npy" for j in range(len(kept))]
        try:
            for path, x in zip(paths, kept, strict=True):
                np.save(path, x, allow_pickle=False)
        except OSError:
            for path in paths:
                path.unlink(missing_ok=True)
            return False
        self._files[index] = paths
        return True

    def get(self, index: int) -> list[np.ndarray] | None:
        """Batch ``index``'s outputs, or None when they were not kept."""
        if index in self._memory:
            return self._memory[index]
        if index in self._files:
            return [np.load(path, allow_pickle=False) for path in self._files[index]]
        return None

    def __len__(self) -> int:
        return len(self._memory) + len(self._files)

    def __contains__(self, index: int) -> bool:
        return index in self._memory or index in self._files
