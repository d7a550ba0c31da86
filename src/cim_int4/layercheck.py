"""One CimInt4MatMul at a time: its kernel against its dequantized weights, its weights against the FP32 ones.

Both checks are free of the error of other layers (see ``cim_int4.validate`` for how
they are used):

* the kernel: the node runs alone in ORT on the FP32 model's own input to it, and its
  output is held to that input times its dequantized weights, within the rounding that
  the node's compute mode allows (``expected``; a gated node's halves through its gate). A
  kernel that reads nibbles, groups or scales other than the format says is far outside that
  bound.
* the weights: each dequantized weight must be within one quantization step of the FP32
  weight it replaces (``code_steps``: round to nearest gives <= 0.5, clipping at the ends
  of -8..7 counts as 0). A file whose nibbles were swapped or whose scales belong to
  other groups is several steps off.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .contract import (
    COMPUTE_CONFIG,
    DEFAULT_BITS,
    DEFAULT_COMPUTE,
    DEFAULT_GRID,
    DEFAULT_GROUP_SIZE,
    OP_DOMAIN,
    OP_TYPE,
    check_compute,
    is_op_node,
    levels,
    max_level,
    scale_values,
)
from .exporter import gated
from .exporter.fold import DEFAULT_DOMAINS, Scope
from .exporter.operands import Ineligible, plan_gemm, plan_matmul
from .metrics import cosine as cosine_of
from .ops import make_session, reference
from .ops.reference_backend import with_table_attributes

ModelSource = str | os.PathLike | onnx.ModelProto
U32 = 2.0**-24  # unit roundoff of float32
# A layer passes while its largest error is within this multiple of the bound derived in
# expected; the bound is already a worst case, the factor absorbs a kernel's own order
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


class Model:
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

    @functools.cached_property
    def scope(self) -> Scope:
        """The main graph's constants as the exporter resolves them; values are read on demand."""
        return Scope(self.proto.graph, load=self.array)

    def config(self) -> dict[str, str]:
        """Session config entries: where ORT finds the external data of a model given as bytes."""
        return {} if self.dir is None else {EXTERNAL_FOLDER: str(self.dir.resolve())}


def is_int4(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a CimInt4MatMul."""
    return is_op_node(node)


def tensor_error(fp32: np.ndarray, int4: np.ndarray) -> tuple[float, float, float, float]:
    """(rel L2, max |diff|, cosine, SNR dB) of ``int4`` against ``fp32``.

    Equal non-finite values (the -inf of an attention mask) count as no difference and
    stay out of the norms; a non-finite value on one side only is an infinite difference
    (and a cosine of 0: ``cim_int4.metrics``' rule).
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
    rel = float(diff / norm) if norm > 0 else float(diff)
    max_abs = float(np.max(np.abs(d))) if d.size else 0.0
    cosine = cosine_of(fp32, int4)
    snr = math.inf if diff == 0 else (20 * math.log10(norm / diff) if norm > 0 and math.isfinite(diff) else -math.inf)
    return rel, max_abs, cosine, snr


def compute_config(compute: str | None) -> dict[str, str]:
    """Session config entries that set every node's compute mode (none for None: each node's own)."""
    return {} if compute is None else {COMPUTE_CONFIG: compute}


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def expected(
    a: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    g: int,
    bias: np.ndarray | None,
    compute: str,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> tuple[np.ndarray, np.ndarray]:
    """What the node should output for ``a`` (float64) and a worst-case bound of its rounding, elementwise.

    * ``fp32``: ``a @ W`` with W dequantized, exact in float64; any float32 summation order
      and the final scaling stay within ``(K + 2) u sum|a w|`` (Higham, eq. 3.5), plus one
      rounding of the result (bias add).
    * ``int8``: A quantized per row and group exactly as ``reference.quantize_activations``;
      per group the exact integer ``d`` times ``as * s``. Summing G groups in any order and
      rounding ``as * s`` and the result stay within ``(G + 3) u sum|d as s|``. A kernel
      whose ``a * 127 / amax`` lands on the other side of a rounding tie (a last-bit
      difference, ~2**-17 per element) moves one code of one element: ``top as |s|`` of its
      group (top: the grid's largest ``|q|``, 8 at 4 bits), allowed once per row.
    """
    rows = np.asarray(a, dtype=np.float32).reshape(-1, k)
    if compute == "int8":
        qa, ascale, bsum = reference.quantize_activations(rows, k, g)
        q = reference.unpack(packed, bits, grid).astype(np.int64)  # [N, K_padded]
        top = max_level(bits, grid)
        scales64 = np.asarray(scales, dtype=np.float64)
        y = np.zeros((rows.shape[0], scales.shape[0]))
        mag = np.zeros_like(y)
        tie = np.zeros_like(y)
        for j in range(scales.shape[1]):
            sl = slice(j * g, (j + 1) * g)
            d = qa[:, sl].astype(np.int64) @ q[:, sl].T
            step = ascale[:, j : j + 1].astype(np.float64) * scales64[None, :, j]
            y += d * step
            mag += np.abs(d * step)
            tie = np.maximum(tie, top * np.abs(step))
        bound = (scales.shape[1] + 3) * U32 * mag + tie
    else:
        w = reference.dequantize(packed, scales, k, g, bits, grid=grid)
        y = rows.astype(np.float64) @ w
        bound = (k + 2) * U32 * (np.abs(rows.astype(np.float64)) @ np.abs(w))
    if bias is not None:
        y = y + bias.astype(np.float64)
    bound = bound + U32 * np.abs(y)
    return y.reshape(*a.shape[:-1], -1), SAFETY * bound.reshape(*a.shape[:-1], -1)


def code_steps(
    w: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    g: int,
    bits: int = DEFAULT_BITS,
    grid: str = DEFAULT_GRID,
) -> float:
    """Largest distance, in steps of its group's scale, of a code from the FP32 weight ``w`` [K, N] it stands for.

    A step is the gap between the code's level and the next one towards the weight (the scale on the
    uniform grid). Round to nearest gives <= 0.5; a weight beyond the grid's end that maps to its first
    or last level counts 0. Groups with scale 0 must hold zero weights (else: inf).
    """
    lv = levels(bits, grid).astype(np.float64)
    q = reference.unpack(packed, bits, grid)[:, :k].T.astype(np.float64)  # [K, N]
    s = np.repeat(np.asarray(scales, np.float64), g, axis=1)[:, :k].T
    w = np.asarray(w, np.float64)
    zero = s == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(zero, 0.0, w / np.where(zero, 1.0, s))
    at = np.searchsorted(lv, q)
    up = np.where(at + 1 < len(lv), lv[np.minimum(at + 1, len(lv) - 1)] - q, np.inf)  # gap to the next level up
    down = np.where(at > 0, q - lv[np.maximum(at - 1, 0)], np.inf)
    dist = np.abs(t - q) / np.where(t > q, up, down)  # beyond the end: a gap of inf, 0 steps
    dist = np.where(zero, np.where(w == 0, 0.0, np.inf), dist)
    return float(dist.max()) if dist.size else 0.0


def _fp32_operands(fp32: Model, node: onnx.NodeProto | None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Weight [K, N] and bias of the FP32 MatMul/Gemm ``node`` as the exporter folds them, or None if not constant."""
    if node is None or node.op_type not in ("MatMul", "Gemm") or node.domain not in DEFAULT_DOMAINS:
        return None
    # Only this node's operands (through the producers the exporter folds) are read: a big model's other
    # weights stay on disk.
    try:
        if node.op_type == "MatMul":
            plan = plan_matmul(node, fp32.scope, lambda _: None)
        else:
            plan = plan_gemm(node, fp32.scope)
    except Ineligible:
        return None
    return plan.w, plan.bias


def _fp32_gated_operands(fp32: Model, output: str) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Weight [K, 2H] and bias of the FP32 gated MLP whose product is ``output``: gate's columns, then up's."""
    mlp = next((m for m in gated.find(fp32.proto.graph, gated.is_matmul) if m.output == output), None)
    if mlp is None:
        return None
    halves = [_fp32_operands(fp32, fp32.proto.graph.node[i]) for i in (mlp.gate, mlp.up)]
    if any(h is None for h in halves) or halves[0][0].shape != halves[1][0].shape:
        return None
    (wg, bg), (wu, bu) = halves
    return np.concatenate([wg, wu], axis=1), gated.stacked_bias(bg, bu, wg.shape[1])


def check_layer(
    model: Model,
    node: onnx.NodeProto,
    a: np.ndarray,
    threads: int | None = None,
    fp32: Model | None = None,
    fp32_node: onnx.NodeProto | None = None,
    fp32_out: np.ndarray | None = None,
    compute: str | None = None,
) -> LayerCheck:
    """Check ``node`` (a CimInt4MatMul of ``model``): run alone on ``a``, and its weights against ``fp32_node``'s."""
    label = node.name or node.output[0]
    if len(node.input) > 1:  # codes and scales read as inputs (a tied LM head): run it with them as attributes
        tables = {
            t.name: numpy_helper.from_array(model.array(t), t.name)
            for t in model.proto.graph.initializer
            if t.name in node.input[1:]
        }
        node = with_table_attributes(node, tables)
    if compute is None:
        compute_attr = _attr(node, "compute")
        compute = compute_attr.s.decode() if compute_attr is not None else DEFAULT_COMPUTE
    attrs = {}
    arrays: dict[str, np.ndarray] = {}
    for at in node.attribute:
        if at.type == onnx.AttributeProto.TENSOR:
            arrays[at.name] = model.array(at.t)
            attrs[at.name] = numpy_helper.from_array(arrays[at.name], at.name)
        else:
            attrs[at.name] = helper.get_attribute_value(at)
    if "super_scales" in arrays:  # int8 scales: their values, as the op computes with them
        arrays["scales"] = scale_values(arrays["scales"], arrays["super_scales"])
    alone = helper.make_node(OP_TYPE, ["A"], ["Y"], name=label, domain=OP_DOMAIN, **attrs)
    graph = helper.make_graph(
        [alone],
        "alone",
        [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, list(a.shape))],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
    )
    one = helper.make_model(graph, opset_imports=list(model.proto.opset_import), ir_version=model.proto.ir_version)
    try:
        session = make_session(one, threads=threads, config=compute_config(compute))
        (got,) = session.run(None, {"A": np.asarray(a, dtype=np.float32)})
        group = _attr(node, "group_size")
        k, g = int(_attr(node, "K").i), int(group.i) if group else DEFAULT_GROUP_SIZE
        check_compute(compute, "attribute compute")
        bits = int(attrs.get("bits", DEFAULT_BITS))
        grid = attrs.get("grid", DEFAULT_GRID.encode())
        grid = grid.decode() if isinstance(grid, bytes) else grid
        want, bound = expected(a, arrays["packed"], arrays["scales"], k, g, arrays.get("bias"), compute, bits, grid)
        gated = attrs.get("gated")
        if gated is not None:  # a gated MLP: both halves' bounds, carried through the activation
            gated = gated.decode() if isinstance(gated, bytes) else gated
            want, bound = reference.gated(want, gated), reference.gated_bound(want, bound, gated)
    except Exception as e:  # noqa: BLE001 - any failure of the layer alone is this layer's verdict
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return LayerCheck(label, node.output[0], compute, math.inf, math.inf, error=f"fails to run alone: {first}")
    steps = None
    operands = _fp32_operands(fp32, fp32_node) if fp32 is not None else None
    if operands is None and fp32 is not None and attrs.get("gated") is not None:
        operands = _fp32_gated_operands(fp32, node.output[0])
    if operands is not None and operands[0].shape == (k, int(_attr(node, "N").i)):
        w, bias = operands
        steps = code_steps(w, arrays["packed"], arrays["scales"], k, g, bits, grid)
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
