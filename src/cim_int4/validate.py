"""Layer-by-layer comparison of an INT4 model with its FP32 original, both run in ONNX Runtime.

Two questions, two checks:

* How far is each tensor from FP32? Both models run on the same feeds with the compared
  tensors added as graph outputs; each row gives rel L2, max |diff|, cosine and SNR.
  Errors there add up through the layers, so they cannot tell a broken layer from the
  quantization noise of the layers before it.
* Is each CimInt4MatMul right? Each is checked alone (``cim_int4.layercheck``): its kernel
  against its dequantized weights on the FP32 model's own input to it, and its weights
  against the FP32 weights they replace. Both are free of the error of other layers.
  ``Report.first_divergent`` names the first layer, in graph order, failing either.

Models given as paths are read without their external data: sessions load the weights
from the files themselves (``layercheck.EXTERNAL_FOLDER``), and weights and attributes
are read one layer at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

from .contract import check_compute
from .crosscheck import LayerAgreement
from .graphs import model_feeds
from .layercheck import (
    MAX_CODE_STEPS,
    CompareError,
    LayerCheck,
    Model,
    ModelSource,
    check_layer,
    compute_config,
    is_int4,
    tensor_error,
)
from .ops import make_session, session_options
from .report import plot_by_depth, text_table


@dataclass(frozen=True)
class TensorRow:
    """How far one tensor of the INT4 model is from the same tensor of the FP32 model."""

    name: str
    shape: tuple[int, ...]
    rel_l2: float  # ||int4 - fp32|| / ||fp32||
    max_abs: float
    cosine: float
    snr_db: float  # 10 log10(sum fp32^2 / sum (int4 - fp32)^2); inf when equal
    layer: LayerCheck | None = None  # set on outputs of CimInt4MatMul nodes


@dataclass
class Report:
    """The rows in graph order, and the verdict of the isolated layer checks."""

    rows: list[TensorRow]
    feeds: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # name -> (shape, dtype)
    # compare(..., backend_check=True): the same INT4 model on the native and the reference op, per layer.
    backends: list[LayerAgreement] | None = None

    @property
    def layers(self) -> list[LayerCheck]:
        return [r.layer for r in self.rows if r.layer is not None]

    @property
    def first_divergent(self) -> str | None:
        """Name of the first CimInt4MatMul (graph order) whose output its int4 weights do not explain, or None.

        With the backend check, also the first layer whose native output differs from the
        reference op's beyond FP32 rounding (a kernel bug).
        """
        layer = next((c.node for c in self.layers if not c.ok), None)
        if layer is None and self.backends:
            layer = next((b.node for b in self.backends if not b.ok), None)
        return layer

    def format_backends(self) -> str:
        """The backend check, one line per layer ('' without it)."""
        if self.backends is None:
            return ""
        lines = ["native op vs reference op (same INT4 model, same inputs):"]
        return "\n".join(lines + [b.format() for b in self.backends])

    def format_table(self) -> str:
        """The rows as a text table; 'alone' and 'steps' are a layer's two checks (failures marked '!').

        alone: the layer's error run alone over its rounding bound (> 1 fails); steps: the
        largest distance of a weight from its FP32 value's grid point (> 1 fails).
        """
        header = ("#", "tensor", "shape", "rel L2", "max |diff|", "cosine", "SNR dB", "alone", "steps")
        lines = []
        for i, r in enumerate(self.rows):
            alone = steps = ""
            if r.layer is not None:
                c = r.layer
                alone = "failed" if c.error else f"{c.worst:.2g}" + ("" if c.kernel_ok else " !")
                steps = "-" if c.code_steps is None else f"{c.code_steps:.2f}" + ("" if c.weights_ok else " !")
            lines.append(
                (
                    str(i),
                    r.name,
                    "x".join(map(str, r.shape)) or "scalar",
                    f"{r.rel_l2:.3e}",
                    f"{r.max_abs:.3e}",
                    f"{r.cosine:.6f}",
                    f"{r.snr_db:.1f}",
                    alone,
                    steps,
                )
            )
        return text_table(header, lines, left={1, 2})

    def summary(self) -> str:
        """One line: the first divergent layer and why, or that every layer is explained by its weights."""
        bad = next((c for c in self.layers if not c.ok), None)
        if bad is None and self.backends and not all(b.ok for b in self.backends):
            b = next(b for b in self.backends if not b.ok)
            return (
                f"first divergent layer: {b.node} (output {b.output}): the native op differs from the reference op "
                f"by {b.worst:.3g}x what FP32 rounding allows: a kernel bug, not quantization noise"
            )
        if bad is None:
            return (
                f"every CimInt4MatMul ({len(self.layers)}) computes its dequantized weights (alone <= 1) and its "
                "weights round the FP32 ones (steps <= 1): the differences above are quantization noise"
            )
        if bad.error:
            why = bad.error
        elif not bad.kernel_ok:
            why = (
                f"run alone on the FP32 model's input it is {bad.worst:.3g}x outside the bound its int4 weights and "
                f"compute mode {bad.compute!r} allow (rel L2 {bad.rel_l2:.3g} from the dequantized product)"
            )
        else:
            why = (
                f"a dequantized weight is {bad.code_steps:.3g} quantization steps from the FP32 weight it replaces "
                f"(rounding allows {MAX_CODE_STEPS:g}): the packed codes or scales do not belong to this weight"
            )
        return f"first divergent layer: {bad.node} (output {bad.output}): {why}"

    def to_json(self) -> dict:
        """A JSON-ready dict: feeds, rows (each with its layer check) and first_divergent."""
        return {
            "feeds": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.feeds.items()},
            "rows": [asdict(r) | {"shape": list(r.shape)} for r in self.rows],
            "first_divergent": self.first_divergent,
            "backends": None if self.backends is None else [asdict(b) | {"ok": b.ok} for b in self.backends],
        }

    def write_plot(self, path: str | os.PathLike) -> None:
        """Error by layer depth: rel L2 of each quantized layer's output end to end and alone (MissingPlotting)."""
        rows = [r for r in self.rows if r.layer is not None]
        plot_by_depth(
            path,
            [r.layer.node for r in rows],
            {
                "end to end (vs FP32 model)": [r.rel_l2 for r in rows],
                "alone vs FP32 layer (its own int4 error)": [
                    np.nan if r.layer.own_rel_l2 is None else r.layer.own_rel_l2 for r in rows
                ],
                "alone vs dequantized weights (kernel)": [max(r.layer.rel_l2, 1e-12) for r in rows],
            },
            ylabel="relative L2 error",
            title="cim-int4 validate: error by layer depth",
            marked=[i for i, r in enumerate(rows) if not r.layer.ok],
        )


def _signature(model: onnx.ModelProto) -> tuple[dict[str, int], list[str]]:
    inits = {t.name for t in model.graph.initializer}
    inputs = {v.name: v.type.tensor_type.elem_type for v in model.graph.input if v.name not in inits}
    return inputs, [o.name for o in model.graph.output]


def _check_same_interface(fp32: onnx.ModelProto, int4: onnx.ModelProto) -> None:
    (fin, fout), (qin, qout) = _signature(fp32), _signature(int4)
    diffs = [f"input {n!r} only in the FP32 model" for n in fin if n not in qin]
    diffs += [f"input {n!r} only in the INT4 model" for n in qin if n not in fin]
    diffs += [
        f"input {n!r} is {onnx.TensorProto.DataType.Name(fin[n])} in FP32, "
        f"{onnx.TensorProto.DataType.Name(qin[n])} in INT4"
        for n in fin
        if n in qin and fin[n] != qin[n]
    ]
    diffs += [f"output {n!r} only in the FP32 model" for n in fout if n not in qout]
    diffs += [f"output {n!r} only in the INT4 model" for n in qout if n not in fout]
    if diffs:
        raise CompareError("the models do not match: " + "; ".join(diffs))


def compared_tensors(int4: onnx.ModelProto, extra: str | None = None, all_tensors: bool = False) -> list[str]:
    """In graph order: outputs of CimInt4MatMul nodes, of nodes matching ``extra`` (or all), and the graph outputs."""
    pattern = re.compile(extra) if extra else None
    outputs = {o.name for o in int4.graph.output}
    # Tensors computed from constants alone (Constant, Identity of a weight, ...) cannot differ.
    constant = {t.name for t in int4.graph.initializer}
    for node in int4.graph.node:
        if not is_int4(node) and all(i in constant for i in node.input if i):
            constant.update(node.output)
    names = []
    consumers = _consumers(int4.graph)
    for node in int4.graph.node:
        for i, out in enumerate(node.output):
            if not out:
                continue
            if is_int4(node) and i == 0:
                names.append(original_output(node, consumers))
            elif (
                out in outputs
                or (all_tensors and out not in constant)
                or (pattern is not None and pattern.fullmatch(out))
            ):
                names.append(out)
    names += [o for o in outputs if o not in names]  # outputs that are inputs or initializers
    return list(dict.fromkeys(names))


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def original_output(node: onnx.NodeProto, consumers: Mapping[str, list[onnx.NodeProto]]) -> str:
    """The tensor a CimInt4MatMul's output becomes after the exporter's steps (Cast back, Unsqueeze, bias Add).

    The exporter names those steps "<node name>/..." and the last one writes the output of
    the MatMul/Gemm it replaced, which the FP32 model has too.
    """
    out = node.output[0]
    while len(consumers.get(out, [])) == 1 and consumers[out][0].name.startswith(f"{node.name}/"):
        out = consumers[out][0].output[0]
    return out


def _input_steps(
    producers: Mapping[str, onnx.NodeProto], name: str, known: set[str]
) -> tuple[str, list[onnx.NodeProto]] | None:
    """The FP32 model's tensor behind a layer input, and the exporter's Casts/Transposes in between."""
    steps = []
    while name not in known:
        node = producers.get(name)
        if node is None or node.op_type not in ("Cast", "Transpose"):
            return None
        steps.append(node)
        name = node.input[0]
    return name, steps[::-1]


def _apply_steps(x: np.ndarray, steps: list[onnx.NodeProto]) -> np.ndarray:
    for node in steps:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        # The exporter casts a layer input only to float32, the op's input type.
        x = np.asarray(x, np.float32) if node.op_type == "Cast" else np.transpose(x, perm)
    return x


# ---------------------------------------------------------------- the comparison


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def compare(
    fp32_model: ModelSource,
    int4_model: ModelSource,
    feeds: Mapping[str, np.ndarray] | str | os.PathLike | None = None,
    *,
    dims: Mapping[str, int] | None = None,
    int_range: tuple[int, int] | None = None,
    seed: int = 0,
    threads: int | None = None,
    extra: str | None = None,
    all_tensors: bool = False,
    compute: str | None = None,
    backend_check: bool = False,
) -> Report:
    """Compare ``int4_model`` with ``fp32_model`` (paths or ModelProtos) tensor by tensor, and check each layer alone.

    ``feeds``: a dict or an ``.npz`` path; inputs it lacks are generated (see
    ``cim_int4.graphs.feeds``: ``dims`` for symbolic dims, ``int_range`` for integer
    inputs). ``extra`` (a regex on tensor names) or ``all_tensors`` add rows beyond the
    quantized layers' outputs and the graph outputs. ``compute`` ("fp32" | "int8") runs the
    INT4 model with that mode for every node (session config ``cim_int4.compute``) and holds
    the layers to it; by default each node's own ``compute`` attribute decides. ``backend_check``
    also runs the INT4 model on the reference backend (onnxruntime-extensions) and holds every
    layer's native output to it within FP32 rounding (``Report.backends``). Raises CompareError
    (a ValueError) naming what differs when the models do not match.
    """
    from .graphs import load_feeds

    if compute is not None:
        try:
            check_compute(compute)
        except ValueError as e:
            raise CompareError(str(e)) from None
    fp32, int4 = Model(fp32_model, "FP32"), Model(int4_model, "INT4")
    _check_same_interface(fp32.proto, int4.proto)
    given = load_feeds(feeds) if isinstance(feeds, str | os.PathLike) else feeds
    feeds = model_feeds(fp32.proto, given, dims, seed=seed, int_range=int_range)

    names = compared_tensors(int4.proto, extra, all_tensors)
    produced = {o for n in fp32.proto.graph.node for o in n.output} | {i.name for i in fp32.proto.graph.input}
    if all_tensors:  # the exporter's own intermediates (an fp16 model's Casts, ...) have no FP32 twin
        names = [n for n in names if n in produced]
    missing = [n for n in names if n not in produced]
    if missing:
        raise CompareError(f"tensors {missing[:5]} of the INT4 model do not exist in the FP32 model")
    layers = [n for n in int4.proto.graph.node if is_int4(n)]
    int4_producers = {o: n for n in int4.proto.graph.node for o in n.output}
    steps = {n.output[0]: _input_steps(int4_producers, n.input[0], produced | set(feeds)) for n in layers}
    missing = [n.input[0] for n in layers if steps[n.output[0]] is None]
    if missing:
        raise CompareError(f"inputs {missing[:5]} of CimInt4MatMul nodes do not exist in the FP32 model")
    layer_inputs = [s[0] for s in steps.values() if s is not None and s[0] not in feeds]
    wanted = list(dict.fromkeys(names + layer_inputs))

    try:
        so = session_options(threads, config=fp32.config())
        sess = ort.InferenceSession(fp32.with_outputs(wanted), so, providers=["CPUExecutionProvider"])
        ref = dict(zip(wanted, sess.run(wanted, feeds), strict=True))
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise CompareError(f"the FP32 model does not run in ONNX Runtime: {_first_line(e)}") from e
    del sess
    ref.update({k: v for k, v in feeds.items() if k in wanted})

    producers = {o: n for n in fp32.proto.graph.node for o in n.output}
    consumers = _consumers(int4.proto.graph)
    checks = {}
    for n in layers:
        source, before = steps[n.output[0]]
        out = original_output(n, consumers)
        checks[out] = check_layer(
            int4,
            n,
            _apply_steps(ref[source] if source in ref else feeds[source], before),
            threads,
            fp32,
            producers.get(out),
            ref.get(out) if out == n.output[0] else None,  # after a Cast or Add it is another tensor
            compute,
        )

    try:
        sess = make_session(int4.with_outputs(names), threads=threads, config=int4.config() | compute_config(compute))
        got = dict(zip(names, sess.run(names, feeds), strict=True))
    except Exception as e:  # noqa: BLE001
        bad = next((c for c in checks.values() if not c.ok), None)
        hint = f"; first layer failing alone: {bad.node}" if bad else ""
        raise CompareError(f"the INT4 model does not run in ONNX Runtime: {_first_line(e)}{hint}") from e

    rows = []
    for name in names:
        try:
            rel, max_abs, cosine, snr = tensor_error(ref[name], got[name])
        except CompareError as e:
            raise CompareError(f"tensor {name!r}: {e}") from e
        rows.append(TensorRow(name, tuple(np.shape(ref[name])), rel, max_abs, cosine, snr, checks.get(name)))
    report = Report(rows, {k: (tuple(v.shape), str(v.dtype)) for k, v in feeds.items()})
    if backend_check:
        from .crosscheck import crosscheck

        # The reference op takes the weights as inputs: read them in, external data included.
        full = int4_model if isinstance(int4_model, onnx.ModelProto) else onnx.load(os.fspath(int4_model))
        report.backends = crosscheck(full, feeds, threads=threads, compute=compute)
    return report
