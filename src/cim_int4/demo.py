"""The main job: export a decoder stack to INT4, validate it layer by layer, time FP32 vs INT4."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .exporter import export_with_summary, load_model, save_model
from .graphs import LlamaConfig, llama_decoder, random_input
from .ops import make_session, physical_cores, session_options
from .validate import compare


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cim-int4 demo``."""
    d = LlamaConfig()
    p.add_argument("--model", default=None, help="an FP32 .onnx file instead of the built-in decoder stack")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    p.add_argument("--seq", type=int, default=16, help="prompt length for validation and the prefill timing")
    p.add_argument("--runs", type=int, default=20, help="timed runs per variant and case")
    p.add_argument("--out", default=None, metavar="DIR", help="also write the FP32 and INT4 models to DIR")


def interleaved_medians(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved (A B A B ...) after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; prints export summary, per-layer errors and latencies. Returns the exit code."""
    threads = args.threads or len(physical_cores())
    t0 = time.perf_counter()
    if args.model:
        fp32 = load_model(args.model)
        name = Path(args.model).name
    else:
        cfg = LlamaConfig(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads)
        fp32 = llama_decoder(cfg)
        name = f"llama decoder stack (hidden {cfg.hidden}, intermediate {cfg.intermediate}, {cfg.layers} layers)"
    print(f"== model: {name}")
    int4, summary = export_with_summary(fp32, group_size=args.group_size)
    print(summary.format())
    print(f"   export took {time.perf_counter() - t0:.1f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save_model(fp32, out / "model.fp32.onnx")
        save_model(int4, out / "model.int4.onnx")
        print(f"   wrote {out / 'model.fp32.onnx'} and {out / 'model.int4.onnx'}")

    seq_dims = {"seq": args.seq, "M": args.seq, "batch": 1}
    feeds = random_input(fp32, seq_dims, seed=0)
    print(f"\n== validation against FP32 ONNX Runtime ({threads} threads, input {_shapes(feeds)})")
    for e in compare(fp32, int4, feeds, threads=threads, extra=r"layer\d+\.output"):
        print("   " + e.format())

    print(f"\n== latency, median of {args.runs} interleaved runs, {threads} pinned intra-op threads")
    fp32_sess = ort.InferenceSession(
        fp32.SerializeToString(), sess_options=session_options(threads), providers=["CPUExecutionProvider"]
    )
    int4_sess = make_session(int4, threads=threads)
    fp32_bytes = sum(r.bytes_before for r in summary.rewritten)
    int4_bytes = sum(r.bytes_after for r in summary.rewritten)
    print(f"   {'case':<24}{'FP32 ORT':>12}{'cim-int4':>12}{'speed-up':>10}{'int4 GB/s':>11}")
    cases = (("decode (1 token)", {"seq": 1, "M": 1, "batch": 1}), (f"prefill ({args.seq} tokens)", seq_dims))
    for label, dims in cases:
        x = random_input(fp32, dims, seed=1)
        med = interleaved_medians(
            {"fp32": lambda x=x: fp32_sess.run(None, x), "int4": lambda x=x: int4_sess.run(None, x)}, args.runs
        )
        print(
            f"   {label:<24}{med['fp32'] * 1e3:>10.2f}ms{med['int4'] * 1e3:>10.2f}ms"
            f"{med['fp32'] / med['int4']:>9.2f}x{int4_bytes / med['int4'] / 1e9:>11.2f}"
        )
    print(f"   weights: FP32 {fp32_bytes / 1e6:.1f} MB -> INT4 {int4_bytes / 1e6:.1f} MB (packed + scales)")
    kernel = os.environ.get("CIM_INT4_KERNEL", "auto")
    print(f"   kernel path: {kernel}; total demo time {time.perf_counter() - t0:.1f} s")
    return 0


def _shapes(feeds: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in feeds.items())



