"""export_int4: load an FP32 ONNX model, rewrite it, write it out safely."""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from ..contract import OP_DOMAIN, OP_TYPE
from . import writer
from .calibration import feed_batches
from .io import ModelFileError, read_model
from .memory import bounded_heap
from .options import CALIBRATED, ExportOptions
from .rewrite import rewrite_model
from .rotate import FOLD_BITS, NotRotatable, RotationSummary, rotate_residual
from .sensitivity import export_mixed
from .simplify import simplify_model
from .summary import ExportSummary
from .tune.export import Teacher
from .widths import AUTO, CATCH_ALL
from .writer import OutputFiles, Progress, TensorStore

ModelSource = str | os.PathLike | onnx.ModelProto


class ExportError(Exception):
    """The export could not be done; the message says which file or node and why."""


class NothingToQuantize(ExportError):
    """The model has no MatMul/Gemm the exporter can quantize; ``summary`` says why for each."""

    def __init__(self, summary: ExportSummary, int4_nodes: Sequence[str] = ()) -> None:
        if int4_nodes:
            shown = ", ".join(int4_nodes[:5]) + (f" and {len(int4_nodes) - 5} more" if len(int4_nodes) > 5 else "")
            why = f"the model is already quantized: it has {len(int4_nodes)} INT4 node(s) ({shown})"
            if summary.skipped:
                why += "; the other MatMul/Gemm nodes cannot be quantized:\n" + summary.format()
        else:
            why = "no eligible MatMul/Gemm with a constant float32 weight\n" + summary.format()
        super().__init__("nothing to quantize: " + why)
        self.summary = summary
        self.int4_nodes = list(int4_nodes)


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


@contextmanager
def file_errors(path: str | os.PathLike | None) -> Iterator[None]:
    """The one mapping of file errors to ExportError: ModelFileError as is, OSError naming its file (or ``path``)."""
    try:
        yield
    except ModelFileError as e:
        raise ExportError(str(e)) from e
    except OSError as e:
        raise ExportError(f"{e.filename or path}: {e.strerror or e}") from e


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model file with its external data, with a one-line error that names the file."""
    with file_errors(path):
        model, _ = read_model(path)
        TensorStore().inline(model)
    return model


def check_output_path(source: str | os.PathLike, output: str | os.PathLike) -> None:
    """Raise ExportError unless writing ``output`` and ``<output>.data`` leaves every file ``source`` reads alone."""
    with file_errors(source):
        _, input_files = read_model(source)
        out = Path(output)
        writer.check_output(out, out.with_name(f"{out.name}.data"), input_files)


def save_model(
    model: onnx.ModelProto,
    output: str | os.PathLike,
    *,
    quiet: bool = True,
    external_data: bool = False,
    consume: bool = False,
) -> None:
    """Write ``model`` to ``output`` atomically; tensors go to ``<output>.data`` when over 1 GiB or ``external_data``.

    ``external_data=True`` halves what ORT keeps of the weights in a session loaded from ``output``
    (docs/design.md, "Session memory"). ``consume=True``: the caller hands ``model`` over, and its
    tensors move out of it instead of out of a copy (no second copy of the weights in memory); do
    not use ``model`` afterwards.
    """
    with file_errors(output), OutputFiles(output) as files:
        _commit(files, model, quiet, external_data, consume)


def _commit(files: OutputFiles, model: onnx.ModelProto, quiet: bool, external_data: bool, consume: bool) -> None:
    size = writer.model_size(model)
    if not consume and (external_data or size > writer.EXTERNAL_DATA_THRESHOLD):
        # Tensors move out of the proto that is saved; the caller's model must stay whole.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    store = TensorStore(files, Progress(size, quiet))
    files.commit(model, store, external_data=external_data)


def export_int4(
    model: ModelSource,
    output: str | os.PathLike | None = None,
    options: ExportOptions | None = None,
    *,
    quiet: bool = False,
    **overrides: Any,
) -> onnx.ModelProto:
    """Quantize each eligible MatMul/Gemm of ``model`` (path or ModelProto) to CimInt4MatMul; write ``output`` if given.

    What to do is an ExportOptions: ``options``, with any of its fields given by name as
    keywords (``export_int4(path, out, group_size=64, compute="int8")``; see ExportOptions for
    each). From a path (without ``simplify``, or AWQ with ``feeds``; see
    ``ExportOptions.whole_model``), weights are read one at a time and the output is written as
    it goes, so memory stays well under the model's size (with ``feeds``, the probe holds one FP32
    copy of the weights: docs/methods.md, "Memory and time of a calibrated export"). The output
    keeps its tensors in ``<output>.data`` when over 1 GiB, or always with ``external_data=True``:
    a session loaded from it then holds 2x the int4 weights instead of 3x (docs/design.md,
    "Session memory"). When a streamed output has external data, the returned model refers to
    ``<output>.data`` (load it from ``output``).
    Raises NothingToQuantize when no node qualifies, ExportError for unreadable input or
    an output path that would touch a file the input reads, ValueError for a bad option
    (TypeError for an unknown one).
    """
    options = (options or ExportOptions()).with_(**overrides)
    with file_errors(output):
        quantized, summary = _pipeline(model, output, options, quiet)
    _report(summary, quiet)
    if output is not None:
        _wrote(output, quiet)
    return quantized


def _pipeline(
    model: ModelSource, output: str | os.PathLike | None, options: ExportOptions, quiet: bool
) -> tuple[onnx.ModelProto, ExportSummary]:
    """Read, rewrite, write; weights stream from input to output unless the model is a proto or must be whole."""
    if options.rotate and not isinstance(model, onnx.ModelProto):
        return _rotated_pipeline(model, output, options, quiet)
    if isinstance(model, onnx.ModelProto):
        proto, input_files = model, []
    else:
        proto, input_files = read_model(model)
    stream = not isinstance(model, onnx.ModelProto) and not options.whole_model
    owned = proto is not model  # loaded here: the export may rewrite it in place
    if not stream and owned:
        TensorStore().inline(proto)  # onnxsim and the sensitivity analysis need every weight in memory
    if output is None:
        store = TensorStore() if stream else None
        quantized, summary = _export(proto, store, options, owned)
        if store is not None:
            store.inline(quantized)
        return quantized, summary
    with OutputFiles(output, input_files) as files:
        if not stream:
            quantized, summary = _export(proto, None, options, owned)
            _commit(files, quantized, quiet, options.external_data, consume=False)
            return quantized, summary
        progress = Progress(TensorStore().external_bytes(proto), quiet)
        try:
            store = TensorStore(files, progress)
            quantized, summary = _export(proto, store, options)
            files.commit(quantized, store, external_data=options.external_data)
        finally:
            progress.close()
    return quantized, summary


def _rotated_pipeline(
    model: str | os.PathLike, output: str | os.PathLike | None, options: ExportOptions, quiet: bool
) -> tuple[onnx.ModelProto, ExportSummary]:
    """Rotate the model file into a temporary copy beside the output, then export that copy as a file.

    The copy's weights then stream through the export as any file's do: a GPTQ export of SmolLM2
    peaked at 4.6x the FP32 model with the rotated model held in memory, 2.73x this way (the
    rotation itself holds the model and a few float64 copies of its largest weight). Without an
    output the copy goes to the system's temporary folder. onnxsim (``simplify``) runs first, as
    for a ModelProto.
    """
    if output is not None:
        check_output_path(model, output)
    proto = load_model(model)
    note = None
    if options.simplify:
        proto, note = simplify_model(proto)
    rotation = _rotate(proto)
    folder = Path(output).resolve().parent if output is not None else None
    with tempfile.TemporaryDirectory(dir=folder, prefix=".cim-int4-rotated-") as tmp, file_errors(tmp):
        path = Path(tmp) / "model.onnx"
        save_model(proto, path, external_data=True, consume=True)
        del proto
        inner = _after_rotation(options, rotation).with_(simplify=False)
        quantized, summary = _pipeline(path, output, inner, quiet)
    if note:
        summary.warnings.insert(0, note)
    summary.rotation = rotation
    return quantized, summary


def _rotate(model: onnx.ModelProto) -> RotationSummary:
    try:
        return rotate_residual(model)
    except NotRotatable as e:
        raise ExportError(str(e)) from None


def _after_rotation(options: ExportOptions, rotation: RotationSummary) -> ExportOptions:
    """The options of the export that follows a rotation: the tied head's fold at ``FOLD_BITS``.

    A ``bits`` pattern that matches the fold gives it that width instead, except the catch-all
    ``.*`` (the user's "every other layer": the fold is ours, and at 3 bits it costs SmolLM2 more
    than its 2-bit LM head); under ``bits="auto"`` the fold is a layer like the others and the
    allocation gives it a width.
    """
    bits, fold = options.bits, rotation.fold_node
    if not fold or bits == AUTO:
        return options.with_(rotate=False)
    if isinstance(bits, tuple):
        if any(p == fold or (p != CATCH_ALL and re.fullmatch(p, fold)) for p, _ in bits):
            return options.with_(rotate=False)
        pairs = bits
    else:
        pairs = ((CATCH_ALL, bits),)
    return options.with_(rotate=False, bits=((re.escape(fold), FOLD_BITS), *pairs))


def _report(summary: ExportSummary, quiet: bool) -> None:
    if not quiet:
        print(summary.format())


def _wrote(output: str | os.PathLike, quiet: bool) -> None:
    if not quiet:
        print(f"cim-int4: wrote {output}")


def export_with_summary(
    model: onnx.ModelProto, options: ExportOptions | None = None, **overrides: Any
) -> tuple[onnx.ModelProto, ExportSummary]:
    """Like export_int4 on a ModelProto, returning the summary too and printing nothing."""
    return _export(model, None, (options or ExportOptions()).with_(**overrides))


def _export(
    model: onnx.ModelProto, tensors: TensorStore | None, options: ExportOptions, owned: bool = False
) -> tuple[onnx.ModelProto, ExportSummary]:
    int4_nodes = _int4_nodes(model)  # before an in-place rewrite (``owned``) adds ours
    note = None
    if options.simplify:
        simplified, note = simplify_model(model)
        owned = owned or simplified is not model  # onnxsim's output is a new proto
        model = simplified
    rotation = None
    if options.rotate:  # a ModelProto (a file was rotated into a copy by _rotated_pipeline)
        if not owned:  # the caller's proto stays as it was
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            model, owned = copy, True
        rotation = _rotate(model)
        options = _after_rotation(options, rotation)
    if options.feeds is None and options.method in CALIBRATED:
        raise ValueError(
            f"method {options.method!r} needs calibration inputs: pass feeds= (an .npz, a dict or an iterable)"
        )
    if options.feeds is None and options.bits == AUTO:
        raise ValueError("bits='auto' needs calibration inputs: pass feeds= (an .npz, a dict or an iterable)")
    teacher = None
    if options.tune_epochs:  # the FP32 model before the rewrite, which may take it apart in place
        if int4_nodes:
            raise ExportError(f"tune_epochs: the model already has {len(int4_nodes)} INT4 node(s) ({int4_nodes[0]}); "
                              "scale tuning needs the FP32 model")  # fmt: skip
        options, teacher = _teacher(model, options)
    if options.feeds is None:
        quantized, summary = rewrite_model(model, options, tensors=tensors)
    else:
        with bounded_heap():
            quantized, summary = export_mixed(model, options, owned=owned or tensors is not None, tensors=tensors)
    if note:
        summary.warnings.insert(0, note)
    if rotation is not None:
        summary.rotation = rotation
    # An embedding alone is not an export (an int4 model's FP32 Gather, say): the MatMuls are what count.
    if not any(r.op_type != "Gather" for r in summary.rewritten):
        mixed = summary.mixed_precision
        if mixed is not None and mixed.layers:
            least = max(mixed.layers, key=lambda x: x.cosine_alone)
            raise ExportError(
                f"target cosine {options.target_cosine} needs every layer in FP32: even {least.name!r} alone in INT4 "
                f"gives {least.cosine_alone:.6f}; lower --target-cosine or check the calibration inputs"
            )
        raise NothingToQuantize(summary, int4_nodes)
    if teacher is not None:
        try:
            summary.tuning = teacher.tune(quantized, options.tune_epochs, options.tune_lr)
        except ValueError as e:  # what the first window's check could not see (another window's shapes)
            raise ExportError(f"tune_epochs: {e}") from None
    quantized.ir_version = min(quantized.ir_version, max_ir_version())
    return quantized, summary


def _teacher(model: onnx.ModelProto, options: ExportOptions) -> tuple[ExportOptions, Teacher]:
    """The scale tuning's teacher (``model`` in ORT) and batches; ``feeds`` read once into a list if they are both."""
    if options.tune_feeds is None:
        options = options.with_(feeds=feed_batches(options.feeds, model))  # an iterator is read once
        batches = options.feeds
    else:
        batches = feed_batches(options.tune_feeds, model)
    try:
        return options, Teacher(model, batches)
    except ValueError as e:
        raise ExportError(f"tune_epochs: {e}") from None


def _int4_nodes(model: onnx.ModelProto) -> list[str]:
    """'op_type name' of every INT4 MatMul node (ours or ORT's MatMulNBits) in the main graph."""
    return [
        f"{n.op_type} {n.name or n.output[0]!r}"
        for n in model.graph.node
        if (n.op_type, n.domain) in ((OP_TYPE, OP_DOMAIN), ("MatMulNBits", "com.microsoft"))
    ]
