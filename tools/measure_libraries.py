"""Two builds of the op library side by side on one 4096 x 4096 layer, interleaved in one process.

Beside FP32 MatMul and MatMulNBits acc4, each library runs the layer in both compute modes
(hot: the same input every round); medians and minima per case, ratios of medians. On a
shared host whose speed swings between minutes, ratios within one run are what count
(docs/benchmarks.md, "Evening, prefill on the same Zen 3").

    .venv/bin/python tools/measure_libraries.py OLD.so NEW.so [--m 128] [--threads 1] [--rounds 25] [--layers 16]

`--layers 16 --m 1` times decode on the 16 x 4096^2 chain instead (its int4 weights, ~145 MB,
pass the last-level cache of the machines measured here, so each round reads them from DRAM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from cim_int4.graphs import matmul_chain
from cim_int4.ops.library import LIBRARY_ENV

from cim_int4 import make_session
from cim_int4.bench.variants import quantize_cim_int4, quantize_nbits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("libraries", nargs=2, help="two libcim_int4_ops.so paths (e.g. the landed build, then yours)")
    p.add_argument("--m", type=int, default=128, help="rows of A (default 128)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--layers", type=int, default=1, help="4096 x 4096 layers in the chain (default 1)")
    args = p.parse_args()
    for lib in args.libraries:
        if not os.path.isfile(lib):
            p.error(f"library not found: {lib}")
    base = matmul_chain(args.layers, 4096)
    cim = quantize_cim_int4(base)
    sessions = {"fp32": make_session(base, args.threads), "acc4": make_session(quantize_nbits(base, 4), args.threads)}
    before = os.environ.get(LIBRARY_ENV)
    try:
        for tag, lib in zip(("A", "B"), args.libraries, strict=True):
            os.environ[LIBRARY_ENV] = lib  # read when the session registers the library
            for mode in ("fp32", "int8"):
                sessions[f"{tag} {mode}"] = make_session(cim, args.threads, compute=mode)
    finally:
        if before is None:
            os.environ.pop(LIBRARY_ENV, None)
        else:
            os.environ[LIBRARY_ENV] = before
    x = {"x": np.random.default_rng(0).standard_normal((args.m, 4096), dtype=np.float32)}
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(args.rounds + 1):
        for name, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, x)
            times[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round warms up
    gmac = args.layers * args.m * 4096 * 4096 / 1e9
    print(f"A = {args.libraries[0]}\nB = {args.libraries[1]}")
    for name, v in times.items():
        best = min(v[1:])
        ratios = f"vs FP32 {median['fp32'] / median[name]:.2f}x  vs acc4 {median['acc4'] / median[name]:.2f}x"
        print(
            f"M={args.m} threads={args.threads} {name:8s} median {median[name] * 1e3:8.2f} ms  "
            f"min {best * 1e3:8.2f} ms ({gmac / best:5.1f} GMAC/s)  {ratios}"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
