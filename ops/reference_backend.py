"""The reference backend: CimInt4MatMul served by the NumPy reference inside ONNX Runtime, no op library needed.

onnxruntime-extensions runs Python functions as ORT custom ops (domain ``ai.onnx.contrib``),
with three limits that shape this module:

* A Python op cannot read a *tensor* attribute (declaring one aborts the process), so the
  session runs a rewritten copy of the model: each ``CimInt4MatMul`` becomes a
  ``CimInt4MatMulReference`` node whose ``packed``, ``scales`` and ``bias`` are constant
  initializer inputs, and whose ``K``, ``N``, ``group_size``, ``compute`` and ``node`` (the
  original node's name) are int/string attributes. Every other node, and every tensor name,
  stays as it was.
* An exception raised by a Python op aborts the process. So every attribute is checked when
  the session is made (one-line ``ValueError`` naming node and attribute, the same checks as
  the op library), and a wrong input shape is caught by ORT itself: a ``MatMul`` of ``A``
  with an empty ``[K, 0]`` constant runs first and fails like any ORT node.
* Ops are registered per process, by name: ``CimInt4MatMulReference`` is registered once and
  cannot clash with the library's ``CimInt4MatMul`` (domain ``dbhoo.cim``).

A ``CimInt4Gather`` (int4 embedding) becomes an ONNX ``Gather`` on its table dequantized by
``reference.gather`` (the same float32 products), and a ``CimInt4MatMul`` that reads its codes
and scales as initializer inputs (a tied LM head) is read as if they were its attributes.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from ..exporter.api import load_model
from ..exporter.io import EXTERNAL_DATA_THRESHOLD
from ..exporter.quantize import SUPPORTED_GROUP_SIZES
from ..exporter.subgraph import used_names
from . import reference
from .names import GATHER_OP_TYPE, OP_DOMAIN, OP_TYPE

REFERENCE_DOMAIN = "ai.onnx.contrib"  # the only domain onnxruntime-extensions serves Python ops from
REFERENCE_OP = "CimInt4MatMulReference"
COMPUTE_CONFIG_KEY = "cim_int4.compute"
EXTRA = "cim-int4[reference]"

if TYPE_CHECKING:
    from .session import ModelSource


class ReferenceBackendUnavailable(ImportError):
    """onnxruntime-extensions is not installed; the message says which extra to install."""


@dataclass(frozen=True)
class NodeWeights:
    """One CimInt4MatMul node's checked attributes, as NumPy arrays."""

    node: str
    k: int
    n: int
    group_size: int
    packed: np.ndarray
    scales: np.ndarray
    bias: np.ndarray | None
    compute: str


def is_cim_node(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a CimInt4MatMul of the op library's domain."""
    return node.op_type == OP_TYPE and node.domain == OP_DOMAIN


def _attribute_values(node: onnx.NodeProto, where: str) -> dict[str, object]:
    values: dict[str, object] = {}
    for attr in node.attribute:
        try:
            values[attr.name] = helper.get_attribute_value(attr)
        except Exception as e:  # noqa: BLE001 - onnx raises several types for unreadable attributes
            raise ValueError(f"{where}attribute '{attr.name}' cannot be read ({e})") from None
    return values


def _int_attribute(values: dict[str, object], name: str, where: str, default: int | None = None) -> int:
    value = values.get(name, default)
    if value is None or not isinstance(value, int):
        raise ValueError(f"{where}attribute '{name}' is missing or not an int")
    return value


def _tensor_attribute(
    values: dict[str, object], name: str, where: str, dtype: type, shape: tuple[int, ...]
) -> np.ndarray:
    expected = f"{np.dtype(dtype).name} tensor {list(shape)}"
    value = values.get(name)
    if not isinstance(value, onnx.TensorProto):
        raise ValueError(f"{where}attribute '{name}' is missing or not a tensor (expected {expected})")
    try:
        array = numpy_helper.to_array(value)
    except Exception as e:  # noqa: BLE001 - e.g. external data that was not loaded
        raise ValueError(f"{where}attribute '{name}' cannot be read ({e})") from None
    if array.dtype != dtype:
        raise ValueError(f"{where}attribute '{name}' has element type {array.dtype}, expected {expected}")
    if array.shape != shape:
        raise ValueError(f"{where}attribute '{name}' has shape {list(array.shape)}, expected {expected}")
    return array


def _initializer(initializers: dict[str, onnx.TensorProto], node: onnx.NodeProto, slot: int, role: str) -> np.ndarray:
    name = node.input[slot] if len(node.input) > slot else ""
    if name not in initializers:
        raise ValueError(f"{node.op_type} node '{node.name}': input {slot} '{role}' ({name!r}) must be a constant "
                         "initializer of the main graph")
    return numpy_helper.to_array(initializers[name])


def with_table_attributes(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> onnx.NodeProto:
    """A CimInt4MatMul that reads codes and scales as inputs, as the equivalent one-input node with attributes."""
    if len(node.input) != 3:
        return node
    values = _attribute_values(node, f"{OP_TYPE} node '{node.name}': ")
    n = _int_attribute(values, "N", f"{OP_TYPE} node '{node.name}': ")
    packed = _initializer(initializers, node, 1, "packed")
    scales = _initializer(initializers, node, 2, "scales")
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.input[1:]
    for name, value in (("packed", packed.reshape(n, -1) if packed.size % max(n, 1) == 0 else packed),
                        ("scales", scales.reshape(n, -1) if scales.size % max(n, 1) == 0 else scales)):
        out.attribute.append(helper.make_attribute(name, numpy_helper.from_array(value, name)))
    return out


def gather_table(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray:
    """The float32 table [rows, K] a CimInt4Gather node reads, dequantized by the reference."""
    where = f"{GATHER_OP_TYPE} node '{node.name}': "
    values = _attribute_values(node, where)
    k = _int_attribute(values, "K", where)
    group_size = _int_attribute(values, "group_size", where, default=32)
    packed = _initializer(initializers, node, 0, "packed")
    scales = _initializer(initializers, node, 2, "scales")
    groups = -(-k // group_size)
    rows = packed.shape[0] if packed.ndim else 0
    if packed.dtype != np.uint8 or packed.size != rows * groups * group_size // 2 or scales.size != rows * groups:
        raise ValueError(f"{where}packed {list(packed.shape)} / scales {list(scales.shape)} do not hold "
                         f"[rows, {groups * group_size // 2}] codes and [rows, {groups}] scales for K={k}")
    return reference.gather(packed.reshape(rows, -1), scales, np.arange(rows), k, group_size)


def node_weights(node: onnx.NodeProto) -> NodeWeights:
    """Read and check a CimInt4MatMul node's attributes as the op library does; ValueError names node and attribute."""
    where = f"{OP_TYPE} node '{node.name}': "
    if len(node.input) != 1 or len(node.output) != 1:
        raise ValueError(f"{where}has {len(node.input)} inputs and {len(node.output)} outputs, expected 1 and 1")
    values = _attribute_values(node, where)
    k = _int_attribute(values, "K", where)
    n = _int_attribute(values, "N", where)
    group_size = _int_attribute(values, "group_size", where, default=32)
    for name, value in (("K", k), ("N", n)):
        if value < 1:
            raise ValueError(f"{where}attribute '{name}' is {value}, expected >= 1")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{where}attribute 'group_size' is {group_size}, expected one of {SUPPORTED_GROUP_SIZES}")
    compute = values.get("compute", b"fp32")
    compute = compute.decode() if isinstance(compute, bytes) else compute
    if compute not in reference.COMPUTE_MODES:
        raise ValueError(f"{where}attribute 'compute' is {compute!r}, expected one of {reference.COMPUTE_MODES}")
    groups = -(-k // group_size)
    packed = _tensor_attribute(values, "packed", where, np.uint8, (n, groups * group_size // 2))
    scales = _tensor_attribute(values, "scales", where, np.float32, (n, groups))
    bias = _tensor_attribute(values, "bias", where, np.float32, (n,)) if "bias" in values else None
    padding = reference.unpack(packed)[:, k:]
    if np.any(padding != 0):
        row, col = np.argwhere(padding != 0)[0]
        raise ValueError(f"{where}attribute 'packed': padding code at row {row}, k={k + col} is not 8")
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~np.isfinite(np.float32(8) * np.abs(scales))
    if np.any(bad):
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"{where}attribute 'scales': [{row}, {col}] is not finite with 8*|scale| finite")
    if bias is not None and not np.all(np.isfinite(bias)):
        raise ValueError(f"{where}attribute 'bias': index {np.argwhere(~np.isfinite(bias))[0][0]} is not finite")
    return NodeWeights(node.name, k, n, group_size, packed, scales, bias, compute)


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
) -> np.ndarray:
    """What one reference node computes: ``reference.emulate`` (an empty ``bias`` means none)."""
    return reference.emulate(a, packed, scales, K, group_size, bias if bias.size else None, compute)


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
        return np.full((*a.shape[:-1], int(attrs["N"])), np.nan, dtype=np.float32)


@functools.cache
def _register_op() -> None:
    # onnx_op registers for the whole process; registering twice would add a second definition.
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    f32, u8 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_uint8
    attrs = {
        "K": PyCustomOpDef.dt_int64,
        "N": PyCustomOpDef.dt_int64,
        "group_size": PyCustomOpDef.dt_int64,
        "compute": PyCustomOpDef.dt_string,
        "node": PyCustomOpDef.dt_string,
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
        value = so.get_session_config_entry(COMPUTE_CONFIG_KEY)
    except RuntimeError:  # ORT's way of saying the entry is not set
        return None
    if value not in reference.COMPUTE_MODES:
        raise ValueError(
            f"session config '{COMPUTE_CONFIG_KEY}' is {value!r}, expected one of {reference.COMPUTE_MODES}"
        )
    return value


def load_source(model: ModelSource) -> onnx.ModelProto:
    """``model`` as a ModelProto with its external data loaded (a path is read with load_model's errors)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        try:
            return onnx.load_model_from_string(model)
        except DecodeError as e:
            raise ValueError(f"the model bytes are not a readable ONNX model ({e})") from None
    return load_model(model)


def reference_model(model: onnx.ModelProto, compute: str | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose CimInt4MatMul nodes run the reference op (``compute`` overrides each node's mode)."""
    if compute is not None and compute not in reference.COMPUTE_MODES:
        raise ValueError(f"compute must be one of {reference.COMPUTE_MODES}, got {compute!r}")
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
            tables.update(node.input[0::2])
            continue
        if not is_cim_node(node):
            nodes.append(node)
            continue
        w = node_weights(with_table_attributes(node, initializers))
        tables.update(node.input[1:])
        prefix = f"{node.name or node.output[0]}.reference"
        if w.k not in shape_checks:
            shape_checks[w.k] = fresh(f"cim_int4.reference.empty_{w.k}x0")
            graph.initializer.append(numpy_helper.from_array(np.zeros((w.k, 0), np.float32), shape_checks[w.k]))
        inputs = [node.input[0], fresh(f"{prefix}.shape_check")]
        nodes.append(helper.make_node("MatMul", [node.input[0], shape_checks[w.k]], [inputs[1]], name=inputs[1]))
        bias = w.bias if w.bias is not None else np.zeros(0, np.float32)
        for name, value in (("packed", w.packed), ("scales", w.scales), ("bias", bias)):
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
                compute=compute or w.compute,
                node=node.name,
            )
        )
    graph.ClearField("node")
    graph.node.extend(nodes)
    unread = tables - used_names(graph)
    kept = [t for t in graph.initializer if t.name not in unread]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    imports = [o for o in out.opset_import if o.domain not in (OP_DOMAIN, REFERENCE_DOMAIN)]
    out.ClearField("opset_import")
    out.opset_import.extend([*imports, helper.make_opsetid(REFERENCE_DOMAIN, 1)])
    return out


@contextmanager
def _ort_source(model: onnx.ModelProto) -> Iterator[bytes | str]:
    # Protobuf cannot serialise 2 GiB: a large model goes through a temporary file with its
    # tensors in external data, which ORT has read by the time the session exists.
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size <= EXTERNAL_DATA_THRESHOLD:
        yield model.SerializeToString()
        return
    with tempfile.TemporaryDirectory(prefix="cim-int4-reference-") as folder:
        path = Path(folder) / "model.onnx"
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save_model(copy, path, save_as_external_data=True, location="model.onnx.data")
        yield str(path)


def reference_session(model: ModelSource, so: ort.SessionOptions) -> ort.InferenceSession:
    """An InferenceSession running ``model`` on the reference op; ``so`` must register ``extensions_library()``."""
    rewritten = reference_model(load_source(model), compute_override(so))
    with _ort_source(rewritten) as source:
        return ort.InferenceSession(source, sess_options=so, providers=["CPUExecutionProvider"])
