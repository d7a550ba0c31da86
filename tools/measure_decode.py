"""The per-CPU kernel table of docs/benchmarks.md: one interleaved run of the 16 x 4096^2 chain.

Beside FP32 ORT and MatMulNBits (accuracy levels 0 and 4) it times CimInt4MatMul in both compute
modes as this machine runs them (its tuned profile, if any), and, on request, the same with the
table's fixed default variants, with the AVX2 path forced, or with any named variant forced
(``CIM_INT4_VARIANT``), or both modes with another build of the op library (``--library``: an
A/B of two builds in one run), so that every ratio of the table comes from the same rounds.

    .venv/bin/python tools/measure_decode.py --ms 1 --threads 1,2 --fixed --avx2 --json out.json
    .venv/bin/python tools/measure_decode.py --ms 128 --threads 1 --layers 4

Name the CPU (``lscpu``) beside what it prints; on a shared machine say how loaded it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from cim_int4.ops import tuning

from cim_int4.bench.runner import run_suite
from cim_int4.bench.tables import format_header, format_memory, format_table, memory_legend
from cim_int4.bench.variants import BASELINES, COMPUTE_MODES, Variant
from cim_int4.bench.workloads import Suite, chain


def variants(args: argparse.Namespace) -> list[Variant]:
    """The baselines, both compute modes, and the forced forms asked for."""
    fp32, int8 = COMPUTE_MODES
    out = [*BASELINES, fp32, int8]
    if args.fixed:
        # The decode variants this CPU's table runs untuned (ops/cpp/kernels/variants.h), per mode.
        fixed = tuning.current_variants()["default"]
        for mode in (fp32, int8):
            key = mode.name.split()[-1]
            out.append(dataclasses.replace(mode, name=f"{mode.name} fixed", env=(("CIM_INT4_VARIANT", fixed[key]),)))
    if args.avx2:
        out.append(dataclasses.replace(int8, name="cim-int4 int8 avx2", env=(("CIM_INT4_KERNEL", "avx2"),)))
    for name in args.variant:
        out.append(dataclasses.replace(int8, name=f"cim-int4 int8 {name}", env=(("CIM_INT4_VARIANT", name),)))
    for name in args.fp32_variant:
        out.append(dataclasses.replace(fp32, name=f"cim-int4 fp32 {name}", env=(("CIM_INT4_VARIANT", name),)))
    if args.library:
        for mode in (fp32, int8):
            env = (("CIM_INT4_LIBRARY", args.library),)
            out.append(dataclasses.replace(mode, name=f"{mode.name} other lib", env=env))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1", help="token counts, comma-separated (default 1)")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    p.add_argument("--layers", type=int, default=16, help="layers of the 4096 x 4096 chain (default 16)")
    p.add_argument("--fixed", action="store_true", help="also time both modes with the untuned default variants")
    p.add_argument("--avx2", action="store_true", help="also time int8 mode with the AVX2 path forced")
    p.add_argument("--variant", action="append", default=[], help="also time int8 mode with this variant forced")
    p.add_argument("--fp32-variant", action="append", default=[], help="also time fp32 mode with this variant forced")
    p.add_argument("--library", default=None, help="also time both modes with this build of libcim_int4_ops.so")
    p.add_argument("--rounds", type=int, default=30, help="most interleaved rounds per case (default 30)")
    p.add_argument("--memory", action="store_true", help="also measure each variant's session memory")
    p.add_argument("--json", default=None, help="write the full report here")
    args = p.parse_args()
    if args.library is not None and not os.path.isfile(args.library):
        p.error(f"--library: no file at {args.library} (expected a build of libcim_int4_ops.so)")
    suite = Suite(
        "decode-table",
        (chain(args.layers, 4096),),
        ms=tuple(int(m) for m in args.ms.split(",")),
        min_rounds=7,
        max_rounds=args.rounds,
        max_time=8.0,
        memory=args.memory,
    )
    report = run_suite(suite, threads=[int(t) for t in args.threads.split(",")], variants=variants(args))
    print(format_header(report))
    print()
    print(format_table(report))
    if report.memory:
        print(format_memory(report))
        print(memory_legend(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)


if __name__ == "__main__":
    main()
