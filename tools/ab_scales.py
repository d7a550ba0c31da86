"""int8 vs float16 group scales on one chain: paired per-round ratios (docs/widths.md, "8-bit group scales").

    CIM_INT4_VARIANT=n4-nopf .venv/bin/python tools/ab_scales.py [--rounds 41] [--layers 16] [--dim 4096] [--m 1]

Both compute modes, 1 and 2 threads; prints each form's median time and the median (and quartiles)
over rounds of float16's time over int8's in the same round, with the CPU's name.
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial

import numpy as np
from measure_widths import cim_chain

from cim_int4.bench.machine import cpu_model
from cim_int4.bench.runner import bench_session
from cim_int4.bench.timing import interleaved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--m", type=int, default=1, help="rows of the input (1: decode; 128: prefill)")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}; variant {os.environ.get('CIM_INT4_VARIANT', 'as tuned')}; "
          f"{args.layers} x {args.dim}^2, M = {args.m}, {args.rounds} rounds")
    for compute in ("int8", "fp32"):
        models = {name: cim_chain(4, dtype, args.dim, args.layers, compute)
                  for name, dtype in (("f16", np.float16), ("i8", np.int8))}
        for threads in (1, 2):
            sessions = {name: bench_session(model, threads) for name, model in models.items()}
            feeds = {"x0": np.random.default_rng(1).standard_normal((args.m, args.dim)).astype(np.float32)}
            calls = {name: partial(s.run, None, feeds) for name, s in sessions.items()}
            for call in calls.values():
                call()
            t = interleaved(calls, min_rounds=args.rounds, max_rounds=args.rounds, max_time=0.0)
            r = sorted(a / b for a, b in zip(t["f16"], t["i8"], strict=True))
            q1, q3 = r[(len(r) - 1) // 4], r[3 * (len(r) - 1) // 4]
            print(f"{compute} mode, {threads} thread(s): f16 {statistics.median(t['f16']) * 1e3:.2f} ms, "
                  f"i8 {statistics.median(t['i8']) * 1e3:.2f} ms; f16/i8 {statistics.median(r):.3f} "
                  f"(quartiles {q1:.3f}-{q3:.3f}), i8 faster in {sum(x > 1 for x in r)} of {len(r)} rounds")
            del sessions


if __name__ == "__main__":
    main()
