"""Layer-by-layer comparison of an INT4 model with its FP32 original, both run in ONNX Runtime.

Two questions, two checks:

* How far is each tensor from FP32? Both models run on the same feeds with the compared
  tensors added as graph outputs; each row gives rel L2, max |diff|, cosine and SNR.
  Errors there add up through the layers, so they cannot tell a broken layer from the
  quantization noise of the layers before it.
* Is each CimInt4MatMul right? Two checks per layer, both free of the error of other layers:

  - the kernel: the node runs alone in ORT on the FP32 model's own input to it, and its
    output is held to that input times its dequantized weights, within the rounding that
    the node's compute mode allows (``_expected``). A kernel that reads nibbles, groups or
    scales other than the format says is far outside that bound.
  - the weights: each dequantized weight must be within one quantization step of the FP32
    weight it replaces (``code_steps``: round to nearest gives <= 0.5, clipping at the
    ends of -8..7 counts as 0). A file whose nibbles were swapped or whose scales belong
    to other groups is several steps off.

  ``Report.first_divergent`` names the first layer, in graph order, failing either.

Models given as paths are read without their external data: sessions load the weights
from the files themselves (``EXTERNAL_FOLDER``), and weights and attributes are read one
layer at a time.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from .exporter.rewrite import DEFAULT_DOMAINS, _Constants, _Ineligible, _matmul_operands
from .graphs import model_feeds
from .ops import OP_DOMAIN, OP_TYPE, make_session, reference, session_options
from .ops.names import COMPUTE_CONFIG
from .report import plot_by_depth, text_table

ModelSource = str | os.PathLike | onnx.ModelProto
U32 = 2.0**-24  # unit roundoff of float32
# A layer passes while its largest error is within this multiple of the bound derived in
# _expected; the bound is already a worst case, the factor absorbs a kernel's own order
# of operations (e.g. a final bias add) that the derivation does not model.
SAFETY = 2.0
# No rounding rule moves a weight further than one step from the grid point nearest to it.
MAX_CODE_STEPS = 1.0
# ORT >= 1.18 reads the external data of a model given as bytes from this folder.
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


class CompareError(ValueError):
    """The models cannot be compared as given; the message names what differs or what is missing."""


@dataclass(frozen=True)
class LayerCheck:
    """One CimInt4MatMul run alone on the FP32 model's input to it, against its dequantized weights."""

    node: str
    output: str
    compute: str
    rel_l2: float  # ||op - expected|| / ||expected||
    worst: float  # max |op - expected| / bound: <= 1 means explained by the int4 weights and the compute mode
    # Largest distance, in quantization steps, of a dequantized weight from its FP32 weight's
    # grid point (see the module doc); None when the FP32 layer has no constant weight to compare.
    code_steps: float | None = None
    # ||op - fp32 layer|| / ||fp32 layer|| on the same input: this layer's own quantization error.
    own_rel_l2: float | None = None
    error: str | None = None  # the node failed to run

    @property
    def kernel_ok(self) -> bool:
        return self.error is None and math.isfinite(self.worst) and self.worst <= 1.0

    @property
    def weights_ok(self) -> bool:
        return self.code_steps is None or self.code_steps <= MAX_CODE_STEPS

    @property
    def ok(self) -> bool:
        return self.kernel_ok and self.weights_ok


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

    @property
    def layers(self) -> list[LayerCheck]:
        return [r.layer for r in self.rows if r.layer is not None]

    @property
    def first_divergent(self) -> str | None:
        """Name of the first CimInt4MatMul (graph order) whose output its int4 weights do not explain, or None."""
        return next((c.node for c in self.layers if not c.ok), None)

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


# ---------------------------------------------------------------- models


class _Model:
    """A model given as a path or ModelProto; a path's graph is read without its external data."""

    def __init__(self, source: ModelSource, label: str) -> None:
        self.label = label
        if isinstance(source, onnx.ModelProto):
            self.proto, self.dir = source, None
            return
        path = Path(source)
        if not path.is_file():
            raise CompareError(f"{label} model {path}: no such file")
        try:
            self.proto = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # noqa: BLE001 - protobuf raises several types; all mean "not a model"
            raise CompareError(f"{label} model {path}: not a readable ONNX model ({type(e).__name__}: {e})") from e
        if not self.proto.HasField("graph"):
            raise CompareError(f"{label} model {path}: not an ONNX model (no graph)")
        self.path, self.dir = path, path.parent

    def array(self, t: onnx.TensorProto) -> np.ndarray:
        """A tensor's values, read from the external data file when it has one."""
        return numpy_helper.to_array(t, base_dir=str(self.dir or ""))

    def with_outputs(self, names: list[str]) -> bytes:
        """The model with ``names`` added as graph outputs, serialized; its external data stays in its files."""
        graph = self.proto.graph
        present = {o.name for o in graph.output}
        added = [n for n in names if n not in present]
        graph.output.extend(onnx.ValueInfoProto(name=n) for n in added)
        try:
            return self.proto.SerializeToString()
        finally:
            for _ in added:
                graph.output.pop()

    def config(self) -> dict[str, str]:
        """Session config entries: where ORT finds the external data of a model given as bytes."""
        return {} if self.dir is None else {EXTERNAL_FOLDER: str(self.dir.resolve())}


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


def _is_int4(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == OP_DOMAIN


def compared_tensors(int4: onnx.ModelProto, extra: str | None = None, all_tensors: bool = False) -> list[str]:
    """In graph order: outputs of CimInt4MatMul nodes, of nodes matching ``extra`` (or all), and the graph outputs."""
    pattern = re.compile(extra) if extra else None
    outputs = {o.name for o in int4.graph.output}
    # Tensors computed from constants alone (Constant, Identity of a weight, ...) cannot differ.
    constant = {t.name for t in int4.graph.initializer}
    for node in int4.graph.node:
        if not _is_int4(node) and all(i in constant for i in node.input if i):
            constant.update(node.output)
    names = []
    for node in int4.graph.node:
        for i, out in enumerate(node.output):
            if not out:
                continue
            if (
                (_is_int4(node) and i == 0)
                or out in outputs
                or (all_tensors and out not in constant)
                or (pattern is not None and pattern.fullmatch(out))
            ):
                names.append(out)
    names += [o for o in outputs if o not in names]  # outputs that are inputs or initializers
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------- one layer alone


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _expected(
    a: np.ndarray, packed: np.ndarray, scales: np.ndarray, k: int, g: int, bias: np.ndarray | None, compute: str
) -> tuple[np.ndarray, np.ndarray]:
    """What the node should output for ``a`` (float64) and a worst-case bound of its rounding, elementwise.

    * ``fp32``: ``a @ W`` with W dequantized, exact in float64; any float32 summation order
      and the final scaling stay within ``(K + 2) u sum|a w|`` (Higham, eq. 3.5), plus one
      rounding of the result (bias add).
    * ``int8``: A quantized per row and group exactly as ``reference.quantize_activations``;
      per group the exact integer ``d`` times ``as * s``. Summing G groups in any order and
      rounding ``as * s`` and the result stay within ``(G + 3) u sum|d as s|``. A kernel
      whose ``a * 127 / amax`` lands on the other side of a rounding tie (a last-bit
      difference, ~2**-17 per element) moves one code of one element: ``8 as |s|`` of its
      group, allowed once per row.
    """
    rows = np.asarray(a, dtype=np.float32).reshape(-1, k)
    if compute == "int8":
        qa, ascale, bsum = reference.quantize_activations(rows, k, g)
        codes = reference.unpack(packed).astype(np.int64) + 8  # [N, K_padded]
        scales64 = np.asarray(scales, dtype=np.float64)
        y = np.zeros((rows.shape[0], scales.shape[0]))
        mag = np.zeros_like(y)
        tie = np.zeros_like(y)
        for j in range(scales.shape[1]):
            sl = slice(j * g, (j + 1) * g)
            d = qa[:, sl].astype(np.int64) @ codes[:, sl].T - 8 * bsum[:, j : j + 1].astype(np.int64)
            step = ascale[:, j : j + 1].astype(np.float64) * scales64[None, :, j]
            y += d * step
            mag += np.abs(d * step)
            tie = np.maximum(tie, 8 * np.abs(step))
        bound = (scales.shape[1] + 3) * U32 * mag + tie
    else:
        w = reference.dequantize(packed, scales, k, g)
        y = rows.astype(np.float64) @ w
        bound = (k + 2) * U32 * (np.abs(rows.astype(np.float64)) @ np.abs(w))
    if bias is not None:
        y = y + bias.astype(np.float64)
    bound = bound + U32 * np.abs(y)
    return y.reshape(*a.shape[:-1], -1), SAFETY * bound.reshape(*a.shape[:-1], -1)


def code_steps(w: np.ndarray, packed: np.ndarray, scales: np.ndarray, k: int, g: int) -> float:
    """Largest distance, in steps of its group's scale, of a code from the FP32 weight ``w`` [K, N] it stands for.

    Round to nearest gives <= 0.5; a weight beyond the grid's end that maps to code -8 or 7
    counts 0. Groups with scale 0 must hold zero weights (else: inf).
    """
    q = reference.unpack(packed)[:, :k].T.astype(np.float64)  # [K, N]
    s = np.repeat(np.asarray(scales, np.float64), g, axis=1)[:, :k].T
    w = np.asarray(w, np.float64)
    zero = s == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(zero, 0.0, w / np.where(zero, 1.0, s))
    dist = np.abs(t - q)
    dist = np.where(((q == 7) & (t > 7)) | ((q == -8) & (t < -8)), 0.0, dist)
    dist = np.where(zero, np.where((w == 0) & (q == 0), 0.0, np.inf), dist)
    return float(dist.max()) if dist.size else 0.0


def _fp32_operands(fp32: _Model, node: onnx.NodeProto | None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Weight [K, N] and bias of the FP32 MatMul/Gemm ``node`` as the exporter folds them, or None if not constant."""
    if node is None or node.op_type not in ("MatMul", "Gemm") or node.domain not in DEFAULT_DOMAINS:
        return None
    # Only this node's operands, with their data loaded: a big model's other weights stay on disk.
    inits = {t.name: t for t in fp32.proto.graph.initializer}
    consts = {n.output[0]: n for n in fp32.proto.graph.node if n.op_type == "Constant"}
    graph = onnx.GraphProto()
    graph.input.extend(i for i in fp32.proto.graph.input if i.name in node.input)
    for name in node.input[1:]:
        if name in inits:
            graph.initializer.append(numpy_helper.from_array(fp32.array(inits[name]), name))
        elif name in consts:
            graph.node.append(consts[name])
    try:
        return _matmul_operands(node, _Constants(graph))
    except _Ineligible:
        return None


def _check_layer(
    model: _Model,
    node: onnx.NodeProto,
    a: np.ndarray,
    threads: int | None = None,
    fp32: _Model | None = None,
    fp32_node: onnx.NodeProto | None = None,
    fp32_out: np.ndarray | None = None,
    compute: str | None = None,
) -> LayerCheck:
    """Check ``node`` (a CimInt4MatMul of ``model``): run alone on ``a``, and its weights against ``fp32_node``'s."""
    label = node.name or node.output[0]
    if compute is None:
        compute_attr = _attr(node, "compute")
        compute = compute_attr.s.decode() if compute_attr is not None else "fp32"
    attrs = {}
    arrays: dict[str, np.ndarray] = {}
    for at in node.attribute:
        if at.type == onnx.AttributeProto.TENSOR:
            arrays[at.name] = model.array(at.t)
            attrs[at.name] = numpy_helper.from_array(arrays[at.name], at.name)
        else:
            attrs[at.name] = helper.get_attribute_value(at)
    alone = helper.make_node(OP_TYPE, ["A"], ["Y"], name=label, domain=OP_DOMAIN, **attrs)
    graph = helper.make_graph(
        [alone],
        "alone",
        [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, list(a.shape))],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
    )
    one = helper.make_model(graph, opset_imports=list(model.proto.opset_import), ir_version=model.proto.ir_version)
    try:
        session = make_session(one, threads=threads, config=_compute_config(compute))
        (got,) = session.run(None, {"A": np.asarray(a, dtype=np.float32)})
        k, g = int(_attr(node, "K").i), int(_attr(node, "group_size").i) if _attr(node, "group_size") else 32
        if compute not in reference.COMPUTE_MODES:
            raise ValueError(f"attribute compute={compute!r} is not one of {reference.COMPUTE_MODES}")
        want, bound = _expected(a, arrays["packed"], arrays["scales"], k, g, arrays.get("bias"), compute)
    except Exception as e:  # noqa: BLE001 - any failure of the layer alone is this layer's verdict
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return LayerCheck(label, node.output[0], compute, math.inf, math.inf, error=f"fails to run alone: {first}")
    steps = None
    operands = _fp32_operands(fp32, fp32_node) if fp32 is not None else None
    if operands is not None and operands[0].shape == (k, int(_attr(node, "N").i)):
        w, bias = operands
        steps = code_steps(w, arrays["packed"], arrays["scales"], k, g)
        if (bias is None) != ("bias" not in arrays) or (
            bias is not None and not np.allclose(bias, arrays["bias"], rtol=1e-6, atol=0)
        ):
            steps = math.inf  # the bias is the FP32 one, copied exactly
    diff = np.abs(got.astype(np.float64) - want)
    worst = float(np.max(diff / np.maximum(bound, np.finfo(np.float64).tiny))) if diff.size else 0.0
    if not np.all(np.isfinite(got)):
        worst = math.inf
    norm = float(np.linalg.norm(want))
    rel = float(np.linalg.norm(diff) / norm) if norm > 0 else float(np.linalg.norm(diff))
    own = None
    if fp32_out is not None and np.shape(fp32_out) == got.shape:
        own = tensor_error(fp32_out, got)[0]
    return LayerCheck(label, node.output[0], compute, rel, worst, steps, own)


# ---------------------------------------------------------------- the comparison


def tensor_error(fp32: np.ndarray, int4: np.ndarray) -> tuple[float, float, float, float]:
    """(rel L2, max |diff|, cosine, SNR dB) of ``int4`` against ``fp32``.

    Equal non-finite values (the -inf of an attention mask) count as no difference and
    stay out of the norms; a non-finite value on one side only is an infinite difference.
    """
    r, g = np.asarray(fp32, np.float64).ravel(), np.asarray(int4, np.float64).ravel()
    if r.shape != g.shape:
        raise CompareError(f"shapes differ: FP32 {np.shape(fp32)}, INT4 {np.shape(int4)}")
    finite = np.isfinite(r) & np.isfinite(g)
    equal = (r == g) | (np.isnan(r) & np.isnan(g))
    with np.errstate(invalid="ignore"):  # inf - inf where not finite: replaced below
        d = np.where(finite, g - r, np.where(equal, 0.0, np.inf))
    r, g = np.where(finite, r, 0.0), np.where(finite, g, 0.0)
    norm, diff = np.linalg.norm(r), np.linalg.norm(d)
    denom = norm * np.linalg.norm(g)
    rel = float(diff / norm) if norm > 0 else float(diff)
    max_abs = float(np.max(np.abs(d))) if d.size else 0.0
    cosine = float(r @ g / denom) if denom > 0 else (1.0 if diff == 0 else 0.0)
    snr = math.inf if diff == 0 else (20 * math.log10(norm / diff) if norm > 0 and math.isfinite(diff) else -math.inf)
    return rel, max_abs, cosine, snr


def _compute_config(compute: str | None) -> dict[str, str]:
    return {} if compute is None else {COMPUTE_CONFIG: compute}


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
) -> Report:
    """Compare ``int4_model`` with ``fp32_model`` (paths or ModelProtos) tensor by tensor, and check each layer alone.

    ``feeds``: a dict or an ``.npz`` path; inputs it lacks are generated (see
    ``cim_int4.graphs.feeds``: ``dims`` for symbolic dims, ``int_range`` for integer
    inputs). ``extra`` (a regex on tensor names) or ``all_tensors`` add rows beyond the
    quantized layers' outputs and the graph outputs. ``compute`` ("fp32" | "int8") runs the
    INT4 model with that mode for every node (session config ``cim_int4.compute``) and holds
    the layers to it; by default each node's own ``compute`` attribute decides. Raises CompareError (a ValueError)
    naming what differs when the models do not match.
    """
    from .graphs import load_feeds

    if compute is not None and compute not in reference.COMPUTE_MODES:
        raise CompareError(f"compute must be one of {', '.join(reference.COMPUTE_MODES)}, got {compute!r}")
    fp32, int4 = _Model(fp32_model, "FP32"), _Model(int4_model, "INT4")
    _check_same_interface(fp32.proto, int4.proto)
    given = load_feeds(feeds) if isinstance(feeds, str | os.PathLike) else feeds
    feeds = model_feeds(fp32.proto, given, dims, seed=seed, int_range=int_range)

    names = compared_tensors(int4.proto, extra, all_tensors)
    produced = {o for n in fp32.proto.graph.node for o in n.output} | {i.name for i in fp32.proto.graph.input}
    missing = [n for n in names if n not in produced]
    if missing:
        raise CompareError(f"tensors {missing[:5]} of the INT4 model do not exist in the FP32 model")
    layers = [n for n in int4.proto.graph.node if _is_int4(n)]
    layer_inputs = [n.input[0] for n in layers if n.input[0] not in feeds]
    missing = [n for n in layer_inputs if n not in produced]
    if missing:
        raise CompareError(f"inputs {missing[:5]} of CimInt4MatMul nodes do not exist in the FP32 model")
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
    checks = {
        n.output[0]: _check_layer(
            int4,
            n,
            ref.get(n.input[0], feeds.get(n.input[0])),
            threads,
            fp32,
            producers.get(n.output[0]),
            ref.get(n.output[0]),
            compute,
        )
        for n in layers
    }

    try:
        sess = make_session(int4.with_outputs(names), threads=threads, config=int4.config() | _compute_config(compute))
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
    return Report(rows, {k: (tuple(v.shape), str(v.dtype)) for k, v in feeds.items()})
