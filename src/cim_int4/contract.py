"""The contract of the op library's nodes: the one home of every name, rule and format they share.

Everything that writes or reads a ``CimInt4MatMul`` node (the exporter, the MatMulNBits
converter, the reference backend, validation, the tests) takes its names, checks and node
layout from here, and the C++ library gets the same constants from a header CMake generates
from this file at build time (``ops/cpp/CMakeLists.txt``: it reads the ``NAME = value`` lines
below, so keep them literal, one per line). This module imports nothing else of the package.

The node (docs/contract.md has the full table, pinned to ``ATTRIBUTES`` by a test):

* ``K``, ``N`` (int >= 1) and ``group_size`` (one of ``SUPPORTED_GROUP_SIZES``; absent = 32):
  ``y[..., N] = a[..., K] @ W[K, N]`` with ``groups = ceil(K / group_size)`` scale groups along K.
* ``packed`` uint8 ``[N, groups * group_size / 2]``: row n holds channel n along K, element k in
  byte k // 2, **even k in the low nibble**, stored as the code ``q + 8`` (0..15); padding codes
  beyond K are 8 (q = 0). ``pack`` / ``unpack`` are this byte order.
* ``scales`` float32 ``[N, groups]``; any finite scale whose ``8 * |scale|`` is finite.
* ``bias`` (optional) float32 ``[N]``, finite.
* ``compute`` (optional string, one of ``COMPUTE_MODES``; absent = ``"fp32"``); a session's
  config entry ``COMPUTE_CONFIG`` overrides it for every node.

Dequantized, ``W[k, n] = scales[n, k // group_size] * (code(n, k) - 8)``.

How to grow it (each is rows/fields here, then the code that uses them):

* **A second op with the same codes/scales layout**: add its name (``*_OP_TYPE = "..."``,
  which CMake's header generator must also list) and an ``OpSpec`` row with its inputs and the
  subset of ``ATTRIBUTES`` it takes (plus any new ``Attribute`` rows). ``CimInt4Gather``
  (``GATHER``) and the tied-head form of the MatMul (``MATMUL_SHARED``) read the codes and
  scales as initializer inputs: ``SharedInt4Node`` writes them; ``Int4Node`` writes and
  ``Int4Node.from_node`` checks the attribute form (``OPS``).
* **A bit width**: add the width to ``SUPPORTED_BITS`` and an optional int ``Attribute``
  ``bits`` (default 4); ``pack``/``unpack`` and the shapes in ``Int4Node`` take
  ``bits`` from the node. Today only 4 exists and no node carries the attribute.
* **A scale dtype**: add it to ``SCALE_DTYPES`` and list it in the ``scales`` row's ``dtypes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

# --- names (read by CMake: keep each a literal on its own line) -------------------------------
OP_DOMAIN = "dbhoo.cim"
OP_TYPE = "CimInt4MatMul"
OP_VERSION = 1
# The int4 row gather (token embeddings, docs/embeddings.md): same domain and version, same codes/scales.
GATHER_OP_TYPE = "CimInt4Gather"
# Session config entry that sets the compute mode of every node of a session.
COMPUTE_CONFIG = "cim_int4.compute"
COMPUTE_MODES = ("fp32", "int8")
DEFAULT_COMPUTE = "fp32"
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 32
SUPPORTED_BITS = (4,)
SCALE_DTYPES = ("float32",)

# --- the code format ---------------------------------------------------------------------------
BITS = 4
CODE_OFFSET = 8  # stored code = q + 8
Q_MIN, Q_MAX = -8, 7


def check_compute(compute: str, what: str = "compute") -> str:
    """``compute`` if it is one of COMPUTE_MODES, else ValueError naming ``what``."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"{what} must be one of {COMPUTE_MODES}, got {compute!r}")
    return compute


def check_group_size(group_size: int) -> int:
    """``group_size`` if the op accepts it, else ValueError."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}")
    return group_size


def groups_of(k: int, group_size: int) -> int:
    """Scale groups along K: ``ceil(K / group_size)``."""
    return -(-k // group_size)


def pack(q: np.ndarray) -> np.ndarray:
    """Pack int8 ``q`` [N, K_padded] (-8..7, K_padded even) two per byte as codes q + 8, even k in the low nibble."""
    if q.ndim != 2 or q.shape[1] % 2:
        raise ValueError(f"q must be [N, K_padded] with K_padded even, got shape {q.shape}")
    if q.size and (q.min() < Q_MIN or q.max() > Q_MAX):
        raise ValueError(f"q values must lie in {Q_MIN}..{Q_MAX}")
    codes = (q.astype(np.int16) + CODE_OFFSET).astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """Codes (0..15) of ``packed`` uint8 [N, B] as uint8 [N, 2*B]: byte b holds k=2b (low nibble) and k=2b+1."""
    packed = np.asarray(packed, dtype=np.uint8)
    return np.stack([packed & 0x0F, packed >> 4], axis=2).reshape(packed.shape[0], -1)


def unpack(packed: np.ndarray) -> np.ndarray:
    """``q`` (-8..7) of ``packed`` uint8 [N, B] as int8 [N, 2*B]."""
    return (unpack_codes(packed).astype(np.int8) - CODE_OFFSET).astype(np.int8)


# --- the node's attributes ---------------------------------------------------------------------
@dataclass(frozen=True)
class Attribute:
    """One attribute of a node: name, ONNX kind, tensor dtypes (if a tensor), shape, whether required, default."""

    name: str
    kind: str  # "int" | "string" | "tensor"
    dtypes: tuple[str, ...] = ()
    shape: str = ""
    required: bool = True
    default: int | str | None = None
    meaning: str = ""


ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("K", "int", meaning="input features (A's last dimension), >= 1"),
    Attribute("N", "int", meaning="output features, >= 1"),
    Attribute(
        "group_size",
        "int",
        required=False,
        default=DEFAULT_GROUP_SIZE,
        meaning=f"K elements per scale, one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}",
    ),
    Attribute("packed", "tensor", ("uint8",), "[N, groups * group_size / 2]", meaning="two 4-bit codes q + 8 per byte"),
    Attribute("scales", "tensor", SCALE_DTYPES, "[N, groups]", meaning="one scale per output channel and group"),
    Attribute("bias", "tensor", ("float32",), "[N]", required=False, meaning="added to every output row"),
    Attribute(
        "compute",
        "string",
        required=False,
        default=DEFAULT_COMPUTE,
        meaning=f"compute mode, one of {', '.join(COMPUTE_MODES)}",
    ),
)


@dataclass(frozen=True)
class OpSpec:
    """One op of the library: its type, inputs and outputs, and the attributes it takes (by name)."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]

    def attribute(self, name: str) -> Attribute:
        """The ATTRIBUTES row ``name`` of this op."""
        return next(a for a in ATTRIBUTES if a.name == name and name in self.attributes)


MATMUL = OpSpec(OP_TYPE, ("A",), ("Y",), ("K", "N", "group_size", "packed", "scales", "bias", "compute"))
OPS: Mapping[str, OpSpec] = {MATMUL.op_type: MATMUL}
# The same codes and scales read as constant-initializer inputs instead of attributes, so that an
# embedding table (CimInt4Gather) and the LM head tied to it hold one copy (docs/embeddings.md).
MATMUL_SHARED = OpSpec(OP_TYPE, ("A", "packed", "scales"), ("Y",), ("K", "N", "group_size", "bias", "compute"))
GATHER = OpSpec(GATHER_OP_TYPE, ("packed", "indices", "scales"), ("Y",), ("K", "group_size"))


def is_op_node(node: onnx.NodeProto, op: OpSpec = MATMUL) -> bool:
    """Whether ``node`` is an ``op`` node of the library's domain."""
    return node.op_type == op.op_type and node.domain == OP_DOMAIN


# --- one node ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Node:
    """One node's contract values: ``to_node()`` writes the node, ``from_node()`` reads and checks one.

    ``compute=None`` writes no ``compute`` attribute (the op then computes in ``"fp32"``);
    ``from_node`` fills in the defaults, so a read node always has ``group_size`` and ``compute``.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    k: int
    n: int
    group_size: int
    packed: np.ndarray = field(repr=False)
    scales: np.ndarray = field(repr=False)
    bias: np.ndarray | None = field(default=None, repr=False)
    compute: str | None = DEFAULT_COMPUTE
    op: OpSpec = MATMUL

    @property
    def groups(self) -> int:
        """Scale groups along K."""
        return groups_of(self.k, self.group_size)

    def attributes(self) -> dict[str, object]:
        """The node's attributes as ``helper.make_node`` keywords (tensors as TensorProtos named as the attribute)."""
        values = {"K": self.k, "N": self.n, "group_size": self.group_size, "packed": self.packed,
                  "scales": self.scales, "bias": self.bias, "compute": self.compute}
        return _attributes(self.op, values)

    def to_node(self) -> onnx.NodeProto:
        """The ONNX node (domain OP_DOMAIN)."""
        return _make_node(self.op, self.name, self.inputs, self.outputs, self.attributes())

    @classmethod
    def from_node(cls, node: onnx.NodeProto, op: OpSpec | None = None) -> Int4Node:
        """Read and check a node as the op library does; ValueError names the node and the attribute."""
        op = op or OPS.get(node.op_type, MATMUL)
        where = f"{op.op_type} node '{node.name}': "
        if len(node.input) != len(op.inputs) or len(node.output) != len(op.outputs):
            raise ValueError(
                f"{where}has {len(node.input)} inputs and {len(node.output)} outputs, "
                f"expected {len(op.inputs)} and {len(op.outputs)}"
            )
        values = _attribute_values(node, where)
        k = _int(values, op.attribute("K"), where)
        n = _int(values, op.attribute("N"), where)
        group_size = _int(values, op.attribute("group_size"), where)
        for name, value in (("K", k), ("N", n)):
            if value < 1:
                raise ValueError(f"{where}attribute '{name}' is {value}, expected >= 1")
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"{where}attribute 'group_size' is {group_size}, expected one of {SUPPORTED_GROUP_SIZES}")
        compute = values.get("compute", DEFAULT_COMPUTE.encode())
        compute = compute.decode() if isinstance(compute, bytes) else compute
        if compute not in COMPUTE_MODES:
            raise ValueError(f"{where}attribute 'compute' is {compute!r}, expected one of {COMPUTE_MODES}")
        groups = groups_of(k, group_size)
        packed = _tensor(values, op.attribute("packed"), where, (n, groups * group_size // 2))
        scales = _tensor(values, op.attribute("scales"), where, (n, groups))
        bias = _tensor(values, op.attribute("bias"), where, (n,)) if "bias" in values else None
        padding = unpack_codes(packed)[:, k:]
        if np.any(padding != CODE_OFFSET):
            row, col = np.argwhere(padding != CODE_OFFSET)[0]
            raise ValueError(f"{where}attribute 'packed': padding code at row {row}, k={k + col} is not 8")
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite(np.float32(8) * np.abs(scales))
        if np.any(bad):
            row, col = np.argwhere(bad)[0]
            raise ValueError(f"{where}attribute 'scales': [{row}, {col}] is not finite with 8*|scale| finite")
        if bias is not None and not np.all(np.isfinite(bias)):
            raise ValueError(f"{where}attribute 'bias': index {np.argwhere(~np.isfinite(bias))[0][0]} is not finite")
        return cls(
            node.name, tuple(node.input), tuple(node.output), k, n, group_size, packed, scales, bias, compute, op
        )


@dataclass(frozen=True)
class SharedInt4Node:
    """A node that reads its codes and scales as initializer inputs (named in ``inputs``): ``to_node()`` writes it.

    ``op`` is MATMUL_SHARED (inputs: activations, packed, scales) or GATHER (inputs: packed,
    indices, scales); ``n``, ``bias`` and ``compute`` belong to the MatMul only (``compute=None``
    writes no attribute). The tensors' layout is the attribute form's (``Int4Node``).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    k: int
    group_size: int
    op: OpSpec
    n: int | None = None
    bias: np.ndarray | None = field(default=None, repr=False)
    compute: str | None = None

    def to_node(self) -> onnx.NodeProto:
        """The ONNX node (domain OP_DOMAIN)."""
        if len(self.inputs) != len(self.op.inputs):
            raise ValueError(f"{self.op.op_type} node '{self.name}' takes inputs {self.op.inputs}, got {self.inputs}")
        values = {"K": self.k, "N": self.n, "group_size": self.group_size, "bias": self.bias, "compute": self.compute}
        return _make_node(self.op, self.name, self.inputs, self.outputs, _attributes(self.op, values))


def _attributes(op: OpSpec, values: Mapping[str, object]) -> dict[str, object]:
    """The ``values`` that ``op`` takes and that are set, as ``helper.make_node`` keywords (arrays as TensorProtos)."""
    return {
        name: numpy_helper.from_array(np.ascontiguousarray(value), name) if isinstance(value, np.ndarray) else value
        for name, value in values.items()
        if name in op.attributes and value is not None
    }


def _make_node(
    op: OpSpec, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], attrs: Mapping[str, object]
) -> onnx.NodeProto:
    return helper.make_node(op.op_type, list(inputs), list(outputs), name=name, domain=OP_DOMAIN, **attrs)


def _attribute_values(node: onnx.NodeProto, where: str) -> dict[str, object]:
    values: dict[str, object] = {}
    for attr in node.attribute:
        try:
            values[attr.name] = helper.get_attribute_value(attr)
        except Exception as e:  # noqa: BLE001 - onnx raises several types for unreadable attributes
            raise ValueError(f"{where}attribute '{attr.name}' cannot be read ({e})") from None
    return values


def _int(values: dict[str, object], spec: Attribute, where: str) -> int:
    value = values.get(spec.name, spec.default)
    if value is None or not isinstance(value, int):
        raise ValueError(f"{where}attribute '{spec.name}' is missing or not an int")
    return value


def _tensor(values: dict[str, object], spec: Attribute, where: str, shape: tuple[int, ...]) -> np.ndarray:
    expected = f"{' or '.join(spec.dtypes)} tensor {list(shape)}"
    value = values.get(spec.name)
    if not isinstance(value, onnx.TensorProto):
        raise ValueError(f"{where}attribute '{spec.name}' is missing or not a tensor (expected {expected})")
    try:
        array = numpy_helper.to_array(value)
    except Exception as e:  # noqa: BLE001 - e.g. external data that was not loaded
        raise ValueError(f"{where}attribute '{spec.name}' cannot be read ({e})") from None
    if array.dtype.name not in spec.dtypes:
        raise ValueError(f"{where}attribute '{spec.name}' has element type {array.dtype}, expected {expected}")
    if array.shape != shape:
        raise ValueError(f"{where}attribute '{spec.name}' has shape {list(array.shape)}, expected {expected}")
    return array
