"""``cim-int4 bench`` (and ``python -m cim_int4.bench``): options, the run, table, JSON and plot."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from ..report import MissingPlotting, check_plotting, write_json
from .errors import BenchError
from .results import REL_ERROR_BOUND
from .runner import run_suite
from .tables import format_header, format_legend, format_memory, format_table, memory_legend, write_plot
from .variants import VARIANTS, select_variants
from .workloads import DEFAULT_THREADS, SUITES

DESCRIPTION = "Latency and resident memory of FP32 ORT, ORT MatMulNBits and CimInt4MatMul, against the read bandwidth"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``cim-int4 bench`` to ``parser``."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="a subset in 1-2 minutes: a 4096x4096 layer and the decoder at M=1 (default: the full run, ~15 min)",
    )
    size.add_argument("--tiny", action="store_true", help="tiny shapes in seconds: checks that everything runs")
    parser.add_argument("--json", metavar="OUT.json", help="write every result, with raw timings, as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="draw latency and %% of bandwidth per case (matplotlib)")
    parser.add_argument(
        "--threads",
        type=_int_list,
        default=list(DEFAULT_THREADS),
        metavar="1,2",
        help="intra-op thread counts, each pinned to its own core (default: 1,2)",
    )
    parser.add_argument(
        "--variants",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        metavar="NAMES",
        help=f"comma-separated subset of {','.join(v.name for v in VARIANTS)} (fp32 is always run)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="time with the weights in cache (four untimed calls first) instead of evicting: shows the cache effect",
    )
    parser.add_argument("--min-rounds", type=int, metavar="N", help="rounds per case at least (default: by suite)")
    parser.add_argument(
        "--retries",
        type=int,
        metavar="N",
        help="measure a case again up to N times when other processes disturbed it (default: 1; --tiny: 0)",
    )
    parser.add_argument(
        "--max-time", type=float, metavar="S", help="seconds per case after which rounds stop (default: by suite)"
    )
    parser.add_argument(
        "--genai",
        metavar="DIR",
        help="also time greedy decoding in onnxruntime-genai: the MatMulNBits model folder DIR against its "
        "CimInt4MatMul conversion (tokens/s; the same as `cim-int4 genai-bench DIR`)",
    )
    parser.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the resident-memory table (one fresh process per workload and variant, ~1 s each)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``cim-int4 bench``: print the table (and write JSON / plot); 0 if all ran and all outputs are accurate."""
    suite = SUITES["quick" if args.quick else "tiny" if args.tiny else "full"]
    if args.retries is not None:
        suite = dataclasses.replace(suite, retries=max(0, args.retries))
    if args.min_rounds is not None or args.max_time is not None:
        min_rounds = args.min_rounds if args.min_rounds is not None else suite.min_rounds
        suite = dataclasses.replace(
            suite,
            min_rounds=min_rounds,
            max_rounds=max(suite.max_rounds, min_rounds),
            max_time=args.max_time if args.max_time is not None else suite.max_time,
        )
    if args.no_memory:
        suite = dataclasses.replace(suite, memory=False)
    try:
        variants = select_variants(args.variants)
        if args.plot:
            check_plotting()  # before minutes of measuring, not after
        report = run_suite(suite, threads=args.threads, variants=variants, cold=not args.warm)
    except (BenchError, MissingPlotting, ValueError, FileNotFoundError) as e:
        print(f"cim-int4 bench: error: {e}", file=sys.stderr)
        return 2
    print(format_header(report))
    print()
    print(format_table(report))
    print()
    print(format_legend())
    if report.memory:
        print()
        print(format_memory(report))
        print(memory_legend(report))
    result = report.to_json()
    if args.genai:
        from ..genai_bench import compare, format_comparison

        try:
            result["genai"] = compare(args.genai, threads=min(args.threads or [1]))
        except (ImportError, OSError, ValueError) as e:
            print(f"cim-int4 bench: error: --genai {args.genai}: {e}", file=sys.stderr)
            return 2
        print()
        print(format_comparison(result["genai"]))
    if args.json:
        write_json(result, args.json)
        print(f"cim-int4 bench: wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"cim-int4 bench: wrote {args.plot}")
    inaccurate = [row for row in report.rows() if not row.accurate]
    for row in inaccurate:
        r = row.result
        print(
            f"cim-int4 bench: {r.variant} on {r.case}: output differs from FP32 by {r.rel_error:.3f} "
            f"(relative RMS), above the INT4 bound {REL_ERROR_BOUND}",
            file=sys.stderr,
        )
    return 1 if inaccurate else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cim_int4.bench``: the same as ``cim-int4 bench``."""
    parser = argparse.ArgumentParser(prog="cim-int4 bench", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
