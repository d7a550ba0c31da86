"""Interleaved timing of several calls, and the relative error of an output."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np


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
