"""Graph rewrite: constant-weight MatMul / Gemm nodes become CimInt4MatMul nodes."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ops.names import OP_DOMAIN, OP_TYPE, OP_VERSION
from ..ops.reference import COMPUTE_MODES
from .quantize import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_RULE, QuantizedWeight, check_group_size, quantize_weight
from .scale_rules import check_scale_rule

if TYPE_CHECKING:
    from .sensitivity import MixedPrecision

DEFAULT_DOMAINS = ("", "ai.onnx")
# Written into every node's ``compute`` attribute unless the export asks otherwise.
DEFAULT_COMPUTE = "fp32"


def check_compute(compute: str) -> None:
    """Raise ValueError unless ``compute`` is a compute mode of the op."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")


@dataclass(frozen=True)
class Rewritten:
    """One node that became CimInt4MatMul."""

    name: str
    op_type: str
    k: int
    n: int
    bytes_before: int
    bytes_after: int


@dataclass(frozen=True)
class Skipped:
    """One MatMul/Gemm node left as it was, and why."""

    name: str
    op_type: str
    reason: str


@dataclass
class ExportSummary:
    """What the rewrite did: nodes rewritten and skipped, weight bytes before and after."""

    group_size: int
    scale_rule: str = DEFAULT_SCALE_RULE
    compute: str = DEFAULT_COMPUTE
    rewritten: list[Rewritten] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    # Set by a mixed-precision export: an object whose format() explains what stayed FP32.
    mixed_precision: MixedPrecision | None = None

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.rewritten)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.rewritten)

    def format(self) -> str:
        """A human-readable report, one line per node."""
        lines = [
            f"cim-int4: {len(self.rewritten)} node(s) quantized to INT4 (group {self.group_size}, "
            f"scale rule {self.scale_rule}, compute {self.compute}), {len(self.skipped)} skipped"
        ]
        for r in self.rewritten:
            lines.append(f"  quantized {r.op_type} {r.name!r}: K={r.k} N={r.n}")
        for s in self.skipped:
            lines.append(f"  skipped   {s.op_type} {s.name!r}: {s.reason}")
        if self.rewritten:
            ratio = self.bytes_before / max(self.bytes_after, 1)
            lines.append(f"  weight bytes: {self.bytes_before:,} -> {self.bytes_after:,} ({ratio:.2f}x smaller)")
        if self.mixed_precision is not None:
            lines.append(self.mixed_precision.format())
        return "\n".join(lines)


class _Constants:
    """Constant tensors of the main graph: initializers (not overridable inputs) and Constant nodes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        inputs = {i.name for i in graph.input}
        self.initializers = {t.name: t for t in graph.initializer}
        self.overridable = inputs & self.initializers.keys()
        self.constant_nodes = {
            n.output[0]: n
            for n in graph.node
            if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and [a.name for a in n.attribute] == ["value"]
        }

    def tensor(self, name: str) -> onnx.TensorProto | None:
        if name in self.overridable:
            return None
        if name in self.initializers:
            return self.initializers[name]
        node = self.constant_nodes.get(name)
        return node.attribute[0].t if node is not None else None


def _used_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every tensor name read by a node of ``graph`` or of its subgraphs, and every graph output."""
    for node in graph.node:
        yield from (i for i in node.input if i)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _used_names(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _used_names(g)
    yield from (o.name for o in graph.output)


def _excluded(name: str, patterns: list[tuple[str, re.Pattern[str]]]) -> str | None:
    for text, pattern in patterns:
        if name == text or pattern.fullmatch(name):
            return text
    return None


def _attr(node: onnx.NodeProto, name: str, default: float | int) -> float | int:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Ineligible(Exception):
    """A node that stays as it is; the message says why."""


def _weight(consts: _Constants, name: str) -> np.ndarray:
    tensor = consts.tensor(name)
    if tensor is None:
        raise _Ineligible(f"weight {name!r} is not a constant (not an initializer or Constant, or a graph input)")
    if tensor.data_type != onnx.TensorProto.FLOAT:
        dtype = onnx.TensorProto.DataType.Name(tensor.data_type)
        raise _Ineligible(f"weight {name!r} is {dtype}; only FLOAT (float32) weights are quantized")
    if len(tensor.dims) != 2:
        raise _Ineligible(f"weight {name!r} has shape {list(tensor.dims)}; only 2-D weights are quantized")
    return numpy_helper.to_array(tensor)


def _matmul_operands(node: onnx.NodeProto, consts: _Constants) -> tuple[np.ndarray, np.ndarray | None]:
    """Weight [K, N] and bias [N] (or None) of an eligible MatMul or Gemm."""
    if node.op_type == "MatMul":
        return _weight(consts, node.input[1]), None
    # Gemm: Y = alpha * A' B' + beta * C; only A' = A keeps the op's [..., K] input.
    if _attr(node, "transA", 0):
        raise _Ineligible("Gemm with transA=1 is not supported")
    w = _weight(consts, node.input[1])
    if _attr(node, "transB", 0):
        w = w.T
    w = np.ascontiguousarray(w * np.float32(_attr(node, "alpha", 1.0)), dtype=np.float32)
    if len(node.input) < 3 or not node.input[2]:
        return w, None
    c_tensor = consts.tensor(node.input[2])
    if c_tensor is None or c_tensor.data_type != onnx.TensorProto.FLOAT:
        raise _Ineligible(f"Gemm bias {node.input[2]!r} is not a float32 constant")
    c = numpy_helper.to_array(c_tensor).astype(np.float32) * np.float32(_attr(node, "beta", 1.0))
    n = w.shape[1]
    if c.size not in (1, n) or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2:
        raise _Ineligible(f"Gemm bias {node.input[2]!r} has shape {list(c.shape)}; only [N], [1, N] or scalar fold")
    return w, np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (n,)), dtype=np.float32)


@dataclass(frozen=True)
class ExportOptions:
    """How to export: which nodes (group size, exclusions, minimum size) and how (scale rule, compute mode)."""

    group_size: int = DEFAULT_GROUP_SIZE
    exclude: tuple[str, ...] = ()
    min_size: int = 0
    scale_rule: str = DEFAULT_SCALE_RULE
    compute: str = DEFAULT_COMPUTE

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        check_scale_rule(self.scale_rule)
        check_compute(self.compute)
        object.__setattr__(self, "exclude", tuple(self.exclude))


@dataclass(frozen=True)
class Candidate:
    """An eligible MatMul/Gemm: its index in the graph, report label, weight [K, N] and bias [N] (or None)."""

    index: int
    label: str
    op_type: str
    w: np.ndarray
    bias: np.ndarray | None


def find_candidates(model: onnx.ModelProto, options: ExportOptions) -> tuple[list[Candidate], list[Skipped]]:
    """The MatMul/Gemm nodes of ``model``'s main graph that can become CimInt4MatMul, and the others with why."""
    group_size, min_size = options.group_size, options.min_size
    patterns = []
    for text in options.exclude:
        try:
            patterns.append((text, re.compile(text)))
        except re.error as e:
            raise ValueError(f"exclude pattern {text!r} is not a valid regular expression: {e}") from e
    consts = _Constants(model.graph)
    candidates, skipped = [], []
    for index, node in enumerate(model.graph.node):
        if node.domain not in DEFAULT_DOMAINS or node.op_type not in ("MatMul", "Gemm"):
            continue
        label = node.name or f"{node.op_type}#{index} -> {node.output[0]}"
        try:
            pattern = _excluded(node.name, patterns)
            if pattern is not None:
                raise _Ineligible(f"excluded by pattern {pattern!r}")
            w, bias = _matmul_operands(node, consts)
            k, n = w.shape
            if k < group_size:
                raise _Ineligible(f"K={k} is smaller than group_size={group_size}")
            if k * n < min_size:
                raise _Ineligible(f"weight has {k * n} elements, fewer than min_size={min_size}")
            if not np.all(np.isfinite(w)):
                raise _Ineligible("weight has NaN or infinite values")
        except _Ineligible as why:
            skipped.append(Skipped(label, node.op_type, str(why)))
            continue
        candidates.append(Candidate(index, label, node.op_type, w, bias))
    return candidates, skipped


def rewrite_model(
    model: onnx.ModelProto,
    options: ExportOptions | None = None,
    *,
    keep: Mapping[str, str] | None = None,
    quantized: Mapping[str, QuantizedWeight] | None = None,
) -> tuple[onnx.ModelProto, ExportSummary]:
    """A copy of ``model`` with every eligible MatMul/Gemm replaced by CimInt4MatMul, and the summary.

    ``keep`` maps candidate labels to leave in FP32 to the reason the summary gives;
    ``quantized`` holds weights already quantized (by label) with the same options.
    """
    options = options or ExportOptions()
    for opset in model.opset_import:
        if opset.domain == OP_DOMAIN and opset.version != OP_VERSION:
            raise ValueError(
                f"model imports domain {OP_DOMAIN!r} at version {opset.version}; this exporter writes {OP_VERSION}"
            )
    candidates, skipped = find_candidates(model, options)
    keep = keep or {}
    quantized = quantized or {}

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    summary = ExportSummary(options.group_size, options.scale_rule, options.compute, skipped=skipped)
    for c in candidates:
        if c.label in keep:
            summary.skipped.append(Skipped(c.label, c.op_type, keep[c.label]))
            continue
        node = graph.node[c.index]
        qw = quantized.get(c.label) or quantize_weight(c.w, options.group_size, options.scale_rule)
        k, n = c.w.shape
        attrs = {
            "K": k,
            "N": n,
            "group_size": options.group_size,
            "packed": numpy_helper.from_array(qw.packed, "packed"),
            "scales": numpy_helper.from_array(qw.scales, "scales"),
            "compute": options.compute,
        }
        if c.bias is not None:
            attrs["bias"] = numpy_helper.from_array(c.bias, "bias")
        new = helper.make_node(
            OP_TYPE,
            [node.input[0]],
            [node.output[0]],
            name=node.name or f"{node.output[0]}/{OP_TYPE}",
            domain=OP_DOMAIN,
            **attrs,
        )
        graph.node[c.index].CopyFrom(new)
        bias_bytes = 0 if c.bias is None else c.bias.nbytes
        summary.rewritten.append(
            Rewritten(
                name=c.label,
                op_type=c.op_type,
                k=k,
                n=n,
                bytes_before=c.w.nbytes + bias_bytes,
                bytes_after=qw.packed.nbytes + qw.scales.nbytes + bias_bytes,
            )
        )

    if summary.rewritten:
        _drop_unused_constants(graph)
        if not any(o.domain == OP_DOMAIN for o in out.opset_import):
            out.opset_import.append(helper.make_opsetid(OP_DOMAIN, OP_VERSION))
    return out, summary


def _drop_unused_constants(graph: onnx.GraphProto) -> None:
    used = set(_used_names(graph))
    inputs = {i.name for i in graph.input}
    keep_init = [t for t in graph.initializer if t.name in used or t.name in inputs]
    if len(keep_init) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep_init)
    keep_nodes = [
        n
        for n in graph.node
        if not (n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and n.output[0] not in used)
    ]
    if len(keep_nodes) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep_nodes)
    names = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | inputs
    keep_vi = [v for v in graph.value_info if v.name in names]
    if len(keep_vi) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(keep_vi)
