"""The ``cim-int4`` command: export, validate, demo, bench, serve, tune."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import NoReturn

from .contract import COMPUTE_MODES, DEFAULT_COMPUTE, DEFAULT_GROUP_SIZE, GRIDS, SCALE_DTYPES, SUPPORTED_GROUP_SIZES
from .exporter import (
    DEFAULT_SCALE_RULE,
    SCALE_RULES,
    ExportError,
    ExportOptions,
    NothingToQuantize,
    export_int4,
)
from .exporter.options import CALIBRATED, DEFAULT_METHOD, DEFAULT_TARGET_COSINE, METHODS
from .exporter.quantize import DEFAULT_SCALE_DTYPE
from .ops.reference_backend import ReferenceBackendUnavailable, extensions_library
from .report import MissingPlotting
from .serving import commands as serving


def export_options(args: argparse.Namespace) -> ExportOptions:
    """The ExportOptions of ``cim-int4 export``'s flags: each flag whose ``dest`` is a field name (None: default)."""
    if getattr(args, "target_cosine", None) is not None and args.feeds is None:
        raise ValueError("--target-cosine needs --feeds DATA.npz (the calibration inputs it is measured on)")
    if getattr(args, "method", None) in CALIBRATED and getattr(args, "feeds", None) is None:
        raise ValueError(f"--method {args.method} needs --feeds DATA.npz (the calibration inputs it learns from)")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ExportOptions) if hasattr(args, f.name)}
    # None means "not given" except for fold_input_initializers, where None is a value (warn).
    keep = {name: v for name, v in given.items() if v is not None or name == "fold_input_initializers"}
    return ExportOptions(**keep)


def _add_no_fuse_gated(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-fuse-gated",
        dest="fuse_gated",
        action="store_const",
        const=False,
        default=None,
        help="keep each gated MLP's gate and up projections, activation and product as separate nodes; by default "
        "they become one gated CimInt4MatMul (docs/contract.md, 'Gated MLPs')",
    )


def _export(args: argparse.Namespace) -> int:
    export_int4(args.model, args.output, export_options(args), quiet=args.quiet)
    return 0


# Exit code of ``validate`` when a quantized layer does not match its dequantized weights.
DIVERGED = 4
# Exit code of any command stopped by an ONNX Runtime error (printed as one line).
ORT_ERROR = 5


def _convert(args: argparse.Namespace) -> int:
    from .exporter.convert import convert_file

    convert_file(args.model, args.output, export_options(args), quiet=args.quiet)
    return 0


def _genai(args: argparse.Namespace) -> int:
    from .genai import prepare

    prepare(
        args.folder,
        args.output,
        compute=args.compute,
        group_size=args.group_size,
        quiet=args.quiet,
        keep_embedding=args.keep_embedding,
        scale_dtype=args.scale_dtype,
        fuse_gated=args.fuse_gated is not False,
    )
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
    from .report import check_plotting, write_json
    from .validate import compare

    if args.plot:
        check_plotting()  # before the work, not after it
    if args.backend == "reference":
        extensions_library()  # fail before the long runs when the extra is missing
    report = compare(
        args.fp32,
        args.int4,
        args.feeds,
        dims=dict(args.dim or []),
        int_range=args.int_range,
        seed=args.seed,
        threads=args.threads,
        extra=args.extra,
        all_tensors=args.all,
        compute=args.compute,
        backend_check=args.backend == "reference",
    )
    print(report.format_table())
    if report.backends is not None:
        print(report.format_backends())
    print(report.summary())
    if args.json:
        write_json(report.to_json(), args.json)
        print(f"cim-int4: wrote {args.json}")
    if args.plot:
        report.write_plot(args.plot)
        print(f"cim-int4: wrote {args.plot}")
    return DIVERGED if report.first_divergent else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _dim(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=INT for a symbolic dimension, got {text!r}")
    return name, int(value)


def _int_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        values = int(low), int(high)
    except ValueError:
        values = None
    if not sep or values is None or values[0] >= values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH integers with LOW < HIGH (HIGH exclusive), got {text!r}")
    return values


def _add_external_data(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--external-data",
        action="store_true",
        help="keep the tensors in OUTPUT.data whatever the size: a session loaded from it holds 2x the int4 "
        "weights instead of 3x (docs/design.md 'Session memory'; default: only over 1 GiB)",
    )


def _bits_flag(text: str) -> object:
    from .exporter.widths import parse_bits

    try:
        return parse_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_widths(p: argparse.ArgumentParser) -> None:
    from .exporter.options import BITS_SENSITIVITIES

    p.add_argument(
        "--bits",
        type=_bits_flag,
        default=None,
        metavar="B|auto|PATTERN=B,...",
        help="code width of the layers: 2, 3, 4, 5, 6 or 8 (default 4); PATTERN=B,... per node name or regex "
        "(others 4); auto: chosen per layer from sensitivity on --feeds (docs/widths.md)",
    )
    p.add_argument(
        "--bits-budget",
        type=float,
        default=None,
        metavar="B",
        help="with --bits auto: average bits per weight, scales included (e.g. 3.5, 4.5); "
        "without it auto reaches --target-cosine with the fewest bytes",
    )
    p.add_argument(
        "--bits-sensitivity",
        choices=BITS_SENSITIVITIES,
        default=None,
        help="with --bits auto: exact (one run per layer and width), proxy (E[x^2] x weight error, one run per "
        "layer) or auto (exact while it costs <= 400 runs)",
    )
    p.add_argument(
        "--scale-dtype",
        choices=SCALE_DTYPES,
        default=None,
        help=f"stored type of the group scales (default {DEFAULT_SCALE_DTYPE})",
    )
    p.add_argument(
        "--grid",
        choices=GRIDS,
        default=None,
        help="what the codes of 2- and 3-bit layers stand for: uniform steps (default) or normal, Gaussian levels "
        "(3 bits: -8 -5 -3 -1 1 3 5 8), for rotated weights (docs/widths.md)",
    )
    p.add_argument(
        "--rotate",
        action="store_true",
        default=None,
        help="first turn the residual stream of an RMS-norm decoder by a random orthogonal matrix folded into "
        "the weights: the same model, which GPTQ quantizes better (needs --method gptq or awq+gptq, and --feeds; "
        "docs/widths.md 'Rotation')",
    )
    p.add_argument(
        "--tune-epochs",
        type=int,
        default=None,
        metavar="N",
        help="after the export, train the group scales (codes fixed) for N passes over the calibration batches so "
        "the first output's softmax (an LLM's logits) comes back to FP32's; no byte more (docs/methods.md "
        "'Scale tuning'; default 0: none)",
    )
    p.add_argument("--tune-lr", type=float, default=None, metavar="LR", help="Adam's step for --tune-epochs (2e-3)")
    p.add_argument(
        "--tune-feeds",
        default=None,
        metavar="DATA.npz",
        help="calibration inputs for --tune-epochs (default --feeds)",
    )


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the usage itself is under --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``cim-int4``."""
    parser = _Parser(prog="cim-int4", description="INT4 weight-only quantization for ONNX Runtime")
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
        help=f"how each group's scale is chosen (default {DEFAULT_SCALE_RULE}: balanced up to group 32, signed above; "
        "with --feeds the rule closest to FP32 on them; docs/accuracy.md, docs/real-llm.md)",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default=DEFAULT_METHOD,
        help=f"how weights are rounded given --feeds (default {DEFAULT_METHOD}): rtn, gptq, awq, awq+gptq, or auto "
        "(the best of them on the feeds); all but rtn and auto need --feeds; docs/methods.md",
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
        help="calibration inputs (arrays keyed by input name): keep the most sensitive layers FP32, "
        "and let --scale-rule auto pick its rule on them",
    )
    p.add_argument(
        "--target-cosine",
        type=float,
        metavar="C",
        help=f"with --feeds: worst output cosine vs FP32 to reach on them (default {DEFAULT_TARGET_COSINE}; "
        "0 keeps no layer FP32)",
    )
    p.add_argument(
        "--fold-input-initializers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantize initializers also listed as graph inputs silently (default: quantize them with a warning; "
        "--no-fold-input-initializers leaves them FP32)",
    )
    p.add_argument("--simplify", action="store_true", help="run onnxsim first (pip install 'cim-int4[simplify]')")
    p.add_argument(
        "--keep-embedding",
        action="store_true",
        help="leave the token embedding (a Gather on a constant table) in FP32; by default it becomes int4 and "
        "a tied LM head shares its int4 tensors (docs/embeddings.md)",
    )
    _add_no_fuse_gated(p)
    _add_widths(p)
    _add_external_data(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success (no summary, no progress bar)")
    p.set_defaults(func=_export)

    from .exporter.options import COMPUTE_CHOICES

    compute_help = "CimInt4MatMul compute mode; auto: int8 where MatMulNBits had accuracy_level 4, else fp32"
    p = sub.add_parser("convert", help="rewrite ORT MatMulNBits nodes (4-bit, symmetric) as CimInt4MatMul")
    p.add_argument("model", help="ONNX file with com.microsoft MatMulNBits nodes (read, never modified)")
    p.add_argument("-o", "--output", required=True, help="where to write the converted model (not the input file)")
    p.add_argument("--compute", choices=COMPUTE_CHOICES, default="auto", help=compute_help)
    _add_no_fuse_gated(p)
    _add_external_data(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=_convert)

    p = sub.add_parser("genai", help="make a copy of an onnxruntime-genai model folder that runs CimInt4MatMul")
    p.add_argument("folder", help="genai model folder with genai_config.json (read, never modified)")
    p.add_argument("-o", "--output", default=None, help="new folder to write (default: FOLDER-cim-int4)")
    p.add_argument(
        "--compute",
        choices=COMPUTE_CHOICES,
        default="auto",
        help=compute_help + "; a model exported from FP32: int8 (as MatMulNBits accuracy_level 4)",
    )
    group_help = "group size when the folder's model is FP32 and gets exported"
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=SUPPORTED_GROUP_SIZES, help=group_help)
    p.add_argument(
        "--keep-embedding", action="store_true", help="when exported: leave the token embedding FP32 (see export)"
    )
    p.add_argument(
        "--scale-dtype",
        choices=SCALE_DTYPES,
        default=DEFAULT_SCALE_DTYPE,
        help=f"when exported: stored type of the group scales (default {DEFAULT_SCALE_DTYPE})",
    )
    _add_no_fuse_gated(p)
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

    p = sub.add_parser(
        "validate",
        help="compare an INT4 model with its FP32 original tensor by tensor, and check each quantized layer alone",
        description="Exit code 0: every CimInt4MatMul computes its dequantized weights and they round the FP32 ones; "
        f"{DIVERGED}: a layer diverges (named in the last line); 1: the models cannot be compared.",
    )
    p.add_argument("fp32", help="the FP32 .onnx model (external data is read in place)")
    p.add_argument("int4", help="the INT4 .onnx model exported from it")
    p.add_argument("--feeds", metavar="DATA.npz", help="input values by input name; missing inputs are generated")
    p.add_argument(
        "--dim",
        type=_dim,
        action="append",
        metavar="NAME=INT",
        help="value of a symbolic input dim (default: 8 for seq-like names, 1 for other names, 4 unnamed)",
    )
    p.add_argument(
        "--int-range",
        type=_int_range,
        metavar="LOW:HIGH",
        help="generated integer inputs in [LOW, HIGH) (default: the vocabulary of a Gather reading the input, "
        "ones for *mask*, else 0:16)",
    )
    p.add_argument("--extra", default=None, metavar="REGEX", help="also compare tensors whose name fully matches")
    p.add_argument("--all", action="store_true", help="compare every tensor both models compute")
    p.add_argument(
        "--compute",
        choices=COMPUTE_MODES,
        default=None,
        help="run every CimInt4MatMul in this compute mode (session config cim_int4.compute; default: each node's own)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    p.add_argument("--json", metavar="OUT.json", help="also write the rows and the verdict as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="also draw the error by layer depth (needs matplotlib)")
    p.add_argument(
        "--backend",
        choices=("native", "reference"),
        default="native",
        help="reference: also run the INT4 model on the NumPy reference op and check the native op against it",
    )
    p.set_defaults(func=_validate)

    from . import perplexity

    p = sub.add_parser("perplexity", help="perplexity, KL and top-1 agreement of causal LMs vs a reference on a text")
    perplexity.add_arguments(p)
    p.set_defaults(func=perplexity.run)

    from . import op_profile

    p = sub.add_parser("op-profile", help="per-operator time of one decode step of a causal LM (ORT's profiler)")
    op_profile.add_arguments(p)
    p.set_defaults(func=op_profile.run)

    p = sub.add_parser("demo", help="export the default decoder stack, validate it and time FP32 vs INT4")
    from .demo import add_arguments as demo_arguments

    demo_arguments(p)
    p.set_defaults(func=_demo)

    from . import bench

    p = sub.add_parser("bench", help="latency of FP32 ORT, ORT MatMulNBits and CimInt4MatMul, with bandwidth")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)

    p = sub.add_parser("serve", help="serve a model over HTTP on Ray Serve (pip install 'cim-int4[serve]')")
    serving.add_serve_arguments(p)
    p.set_defaults(func=serving.run_serve)

    p = sub.add_parser("bench-serve", help="requests/s and latency through Ray Serve vs one plain process")
    serving.add_bench_arguments(p)
    p.set_defaults(func=serving.run_bench)

    from . import tune_cli

    p = sub.add_parser("tune", help="time the kernel variants on this CPU and save the fastest to the per-CPU profile")
    tune_cli.add_arguments(p)
    p.set_defaults(func=tune_cli.run)
    return parser


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _is_ort_error(e: BaseException) -> bool:
    # ORT's Python errors (Fail, InvalidArgument, ...) derive from Exception only; tell them by module.
    return type(e).__module__.startswith("onnxruntime")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cim-int4`` command; returns the exit code: 1 error, 3 nothing to quantize, 4/5 see above."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NothingToQuantize as e:
        print(f"cim-int4: {e}", file=sys.stderr)
        return 3
    except (ExportError, ValueError, MissingPlotting, ReferenceBackendUnavailable, serving.MissingServe) as e:
        print(f"cim-int4: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"{e.filename}: " if e.filename and str(e.filename) not in str(e.strerror) else ""
        print(f"cim-int4: error: {where}{e.strerror or _one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cim-int4: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_ort_error(e):
            raise
        print(f"cim-int4: onnxruntime error: {_one_line(e)}", file=sys.stderr)
        return ORT_ERROR


if __name__ == "__main__":
    sys.exit(main())
