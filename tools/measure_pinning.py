"""Interleaved M=1 latency of make_session's pin modes ("pool" vs "run") on a 4096x4096 chain; under a minute.

Usage: .venv/bin/python tools/measure_pinning.py [--layers 8] [--runs 150]
On a shared machine the numbers are indicative only (docs/guide.md, make_session).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from cim_int4.graphs import matmul_chain

from cim_int4 import export_int4, make_session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=150)
    args = parser.parse_args()
    model = export_int4(matmul_chain(args.layers, 4096), quiet=True)
    x = {"x": np.random.default_rng(0).standard_normal((1, 4096), dtype=np.float32)}
    for threads in (1, 2):
        config = {"session.force_spinning_stop": "1"}
        sessions = {m: make_session(model, threads=threads, pin=m, config=config) for m in ("pool", "run")}
        for s in sessions.values():
            for _ in range(5):
                s.run(None, x)
        times: dict[str, list[float]] = {m: [] for m in sessions}
        for i in range(args.runs):
            order = list(sessions.items())
            for mode, s in order if i % 2 else order[::-1]:  # alternate who goes first
                t0 = time.perf_counter()
                s.run(None, x)
                times[mode].append(time.perf_counter() - t0)
        for mode, ts in times.items():
            p10 = np.percentile(ts, 10) * 1e3
            print(f"threads={threads} pin={mode}: median {statistics.median(ts) * 1e3:.2f} ms, p10 {p10:.2f} ms")
    print(f"load average {os.getloadavg()[0]:.1f}; caller affinity after: {sorted(os.sched_getaffinity(0))}")


if __name__ == "__main__":
    main()
