"""The ``cim-int4`` command: export, validate, demo, bench."""

from __future__ import annotations

import argparse
import sys

from .exporter import DEFAULT_GROUP_SIZE, SUPPORTED_GROUP_SIZES, ExportError, NothingToQuantize, export_int4


def _export(args: argparse.Namespace) -> int:
    export_int4(
        args.model,
        args.output,
        group_size=args.group_size,
        exclude=args.exclude,
        min_size=args.min_size,
        quiet=args.quiet,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .exporter.convert import convert_file

    convert_file(args.model, args.output, compute=args.compute, quiet=args.quiet)
    return 0


def _genai(args: argparse.Namespace) -> int:
    from .genai import prepare

    prepare(args.folder, args.output, compute=args.compute, group_size=args.group_size, quiet=args.quiet)
    return 0


def _genai_bench(args: argparse.Namespace) -> int:
    import json

    from .genai_bench import compare, format_comparison

    report = compare(
        args.folder, prompt_len=args.prompt_len, steps=args.steps, repeats=args.repeats, threads=args.threads
    )
    print(format_comparison(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
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
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=_export)

    from .exporter.convert import COMPUTE_CHOICES

    compute_help = "CimInt4MatMul compute mode; auto: int8 where MatMulNBits had accuracy_level 4, else fp32"
    p = sub.add_parser("convert", help="rewrite ORT MatMulNBits nodes (4-bit, symmetric) as CimInt4MatMul")
    p.add_argument("model", help="ONNX file with com.microsoft MatMulNBits nodes (read, never modified)")
    p.add_argument("-o", "--output", required=True, help="where to write the converted model (not the input file)")
    p.add_argument("--compute", choices=COMPUTE_CHOICES, default="auto", help=compute_help)
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=_convert)

    p = sub.add_parser("genai", help="make a copy of an onnxruntime-genai model folder that runs CimInt4MatMul")
    p.add_argument("folder", help="genai model folder with genai_config.json (read, never modified)")
    p.add_argument("-o", "--output", default=None, help="new folder to write (default: FOLDER-cim-int4)")
    p.add_argument("--compute", choices=COMPUTE_CHOICES, default="auto", help=compute_help)
    group_help = "group size when the folder's model is FP32 and gets exported"
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=SUPPORTED_GROUP_SIZES, help=group_help)
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=_genai)

    p = sub.add_parser("genai-bench", help="tokens/s in onnxruntime-genai: MatMulNBits vs CimInt4MatMul")
    p.add_argument("folder", help="genai model folder whose decoder has MatMulNBits nodes (read, never modified)")
    p.add_argument("--steps", type=int, default=32, help="new tokens per run")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: genai's)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=_genai_bench)

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
