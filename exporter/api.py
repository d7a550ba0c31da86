"""export_int4: load an FP32 ONNX model, rewrite it, write it out safely."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import helper

from .options import DEFAULT_COMPUTE, ExportOptions
from .quantize import DEFAULT_SCALE_RULE
from .rewrite import ExportSummary, rewrite_model
from .sensitivity import DEFAULT_TARGET_COSINE, Feeds, export_mixed
from .simplify import simplify_model

# Protobuf cannot serialise 2 GiB; above this the attributes go to an external data file.
EXTERNAL_DATA_THRESHOLD = 1 << 30

ModelSource = str | os.PathLike | onnx.ModelProto


class ExportError(Exception):
    """The export could not be done; the message says which file or node and why."""


class NothingToQuantize(ExportError):
    """The model has no MatMul/Gemm the exporter can quantize; ``summary`` says why for each."""

    def __init__(self, summary: ExportSummary) -> None:
        super().__init__(
            "nothing to quantize: no eligible MatMul/Gemm with a constant float32 weight\n" + summary.format()
        )
        self.summary = summary


@functools.lru_cache(maxsize=1)
def max_ir_version() -> int:
    """Highest ONNX IR version the installed onnxruntime loads (probed once with a one-node model)."""
    import onnxruntime as ort

    for ir in range(onnx.IR_VERSION, 3, -1):
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [x],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
        probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=ir)
        try:
            ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # noqa: BLE001 - any failure means "not this IR version"
            continue
    raise ExportError("the installed onnxruntime loads no ONNX IR version >= 4")


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model file (with its external data), with an error that names the file."""
    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: no such file")
    try:
        model = onnx.load(str(p))
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ExportError(f"{p}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    except OSError as e:
        raise ExportError(f"{p}: cannot read ({e})") from e
    # Protobuf parses an empty file, and some short text files, as an empty message.
    if model.ir_version == 0 or not model.HasField("graph"):
        raise ExportError(f"{p}: not an ONNX model (no IR version or no graph)")
    return model


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def save_model(model: onnx.ModelProto, output: str | os.PathLike) -> None:
    """Write ``model`` to ``output`` atomically; attributes go to ``<output>.data`` when the model is over 1 GiB."""
    out = Path(output)
    if not out.parent.is_dir():
        raise ExportError(f"{out}: folder {out.parent} does not exist")
    external = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    if external:
        # onnx moves tensors out of the proto it saves; the caller's model must stay whole.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        onnx.save_model(
            model,
            tmp,
            save_as_external_data=external,
            all_tensors_to_one_file=True,
            location=f"{out.name}.data",
            convert_attribute=True,  # our weights live in node attributes, not initializers
        )
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_int4(
    model: ModelSource,
    output: str | os.PathLike | None = None,
    *,
    group_size: int = 32,
    exclude: Iterable[str] = (),
    min_size: int = 0,
    scale_rule: str = DEFAULT_SCALE_RULE,
    compute: str = DEFAULT_COMPUTE,
    feeds: str | os.PathLike | Feeds | None = None,
    target_cosine: float = DEFAULT_TARGET_COSINE,
    quiet: bool = False,
    fold_input_initializers: bool | None = None,
    simplify: bool = False,
) -> onnx.ModelProto:
    """Quantize each eligible MatMul/Gemm of ``model`` (path or ModelProto) to CimInt4MatMul; write ``output`` if given.

    ``scale_rule``: one of SCALE_RULES (see exporter.scale_rules); ``compute``: the
    ``compute`` attribute of every node ("fp32" or "int8"). With ``feeds`` (an .npz path or
    a dict of input arrays) the most sensitive layers stay FP32 until the outputs reach
    ``target_cosine`` on them (see exporter.sensitivity).
    ``fold_input_initializers``: see ExportOptions; ``simplify`` runs onnxsim first (extra ``simplify``).
    Raises NothingToQuantize when no node qualifies, ExportError for unreadable input or
    an output path that is the input, ValueError for a bad option.
    """
    source_path = None if isinstance(model, onnx.ModelProto) else Path(model)
    if output is not None and source_path is not None and _same_file(source_path, Path(output)):
        raise ExportError(f"{output}: output path is the input file; choose another output path")
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    quantized, summary = export_with_summary(
        proto,
        group_size=group_size,
        exclude=exclude,
        min_size=min_size,
        scale_rule=scale_rule,
        compute=compute,
        feeds=feeds,
        target_cosine=target_cosine,
        fold_input_initializers=fold_input_initializers,
        simplify=simplify,
    )
    if not quiet:
        print(summary.format())
    if output is not None:
        save_model(quantized, output)
        if not quiet:
            print(f"cim-int4: wrote {output}")
    return quantized


def export_with_summary(
    model: onnx.ModelProto,
    *,
    group_size: int = 32,
    exclude: Iterable[str] = (),
    min_size: int = 0,
    scale_rule: str = DEFAULT_SCALE_RULE,
    compute: str = DEFAULT_COMPUTE,
    feeds: str | os.PathLike | Feeds | None = None,
    target_cosine: float = DEFAULT_TARGET_COSINE,
    fold_input_initializers: bool | None = None,
    simplify: bool = False,
) -> tuple[onnx.ModelProto, ExportSummary]:
    """Like export_int4 on a ModelProto, returning the summary too and printing nothing."""
    options = ExportOptions(group_size, tuple(exclude), min_size, scale_rule, compute, fold_input_initializers)
    note = None
    if simplify:
        model, note = simplify_model(model)
    if feeds is None:
        quantized, summary = rewrite_model(model, options)
    else:
        quantized, summary = export_mixed(model, feeds, target_cosine, options)
    if note:
        summary.warnings.insert(0, note)
    if not summary.rewritten:
        mixed = summary.mixed_precision
        if mixed is not None and mixed.layers:
            least = max(mixed.layers, key=lambda x: x.cosine_alone)
            raise ExportError(
                f"target cosine {target_cosine} needs every layer in FP32: even {least.name!r} alone in INT4 "
                f"gives {least.cosine_alone:.6f}; lower --target-cosine or check the calibration inputs"
            )
        raise NothingToQuantize(summary)
    quantized.ir_version = min(quantized.ir_version, max_ir_version())
    return quantized, summary
