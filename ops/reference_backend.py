"""The reference backend: CimInt4MatMul served by the NumPy reference inside ONNX Runtime, no op library needed.

onnxruntime-extensions runs Python functions as ORT custom ops (domain ``ai.onnx.contrib``),
with three limits that shape this module:

* A Python op cannot read a *tensor* attribute (declaring one aborts the process), so the
  session runs a rewritten copy of the model: each ``CimInt4MatMul`` becomes a
  ``CimInt4MatMulReference`` node whose ``packed``, ``scales`` and ``bias`` are constant
  initializer inputs (float16 scales widened to float32, which is what the op computes
  with), and whose ``K``, ``N``, ``group_size``, ``bits``, ``compute`` and ``node`` (the
  original node's name) are int/string attributes. Every other node, and every tensor name,
  stays as it was.
* An exception raised by a Python op aborts the process. So every attribute is checked when
  the session is made (one-line ``ValueError`` naming node and attribute, the same checks as
  the op library), and a wrong input shape is caught by ORT itself: a ``MatMul`` of ``A``
  with an empty ``[K, 0]`` constant runs first and fails like any ORT node. A gated node's
  ``gated`` is a string attribute too ("" for none).
* Ops are registered per process, by name: ``CimInt4MatMulReference`` is registered once and
  cannot clash with the library's ``CimInt4MatMul`` (domain ``dbhoo.cim``).

A ``CimInt4Gather`` (int4 embedding) becomes an ONNX ``Gather`` on its table dequantized by
``reference.gather`` (the same float32 products), and a ``CimInt4MatMul`` that reads its codes
and scales as initializer inputs (a tied LM head) is read as if they were its attributes.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from ..contract import (
    ATTR_GRID,
    COMPUTE_CONFIG,
    DEFAULT_BITS,
    DEFAULT_GRID,
    GATHER_OP_TYPE,
    OP_DOMAIN,
    OP_TYPE,
    SUPPORTED_BITS,
    Int4Node,
    check_compute,
    check_grid,
    is_op_node,
    row_bytes,
    scale_values,
    supers_of,
)
from . import reference
from .ort_model import proto_session

REFERENCE_DOMAIN = "ai.onnx.contrib"  # the only domain onnxruntime-extensions serves Python ops from
REFERENCE_OP = "CimInt4MatMulReference"
EXTRA = "cim-int4[reference]"

if TYPE_CHECKING:
    from .session import ModelSource


class ReferenceBackendUnavailable(ImportError):
    """onnxruntime-extensions is not installed; the message says which extra to install."""


def run_node(
    a: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    bias: np.ndarray,
    *,
    K: int,  # noqa: N803 - the op's attribute names
    N: int,  # noqa: N803
    group_size: int,
    compute: str,
    node: str,
    bits: int = DEFAULT_BITS,
    gated: str = "",
    grid: str = DEFAULT_GRID,
) -> np.ndarray:
    """What one reference node computes: ``reference.emulate`` (an empty ``bias`` means none), then its gate if any."""
    y = reference.emulate(a, packed, scales, K, group_size, bias if bias.size else None, compute, bits, grid)
    return reference.gated(y, gated).astype(np.float32) if gated else y


def _op_body(
    a: np.ndarray, shape_check: np.ndarray, packed: np.ndarray, scales: np.ndarray, bias: np.ndarray, **attrs: object
) -> np.ndarray:
    # onnxruntime-extensions aborts the whole process when a Python op raises. Attributes and
    # shapes are checked before this runs, so only e.g. MemoryError gets here: say so, and
    # return NaN so that nothing downstream looks like a result.
    try:
        return run_node(a, packed, scales, bias, **attrs)
    except Exception as e:  # noqa: BLE001
        print(f"cim-int4: {REFERENCE_OP} node '{attrs.get('node')}' failed: {e}", file=sys.stderr)
        n = int(attrs["N"]) // (2 if attrs.get("gated") else 1)
        return np.full((*a.shape[:-1], n), np.nan, dtype=np.float32)


@functools.cache
def _register_op() -> None:
    # onnx_op registers for the whole process; registering twice would add a second definition.
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    f32, u8 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_uint8
    attrs = {
        "K": PyCustomOpDef.dt_int64,
        "N": PyCustomOpDef.dt_int64,
        "group_size": PyCustomOpDef.dt_int64,
        "bits": PyCustomOpDef.dt_int64,
        "compute": PyCustomOpDef.dt_string,
        "node": PyCustomOpDef.dt_string,
        "gated": PyCustomOpDef.dt_string,
        "grid": PyCustomOpDef.dt_string,
    }
    onnx_op(op_type=REFERENCE_OP, inputs=[f32, f32, u8, f32, f32], outputs=[f32], attrs=attrs)(_op_body)


def extensions_library() -> str:
    """Path of the onnxruntime-extensions library, with the reference op registered; explains the extra if missing."""
    try:
        import onnxruntime_extensions
    except ImportError:
        raise ReferenceBackendUnavailable(
            f"backend='reference' needs onnxruntime-extensions: pip install {EXTRA}"
        ) from None
    _register_op()
    return onnxruntime_extensions.get_library_path()


def compute_override(so: ort.SessionOptions) -> str | None:
    """The session's ``cim_int4.compute`` config entry, or None; ValueError if it is not a compute mode."""
    try:
        value = so.get_session_config_entry(COMPUTE_CONFIG)
    except RuntimeError:  # ORT's way of saying the entry is not set
        return None
    return check_compute(value, f"session config '{COMPUTE_CONFIG}'")


def load_source(model: ModelSource) -> onnx.ModelProto:
    """``model`` as a ModelProto with its external data loaded; ValueError names an unreadable path."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        try:
            return onnx.load_model_from_string(model)
        except DecodeError as e:
            raise ValueError(f"the model bytes are not a readable ONNX model ({e})") from None
    try:
        return onnx.load_model(os.fspath(model))
    except (OSError, DecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        raise ValueError(f"{os.fspath(model)}: cannot read an ONNX model ({why})") from None


def _initializer(initializers: dict[str, onnx.TensorProto], node: onnx.NodeProto, slot: int, role: str) -> np.ndarray:
    name = node.input[slot] if len(node.input) > slot else ""
    if name not in initializers:
        raise ValueError(
            f"{node.op_type} node '{node.name}': input {slot} '{role}' ({name!r}) must be a constant initializer "
            "of the main graph"
        )
    return numpy_helper.to_array(initializers[name])


def _int(node: onnx.NodeProto, name: str, default: int | None = None) -> int:
    value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)
    if not isinstance(value, int):
        raise ValueError(f"{node.op_type} node '{node.name}': attribute '{name}' is missing or not an int")
    return value


def with_table_attributes(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> onnx.NodeProto:
    """A CimInt4MatMul that reads codes and scales as inputs, as the equivalent one-input node with attributes."""
    if node.op_type != OP_TYPE or len(node.input) not in (3, 4):
        return node
    n = _int(node, "N")
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.input[1:]
    for slot, name in ((1, "packed"), (2, "scales"), (3, "super_scales"))[: len(node.input) - 1]:
        value = _initializer(initializers, node, slot, name)
        value = value.reshape(n, -1) if n > 0 and value.size % n == 0 else value
        out.attribute.append(helper.make_attribute(name, numpy_helper.from_array(value, name)))
    return out


def gather_table(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray:
    """The float32 table [rows, K] a CimInt4Gather node reads, dequantized by the reference."""
    k, group_size, bits = _int(node, "K"), _int(node, "group_size", 32), _int(node, "bits", DEFAULT_BITS)
    if bits not in SUPPORTED_BITS:
        raise ValueError(
            f"{GATHER_OP_TYPE} node '{node.name}': attribute 'bits' is {bits}, expected one of {SUPPORTED_BITS}"
        )
    grid = next((helper.get_attribute_value(a) for a in node.attribute if a.name == ATTR_GRID), DEFAULT_GRID.encode())
    grid = grid.decode() if isinstance(grid, bytes) else grid
    try:
        check_grid(grid, bits)
    except ValueError as e:
        raise ValueError(f"{GATHER_OP_TYPE} node '{node.name}': attribute 'grid': {e}") from None
    packed = _initializer(initializers, node, 0, "packed")
    scales = _initializer(initializers, node, 2, "scales")
    groups = -(-k // group_size)
    rows = packed.shape[0] if packed.ndim else 0
    width = row_bytes(groups * group_size, bits)
    int8 = len(node.input) == 4 and bool(node.input[3])  # an empty optional input is absent, as in the op
    super_scales = _initializer(initializers, node, 3, "super_scales") if int8 else None
    if (
        packed.dtype != np.uint8
        or packed.size != rows * width
        or scales.size != rows * groups
        or scales.dtype not in ((np.int8,) if int8 else (np.float32, np.float16))
        or (int8 and (super_scales.dtype != np.float16 or super_scales.size != rows * supers_of(groups)))
    ):
        kind = "int8 [rows, {}] scales and float16 super_scales" if int8 else "float32 or float16 [rows, {}] scales"
        kind = kind.format(groups)
        raise ValueError(
            f"{GATHER_OP_TYPE} node '{node.name}': packed {list(packed.shape)} / scales {list(scales.shape)} "
            f"{scales.dtype} do not hold [rows, {width}] codes and {kind} for K={k}, bits={bits}"
        )
    supers = None if super_scales is None else super_scales.reshape(rows, -1)
    values = scale_values(scales.reshape(rows, groups), supers)
    return reference.gather(packed.reshape(rows, -1), values, np.arange(rows), k, group_size, bits, grid)


def reference_model(model: onnx.ModelProto, compute: str | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose CimInt4MatMul nodes run the reference op (``compute`` overrides each node's mode)."""
    if compute is not None:
        check_compute(compute)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input}
    taken |= {name for node in graph.node for name in (*node.input, *node.output)}

    def fresh(name: str) -> str:
        candidate, i = name, 0
        while candidate in taken:
            i += 1
            candidate = f"{name}.{i}"
        taken.add(candidate)
        return candidate

    nodes: list[onnx.NodeProto] = []
    shape_checks: dict[int, str] = {}  # K -> name of its empty [K, 0] initializer
    initializers = {t.name: t for t in graph.initializer}
    tables: set[str] = set()  # int4 tables now held by the reference nodes (dropped when no node reads them)
    for node in graph.node:
        if node.op_type == GATHER_OP_TYPE and node.domain == OP_DOMAIN:
            table = fresh(f"{node.name or node.output[0]}.reference.table")
            graph.initializer.append(numpy_helper.from_array(gather_table(node, initializers), table))
            nodes.append(helper.make_node("Gather", [table, node.input[1]], list(node.output), name=node.name))
            tables.update(name for i, name in enumerate(node.input) if i != 1)  # packed, scales, super_scales
            continue
        if not is_op_node(node):
            nodes.append(node)
            continue
        tables.update(node.input[1:])
        w = Int4Node.from_node(with_table_attributes(node, initializers))
        prefix = f"{node.name or node.output[0]}.reference"
        if w.k not in shape_checks:
            shape_checks[w.k] = fresh(f"cim_int4.reference.empty_{w.k}x0")
            graph.initializer.append(numpy_helper.from_array(np.zeros((w.k, 0), np.float32), shape_checks[w.k]))
        inputs = [node.input[0], fresh(f"{prefix}.shape_check")]
        nodes.append(helper.make_node("MatMul", [node.input[0], shape_checks[w.k]], [inputs[1]], name=inputs[1]))
        bias = w.bias if w.bias is not None else np.zeros(0, np.float32)
        scales = w.scales.astype(np.float32)  # exact: the op computes with float32(scale)
        for name, value in (("packed", w.packed), ("scales", scales), ("bias", bias)):
            inputs.append(fresh(f"{prefix}.{name}"))
            graph.initializer.append(numpy_helper.from_array(value, inputs[-1]))
        nodes.append(
            helper.make_node(
                REFERENCE_OP,
                inputs,
                list(node.output),
                name=node.name,
                domain=REFERENCE_DOMAIN,
                K=w.k,
                N=w.n,
                group_size=w.group_size,
                bits=w.bits,
                compute=compute or w.compute,
                node=node.name,
                gated=w.gated or "",
                grid=w.grid,
            )
        )
    graph.ClearField("node")
    graph.node.extend(nodes)
    read = {i for g in [graph] for n in g.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name not in tables - read]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    imports = [o for o in out.opset_import if o.domain not in (OP_DOMAIN, REFERENCE_DOMAIN)]
    out.ClearField("opset_import")
    out.opset_import.extend([*imports, helper.make_opsetid(REFERENCE_DOMAIN, 1)])
    return out


def reference_session(model: ModelSource, so: ort.SessionOptions) -> ort.InferenceSession:
    """An InferenceSession running ``model`` on the reference op; ``so`` must register ``extensions_library()``."""
    rewritten = reference_model(load_source(model), compute_override(so))
    return proto_session(rewritten, so)
