"""The ``cim-int4`` command: export, validate, demo, bench."""

from __future__ import annotations

import argparse
import sys

from .exporter import (
    DEFAULT_COMPUTE,
    DEFAULT_GROUP_SIZE,
    DEFAULT_SCALE_RULE,
    SCALE_RULES,
    SUPPORTED_GROUP_SIZES,
    ExportError,
    NothingToQuantize,
    export_int4,
)
from .exporter.sensitivity import DEFAULT_TARGET_COSINE
from .ops.reference import COMPUTE_MODES


def _export(args: argparse.Namespace) -> int:
    if args.target_cosine is not None and args.feeds is None:
        raise ValueError("--target-cosine needs --feeds DATA.npz (the calibration inputs it is measured on)")
    export_int4(
        args.model,
        args.output,
        group_size=args.group_size,
        exclude=args.exclude,
        min_size=args.min_size,
        scale_rule=args.scale_rule,
        compute=args.compute,
        feeds=args.feeds,
        target_cosine=DEFAULT_TARGET_COSINE if args.target_cosine is None else args.target_cosine,
        quiet=args.quiet,
    )
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .exporter import load_model
    from .graphs import random_input
    from .validate import compare

    fp32, int4 = load_model(args.fp32), load_model(args.int4)
    feeds = random_input(fp32, dict(args.dim or []), seed=args.seed)
    for e in compare(fp32, int4, feeds, threads=args.threads, extra=args.extra):
        print(e.format())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _dim(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=INT for a symbolic dimension, got {text!r}")
    return name, int(value)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cim-int4``."""
    parser = argparse.ArgumentParser(prog="cim-int4", description="INT4 weight-only quantization for ONNX Runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="quantize an FP32 ONNX model's MatMul/Gemm weights to CimInt4MatMul")
    p.add_argument("model", help="FP32 .onnx file (read, never modified)")
    p.add_argument("-o", "--output", required=True, help="where to write the INT4 model (not the input file)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=SUPPORTED_GROUP_SIZES)
    p.add_argument(
        "--exclude",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME_OR_REGEX",
        help="node names (or regular expressions matching whole names) to leave in FP32; may be repeated",
    )
    p.add_argument("--min-size", type=int, default=0, metavar="N", help="skip weights with fewer than N elements")
    p.add_argument(
        "--scale-rule",
        choices=SCALE_RULES,
        default=DEFAULT_SCALE_RULE,
        help=f"how each group's scale is chosen (default {DEFAULT_SCALE_RULE}; README 'Accuracy')",
    )
    p.add_argument(
        "--compute",
        choices=COMPUTE_MODES,
        default=DEFAULT_COMPUTE,
        help=f"the nodes' compute mode: fp32 or int8 activations (default {DEFAULT_COMPUTE})",
    )
    p.add_argument(
        "--feeds",
        metavar="DATA.npz",
        help="calibration inputs (arrays keyed by input name): keep the most sensitive layers FP32",
    )
    p.add_argument(
        "--target-cosine",
        type=float,
        metavar="C",
        help=f"with --feeds: worst output cosine vs FP32 to reach on them (default {DEFAULT_TARGET_COSINE})",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=_export)

    p = sub.add_parser("validate", help="compare an INT4 model with its FP32 original, tensor by tensor")
    p.add_argument("fp32")
    p.add_argument("int4")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dim", type=_dim, action="append", metavar="NAME=INT", help="value of a symbolic input dim")
    p.add_argument("--extra", default=None, metavar="REGEX", help="also compare tensors whose name matches")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_validate)

    p = sub.add_parser("demo", help="export the default decoder stack, validate it and time FP32 vs INT4")
    from .demo import add_arguments as demo_arguments

    demo_arguments(p)
    p.set_defaults(func=_demo)

    from . import bench

    p = sub.add_parser("bench", help="latency of FP32 ORT, ORT MatMulNBits and CimInt4MatMul, with bandwidth")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cim-int4`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NothingToQuantize as e:
        print(f"cim-int4: {e}", file=sys.stderr)
        return 3
    except (ExportError, ValueError, FileNotFoundError) as e:
        print(f"cim-int4: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
