"""Decode and prefill speed of every code width and scale dtype: the table of docs/widths.md.

For each width b (2, 3, 4, 5, 6, 8), one interleaved run times, on a chain of ``--layers``
CimInt4MatMul nodes of ``--dim`` x ``--dim`` (random codes; speed does not depend on
their values): the node with float32 scales, the same with float16 scales, ORT's
MatMulNBits 4-bit with accuracy_level 4 (int8 activations: "acc4") and, where ORT runs it,
MatMulNBits 8-bit acc4; the node with int8 scales and float16 super-scales (``--int8-scales``);
at 2 and 3 bits the node with codes on the normal grid (``--normal-grid``: int8 scales, or float32);
and the read probe (ops/cpp/tools/bwprobe.cpp) once per round.
Both compute modes of ours at M = 1 and M = 128, 1 and 2 threads. GB/s is bytes of the
repacked stream (codes and scales) per second. Sessions use the kernels' default decode
variant (no tuning, no profile), so float16 and float32 scales run the same loop; with
``--tuned`` the variant this machine's profile chooses (as a user's session does: ``cim-int4
tune`` makes the profile).

    python tools/measure_widths.py [--layers 16 --dim 4096 --rounds 15] [--tuned] [--json out.json]

Prints a markdown table; on a shared machine the ratios measured in one round-robin run
are what to read (medians of per-round ratios), not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from functools import partial

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cim_int4.bench.machine import cpu_model
from cim_int4.bench.probe import BandwidthProbe
from cim_int4.bench.runner import bench_session
from cim_int4.bench.timing import interleaved
from cim_int4.contract import GRID_BITS, OP_DOMAIN, OP_TYPE, OP_VERSION, SUPER_GROUPS, SUPPORTED_BITS, int8_scales

GROUP = 32


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], dim: int, layers: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["m", dim])],
        [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, ["m", dim])], initializer=inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION),
              helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def cim_chain(
    bits: int, scale_dtype: type, dim: int, layers: int, compute: str, seed: int = 0, grid: str = "uniform"
) -> onnx.ModelProto:
    """``layers`` CimInt4MatMul nodes of random ``bits``-bit codes, scales of ``scale_dtype`` (~1/sqrt(dim) gain).

    ``np.int8``: int8 scales with their float16 super-scales (``contract.int8_scales``); ``grid``: what the
    codes stand for (every code is a level of every grid).
    """
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(layers):
        packed = rng.integers(0, 256, (dim, dim * bits // 8), dtype=np.uint8)
        values = rng.uniform(0.5, 1.5, (dim, dim // GROUP)) / (np.sqrt(dim) * (1 << (bits - 1)))
        if scale_dtype is np.int8:
            q, d = int8_scales(values.astype(np.float32))
            tensors = {"scales": q, "super_scales": d}
        else:
            tensors = {"scales": values.astype(scale_dtype)}
        nodes.append(helper.make_node(
            OP_TYPE, [f"x{i}"], [f"x{i + 1}"], name=f"l{i}", domain=OP_DOMAIN, K=dim, N=dim, group_size=GROUP,
            bits=bits, compute=compute, packed=numpy_helper.from_array(packed, "packed"),
            **({"grid": grid} if grid != "uniform" else {}),
            **{name: numpy_helper.from_array(value, name) for name, value in tensors.items()},
        ))
    return _model(nodes, [], dim, layers)


def nbits_chain(bits: int, dim: int, layers: int, seed: int = 0) -> onnx.ModelProto:
    """``layers`` ORT MatMulNBits nodes (block 32, symmetric, float32 scales, accuracy_level 4)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for i in range(layers):
        blob = rng.integers(0, 256, (dim, dim // GROUP, GROUP * bits // 8), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, dim * dim // GROUP) / (np.sqrt(dim) * (1 << (bits - 1)))).astype(np.float32)
        inits += [numpy_helper.from_array(blob, f"b{i}"), numpy_helper.from_array(scales, f"s{i}")]
        nodes.append(helper.make_node(
            "MatMulNBits", [f"x{i}", f"b{i}", f"s{i}"], [f"x{i + 1}"], name=f"l{i}", domain="com.microsoft", K=dim,
            N=dim, bits=bits, block_size=GROUP, accuracy_level=4,
        ))
    return _model(nodes, inits, dim, layers)


def stream_bytes(bits: int, scale_bytes: float, dim: int, layers: int) -> int:
    """Bytes one call reads: codes plus one scale per group (our stream; MatMulNBits' blob and scales alike)."""
    return int(layers * dim * dim * (bits * GROUP // 8 + scale_bytes) // GROUP)


def paired_ratio(baseline: list[float], times: list[float]) -> float:
    """Median over rounds of baseline time / this time (how many times faster than the baseline)."""
    return statistics.median(b / t for b, t in zip(baseline, times, strict=True))


def _probe_sample(probe: BandwidthProbe, threads: int, into: list[float]) -> None:
    into.append(probe.read(probe.probe_bytes, threads)[0] / 1e9)


def measure_width(bits: int, args: argparse.Namespace, probe: BandwidthProbe) -> list[dict]:
    """Rows of one width: each (compute mode, threads, M) case, all variants interleaved with the probe."""
    rows = []
    for compute in ("int8", "fp32"):
        dim, layers = args.dim, args.layers
        models = {
            "f32": (cim_chain(bits, np.float32, dim, layers, compute), stream_bytes(bits, 4, dim, layers)),
            "f16": (cim_chain(bits, np.float16, dim, layers, compute), stream_bytes(bits, 2, dim, layers)),
        }
        if args.int8_scales:  # one byte a group, two per super-block of SUPER_GROUPS groups
            models["i8"] = (cim_chain(bits, np.int8, dim, layers, compute),
                            stream_bytes(bits, 1 + 2 / SUPER_GROUPS, dim, layers))
        if args.normal_grid and bits in GRID_BITS:
            dtype, scale_bytes = (np.int8, 1 + 2 / SUPER_GROUPS) if args.int8_scales else (np.float32, 4)
            models["normal"] = (cim_chain(bits, dtype, dim, layers, compute, grid="normal"),
                                stream_bytes(bits, scale_bytes, dim, layers))
        if compute == "int8":  # MatMulNBits acc4 has int8 activations: beside our int8 mode
            models["nbits4_acc4"] = (nbits_chain(4, dim, layers), stream_bytes(4, 4, dim, layers))
            if bits == 8:
                models["nbits8_acc4"] = (nbits_chain(8, dim, layers), stream_bytes(8, 4, dim, layers))
        for threads in args.threads:
            sessions = {}
            for name, (model, _) in models.items():
                try:
                    sessions[name] = bench_session(model, threads)
                except Exception as e:  # noqa: BLE001 - ORT raises its own classes; a missing baseline is reported
                    print(f"  {name}: ORT does not run it here ({str(e).splitlines()[0][:120]})", file=sys.stderr)
            for m in args.m:
                feeds = {"x0": np.random.default_rng(1).standard_normal((m, args.dim)).astype(np.float32)}
                calls = {name: partial(s.run, None, feeds) for name, s in sessions.items()}
                for call in calls.values():
                    call()
                probe_gbs: list[float] = []
                sample = partial(_probe_sample, probe, threads, probe_gbs)
                rounds = args.rounds if m == 1 else args.prefill_rounds
                samples = interleaved(calls, min_rounds=rounds, max_rounds=rounds, max_time=0.0, between_rounds=sample)
                probe_median = statistics.median(probe_gbs)
                for name, times in samples.items():
                    t = statistics.median(times)
                    gbs = models[name][1] / t / 1e9
                    # Speed-ups as the median of per-round ratios: each round's calls ran back to
                    # back, so the load of the moment cancels out of their ratio.
                    vs_f32 = paired_ratio(samples["f32"], times)
                    vs_acc4 = paired_ratio(samples["nbits4_acc4"], times) if "nbits4_acc4" in samples else None
                    rows.append({
                        "bits": bits, "compute": compute, "threads": threads, "m": m, "variant": name,
                        "ms": t * 1e3, "gb_s": gbs, "of_probe": gbs / probe_median, "probe_gb_s": probe_median,
                        "vs_f32": vs_f32, "vs_acc4": vs_acc4, "rounds": len(times),
                    })
                    print(f"  b={bits} {compute} t={threads} M={m} {name}: {t * 1e3:.2f} ms {gbs:.1f} GB/s "
                          f"({gbs / probe_median:.2f} of probe) {vs_f32:.3f}x f32", file=sys.stderr)
            del sessions
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| bits | mode | threads | M | variant | ms | GB/s | of probe | vs f32 scales | vs acc4 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc4 = f"{r['vs_acc4']:.2f}x" if r["vs_acc4"] is not None else "-"
        out.append(f"| {r['bits']} | {r['compute']} | {r['threads']} | {r['m']} | {r['variant']} | {r['ms']:.2f} | "
                   f"{r['gb_s']:.1f} | {r['of_probe']:.2f} | {r['vs_f32']:.3f}x | {acc4} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds at M = 1")
    parser.add_argument("--prefill-rounds", type=int, default=5, help="interleaved rounds at M > 1")
    parser.add_argument("--bits", type=int, nargs="+", default=list(SUPPORTED_BITS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--int8-scales", action="store_true", help="also time int8 scales with super-scales")
    parser.add_argument("--normal-grid", action="store_true", help="at 2 and 3 bits also time the normal grid's codes")
    parser.add_argument("--tuned", action="store_true",
                        help="run the variant this machine's profile chooses, not the kernels' default")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if not args.tuned:  # the kernels' default decode variant for every session: no tuning, no profile
        os.environ["CIM_INT4_TUNE"] = "off"
        os.environ["CIM_INT4_PROFILE"] = os.path.join(tempfile.mkdtemp(), "none.json")
    probe = BandwidthProbe.for_this_machine()
    rows = []
    for bits in args.bits:
        rows += measure_width(bits, args, probe)
    variant = "the profile's variant" if args.tuned else "the default variant"
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f}, {variant}; "
          f"chain {args.layers} x {args.dim}^2, group {GROUP}, {args.rounds} interleaved rounds at M = 1 "
          f"({args.prefill_rounds} at M > 1), medians")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
