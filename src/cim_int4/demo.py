"""The main job: export a decoder stack to INT4, validate it layer by layer, benchmark it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import bench
from .exporter import export_with_summary, load_model, save_model
from .graphs import LlamaConfig, llama_decoder
from .ops import physical_cores
from .validate import compare

# The demo's benchmark: cold-cache rounds of every variant, kept short so the whole demo
# stays under a minute on a 2-core machine; `cim-int4 bench` measures longer.
DEMO_ROUNDS = (5, 15)  # min, max rounds per case
DEMO_SECONDS_PER_CASE = 4.0


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
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark summary")
    p.add_argument("--out", default=None, metavar="DIR", help="also write the FP32 and INT4 models to DIR")


def _token_dims(m: int) -> dict[str, int]:
    # The graphs/ builders name their token dimension "seq" (decoder) or "M" (matrices).
    return {"batch": 1, "seq": m, "M": m}


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; prints export summary, per-layer errors and a benchmark table. Returns the exit code."""
    threads = args.threads or len(physical_cores())
    t0 = time.perf_counter()
    if args.model:
        fp32 = load_model(args.model)
        name = Path(args.model).name
    else:
        cfg = LlamaConfig(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads)
        fp32 = llama_decoder(cfg)
        name = f"llama {cfg.layers}L h{cfg.hidden} i{cfg.intermediate}"
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

    report = compare(fp32, int4, dims=_token_dims(args.seq), threads=threads, extra=r"layer\d+\.output")
    shapes = ", ".join(f"{k} {list(shape)}" for k, (shape, _) in report.feeds.items())
    print(f"\n== validation: cim-int4 vs FP32 ONNX Runtime, tensor by tensor ({threads} threads, input {shapes})")
    print("\n".join("   " + line for line in report.format_table().splitlines()))
    print("   " + report.summary())

    if not args.no_bench:
        print(f"\n== benchmark summary: decode (M=1) and prefill (M={args.seq}), {threads} pinned threads")
        suite = bench.Suite(
            "demo",
            (bench.Workload(name, lambda: fp32, _token_dims),),
            ms=(1, args.seq),
            min_rounds=DEMO_ROUNDS[0],
            max_rounds=DEMO_ROUNDS[1],
            max_time=DEMO_SECONDS_PER_CASE,
            retries=0,
            memory=False,  # a fresh process per variant: `cim-int4 bench` measures it
        )
        report = bench.run_suite(suite, threads=[threads], progress=bench.Progress(quiet=True))
        print(bench.format_header(report))
        print()
        print(bench.format_table(report))
        print()
        print(bench.format_legend())
        print("   (longer and more shapes: cim-int4 bench --quick, or the full run in docs/benchmarks.md)")
    print(f"\ntotal demo time {time.perf_counter() - t0:.1f} s")
    return 0
