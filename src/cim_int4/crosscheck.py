"""Cross-check of the op library against the NumPy reference: one INT4 model, the same feeds, two backends.

Comparing an INT4 model with its FP32 original mixes quantization noise with kernel bugs.
Here only the op's implementation differs (``make_session(backend="native")`` against
``backend="reference"``), so every CimInt4MatMul output must agree to FP32 rounding.

The allowed difference at each output element of a layer, with ``|W|`` the dequantized
weight's absolute values, ``a`` the layer's input on each backend and ``mag = |a| @ |W|``:

* ``|a_native - a_reference| @ |W|``: what the inputs' own difference (from earlier layers)
  can carry through, exactly; so a layer is only blamed for what it adds;
* ``2**-22 * (mag_native + mag_reference)`` plus one rounding of the bias addition: four
  FP32 ulps of the sum's magnitude per side. Both sides compute the same arithmetic
  (``reference.emulate``) up to rare double rounding in NumPy's emulated FMA;
* int8 mode only, for each row and group whose input differs between the two backends
  (and so may quantize differently): the documented int8 error of each side,
  ``sum over k of as_g / 2 * |W[k]|``, with ``as_g = max|a_g| / 127``.

A gated node (attribute ``gated``) gets that bound on both halves of its product, carried through
its activation by ``reference.gated_bound``.

A difference beyond that is a kernel bug in that layer, not quantization noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from .contract import COMPUTE_CONFIG, Int4Node, is_op_node
from .layercheck import Model
from .ops import OP_TYPE, make_session, reference
from .ops.reference_backend import with_table_attributes

# Four FP32 ulps of a dot product's magnitude sum|a * w| (unit roundoff 2**-24).
ULPS_OF_MAGNITUDE = 2.0**-22
U32 = 2.0**-24


@dataclass(frozen=True)
class LayerAgreement:
    """How far the native op's output of one CimInt4MatMul node is from the reference op's."""

    node: str
    output: str
    compute: str
    max_abs: float  # max |native - reference|
    allowed: float  # the allowed difference at the element where diff / allowed is largest
    worst: float  # max diff / allowed; above 1 is a kernel bug

    @property
    def ok(self) -> bool:
        """Whether the two backends agree within the allowed difference everywhere."""
        return self.worst <= 1.0

    def format(self) -> str:
        verdict = "ok" if self.ok else "KERNEL BUG: native and reference differ beyond FP32 rounding"
        return (
            f"{self.node:<32} {self.compute:<4}  max |native - reference| {self.max_abs:9.3e}"
            f"   worst |diff| / allowed {self.worst:9.3e} (allowed there {self.allowed:9.3e})   {verdict}"
        )


def allowed_difference(
    w: Int4Node, compute: str, a_native: np.ndarray, a_reference: np.ndarray, y: np.ndarray
) -> np.ndarray:
    """Elementwise bound [M, N] on |native - reference| of one layer (see the module doc); ``y`` is either output."""
    k, g = w.k, w.group_size
    absw = np.abs(reference.dequantize(w.packed, w.scales, k, g, w.bits, grid=w.grid))  # [K, N]
    a_n = np.asarray(a_native, np.float64).reshape(-1, k)
    a_r = np.asarray(a_reference, np.float64).reshape(-1, k)
    delta = np.abs(a_n - a_r)
    allowed = delta @ absw
    allowed += ULPS_OF_MAGNITUDE * ((np.abs(a_n) + np.abs(a_r)) @ absw)
    if w.bias is not None:
        allowed += 2 * U32 * np.abs(np.asarray(y, np.float64).reshape(-1, w.n))
    if compute == "int8":
        groups = -(-k // g)
        padded = np.zeros((groups * g, w.n))
        padded[:k] = absw
        group_absw = padded.reshape(groups, g, w.n).sum(axis=1)  # [groups, N]
        differs = np.zeros((delta.shape[0], groups * g), dtype=bool)
        differs[:, :k] = delta > 0
        differs = differs.reshape(delta.shape[0], groups, g).any(axis=2)
        for a in (a_n, a_r):
            _, ascale, _ = reference.quantize_activations(a.astype(np.float32), k, g)
            half_step = np.where(differs, ascale.astype(np.float64) / 2, 0.0)
            allowed += half_step @ group_absw * (1 + 2 * ULPS_OF_MAGNITUDE)
    return allowed


def _difference(native: np.ndarray, ref: np.ndarray) -> np.ndarray:
    n, r = np.asarray(native, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(n - r)
    same = (n == r) | (np.isnan(n) & np.isnan(r))  # equal infinities give NaN above
    return np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))


def crosscheck(
    int4_model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    threads: int | None = None,
    compute: str | None = None,
) -> list[LayerAgreement]:
    """Run ``int4_model`` on the native and the reference backend; how far apart each CimInt4MatMul output is.

    ``compute`` ("fp32" | "int8") overrides every node's mode on both backends.
    """
    initializers = {t.name: t for t in int4_model.graph.initializer}
    layers = [
        (node, Int4Node.from_node(with_table_attributes(node, initializers)))
        for node in int4_model.graph.node
        if is_op_node(node)
    ]
    if not layers:
        raise ValueError(f"the model has no {OP_TYPE} node to cross-check")
    inputs = {node.input[0] for node, _ in layers}
    known = {t.name: numpy_helper.to_array(t) for t in int4_model.graph.initializer if t.name in inputs}
    known.update(feeds)
    names = [name for node, _ in layers for name in (node.input[0], node.output[0]) if name not in known]
    names = list(dict.fromkeys(names))
    model = Model(int4_model, "INT4").with_outputs(names)
    config = {COMPUTE_CONFIG: compute} if compute else None
    runs = {}
    for backend in ("native", "reference"):
        values = make_session(model, threads=threads, config=config, backend=backend).run(names, dict(feeds))
        runs[backend] = {**known, **dict(zip(names, values, strict=True))}
    report = []
    for node, w in layers:
        mode = compute or w.compute
        a, y = node.input[0], node.output[0]
        nat, ref = runs["native"][y].reshape(-1, w.outputs_n), runs["reference"][y].reshape(-1, w.outputs_n)
        if w.gated:
            # The bound of the full product (both halves, from the reference's own input), carried through the gate.
            a_ref = runs["reference"][a]
            full = reference.emulate(a_ref, w.packed, w.scales, w.k, w.group_size, w.bias, mode, w.bits, w.grid)
            full = full.reshape(-1, w.n)
            allowed = reference.gated_bound(full, allowed_difference(w, mode, runs["native"][a], a_ref, full), w.gated)
        else:
            allowed = allowed_difference(w, mode, runs["native"][a], runs["reference"][a], ref)
        diff = _difference(nat, ref)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff > 0, diff / allowed, 0.0)
        at = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else None
        report.append(
            LayerAgreement(
                node=node.name,
                output=y,
                compute=mode,
                max_abs=float(diff.max()) if diff.size else 0.0,
                allowed=float(allowed[at]) if at is not None else 0.0,
                worst=float(ratio[at]) if at is not None else 0.0,
            )
        )
    return report
