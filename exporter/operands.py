"""What one MatMul/Gemm becomes: its folded weight, a bias for the attribute or an Add, Casts, reshapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from .fold import Folded, NotFoldable, Scope

# Element types the op runs behind Casts (it computes in float32); float32 needs none.
CAST_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
FLOAT_TYPES = (onnx.TensorProto.FLOAT, *CAST_TYPES)


class Ineligible(Exception):
    """A node that stays as it is; the message says why."""


@dataclass
class Plan:
    """One node's rewrite: ``y = [Unsqueeze](Cast(op(Cast([Transpose](x))))) [+ add]``, steps as needed."""

    w: np.ndarray  # float32 [K, N], Gemm's alpha and transB applied
    elem_type: int  # the node's tensor type; not FLOAT means Casts around the op
    bytes_before: int
    sources: list[str] = field(default_factory=list)  # names the weight (and bias) were read through
    bias: np.ndarray | None = None  # float32 [N], into the op's attribute
    add: str | None = None  # a Gemm C that stays a tensor, added after the op
    add_value: np.ndarray | None = None  # C's value when constant (so beta can be folded into it)
    beta: float = 1.0
    trans_a: bool = False
    unsqueeze: int = 0  # leading axes MatMul's broadcast adds for a [1, K, N] weight

    @property
    def notes(self) -> str:
        notes = []
        if self.elem_type != onnx.TensorProto.FLOAT:
            notes.append(f"{onnx.TensorProto.DataType.Name(self.elem_type)}, Cast to FLOAT around the op")
        if self.add is not None:
            notes.append(f"bias {self.add!r} kept as an Add")
        if self.trans_a:
            notes.append("transA as a Transpose")
        return "; ".join(notes)


def _attr(node: onnx.NodeProto, name: str, default: float | int) -> float | int:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _weight(scope: Scope, node: onnx.NodeProto) -> Folded:
    name = node.input[1]
    try:
        folded = scope.resolve(name)
    except NotFoldable as why:
        if scope.is_constant(node.input[0]) and not scope.is_constant(name):
            raise Ineligible(
                f"the constant is the first operand ({node.input[0]!r}); only x @ W is quantized"
            ) from None
        raise Ineligible(str(why)) from None
    if folded.elem_type not in FLOAT_TYPES:
        dtype = onnx.TensorProto.DataType.Name(folded.elem_type)
        raise Ineligible(f"weight {name!r} is {dtype}; only FLOAT, FLOAT16 and BFLOAT16 weights are quantized")
    return folded


def plan_matmul(node: onnx.NodeProto, scope: Scope, rank_of: Callable[[str], int | None]) -> Plan:
    """The plan of a MatMul whose second input is a constant [K, N] (or [1, K, N]) weight."""
    name = node.input[1]
    folded = _weight(scope, node)
    w = folded.value
    unsqueeze = 0
    if w.ndim > 2 and all(d == 1 for d in w.shape[:-2]):
        # MatMul broadcasts the unit batch into its output: [M, K] @ [1, K, N] is [1, M, N].
        rank = rank_of(node.input[0])
        if rank is None:
            raise Ineligible(
                f"weight {name!r} has shape {list(w.shape)} and the rank of input {node.input[0]!r} is unknown "
                "(run shape inference, or export with simplify=True)"
            )
        unsqueeze = w.ndim - 2 if rank == 1 else max(0, w.ndim - rank)
        w = w.reshape(w.shape[-2:])
    if w.ndim != 2:
        raise Ineligible(f"weight {name!r} has shape {list(w.shape)}; only 2-D (or [1, K, N]) weights are quantized")
    return Plan(
        w=np.ascontiguousarray(w, dtype=np.float32),
        elem_type=folded.elem_type,
        bytes_before=folded.value.nbytes,
        sources=folded.names,
        unsqueeze=unsqueeze,
    )


def plan_gemm(node: onnx.NodeProto, scope: Scope) -> Plan:
    """The plan of a Gemm ``alpha * A' B' + beta * C`` with a constant B; C folds into the bias or stays an Add."""
    folded = _weight(scope, node)
    if folded.value.ndim != 2:
        raise Ineligible(f"Gemm weight {node.input[1]!r} has shape {list(folded.value.shape)}; expected 2-D")
    w = folded.value.astype(np.float32)
    if _attr(node, "transB", 0):
        w = w.T
    plan = Plan(
        w=np.ascontiguousarray(w * np.float32(_attr(node, "alpha", 1.0)), dtype=np.float32),
        elem_type=folded.elem_type,
        bytes_before=folded.value.nbytes,
        sources=list(folded.names),
        trans_a=bool(_attr(node, "transA", 0)),
    )
    if len(node.input) < 3 or not node.input[2]:
        return plan
    beta = float(_attr(node, "beta", 1.0))
    try:
        c = scope.resolve(node.input[2], "Gemm bias")
    except NotFoldable:
        c = None  # computed, a graph input, or behind an op we do not fold: it stays a tensor
    n = w.shape[1]
    if c is not None and c.value.size in (1, n) and (c.value.ndim < 2 or (c.value.ndim == 2 and c.value.shape[0] == 1)):
        bias = c.value.astype(np.float32).reshape(-1) * np.float32(beta)
        plan.bias = np.ascontiguousarray(np.broadcast_to(bias, (n,)), dtype=np.float32)
        plan.sources += c.names
        plan.bytes_before += c.value.nbytes
    else:
        plan.add, plan.beta = node.input[2], beta
        plan.add_value = None if c is None else c.value
    return plan
