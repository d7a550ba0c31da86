"""Gated MLPs: two projections of one input, an activation on one, their product, found and fused into one node.

A decoder layer's MLP is ``down(act(x @ W_gate) * (x @ W_up))``: in ONNX two MatMuls of the same
input, an activation on the first (Sigmoid and Mul, QuickGelu, Gelu ``approximate="tanh"``,
FastGelu) and a Mul of the two. One CimInt4MatMul with attribute ``gated`` (contract: gate channels
then up channels) computes all of it in one pass over both weights, and a decode step runs one
node there instead of four or five: on SmolLM2 (0.1B) 90 of a step's 420 nodes go
(docs/contract.md, "Gated MLPs"; the decode speed it buys: docs/real-llm.md).

``find`` reads the graph only; ``fuse`` makes the node of two INT4 halves; the rewrite
(exporter.rewrite) and the MatMulNBits conversion (exporter.convert) call both.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import helper

from ..contract import Int4Node
from .fold import DEFAULT_DOMAINS
from .subgraph import subgraphs, used_names

MS_DOMAIN = "com.microsoft"
QUICK_GELU_DEFAULT_ALPHA = 1.702  # com.microsoft QuickGelu's alpha when the attribute is absent


@dataclass(frozen=True)
class GatedMLP:
    """Node indices (in one graph) of a gated MLP: the two projections, the activation's nodes, the final Mul."""

    gate: int
    up: int
    activation_nodes: tuple[int, ...]
    mul: int
    activation: str  # one of contract.GATED_ACTIVATIONS
    output: str  # the Mul's output: the fused node's

    @property
    def dropped(self) -> tuple[int, ...]:
        """The nodes the fused node replaces besides the Mul (whose place it takes)."""
        return (self.gate, self.up, *self.activation_nodes)


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)
    return value.decode() if isinstance(value, bytes) else value


def _is(node: onnx.NodeProto, op_type: str, domains: tuple[str, ...] = DEFAULT_DOMAINS) -> bool:
    return node.op_type == op_type and node.domain in domains


def find(graph: onnx.GraphProto, is_projection: Callable[[onnx.NodeProto], bool]) -> list[GatedMLP]:
    """Every gated MLP of ``graph`` (not its subgraphs) whose projections satisfy ``is_projection``.

    Only a pattern whose intermediate tensors nothing else reads (no other node, subgraph or
    graph output) is reported, so fusing it changes no other value of the graph.
    """
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for name in dict.fromkeys(n.input):
            if name:
                readers[name].append(i)
    outer = {o.name for o in graph.output}
    for n in nodes:  # names a subgraph reads count as read elsewhere
        for _, body in subgraphs(n):
            outer |= used_names(body)

    def only_read_by(name: str, indices: set[int]) -> bool:
        return name not in outer and set(readers.get(name, ())) == indices

    def activation_of(g: str) -> tuple[str, tuple[int, ...], str] | None:
        """(activation, its node indices, its output) when the only readers of ``g`` form one activation."""
        first = readers.get(g, [])
        if len(first) == 1:
            n = nodes[first[0]]
            # QuickGelu is x * sigmoid(alpha x), alpha 1.702 when absent (ORT's schema): silu only at 1.
            if _is(n, "QuickGelu", (MS_DOMAIN,)) and _attr(n, "alpha", QUICK_GELU_DEFAULT_ALPHA) == 1.0:
                return "silu", (first[0],), n.output[0]
            if (_is(n, "Gelu") and _attr(n, "approximate", "none") == "tanh") or (
                _is(n, "FastGelu", (MS_DOMAIN,)) and len([x for x in n.input if x]) == 1
            ):
                return "gelu_tanh", (first[0],), n.output[0]
            return None
        if len(first) != 2:
            return None
        sig = next((i for i in first if _is(nodes[i], "Sigmoid")), None)
        mul = next((i for i in first if i != sig and _is(nodes[i], "Mul")), None)
        if sig is None or mul is None:
            return None
        s = nodes[sig].output[0]
        if sorted(nodes[mul].input) != sorted([g, s]) or not only_read_by(s, {mul}):
            return None
        return "silu", (sig, mul), nodes[mul].output[0]

    found: list[GatedMLP] = []
    taken: set[int] = set()
    for gate, node in enumerate(nodes):
        if gate in taken or not is_projection(node) or not node.output:
            continue
        g = node.output[0]
        if g in outer:
            continue
        act = activation_of(g)
        if act is None:
            continue
        activation, act_nodes, a = act
        last = readers.get(a, [])
        if len(last) != 1 or a in outer or not _is(nodes[last[0]], "Mul") or len(nodes[last[0]].input) != 2:
            continue
        mul = last[0]
        u = next((x for x in nodes[mul].input if x != a), None)
        up = producer.get(u) if u is not None else None
        if (
            up is None
            or up == gate
            or up in taken
            or not is_projection(nodes[up])
            or nodes[up].input[0] != node.input[0]
            or not only_read_by(u, {mul})
        ):
            continue
        found.append(GatedMLP(gate, up, act_nodes, mul, activation, nodes[mul].output[0]))
        taken.update((gate, up))
    return found


def is_matmul(node: onnx.NodeProto) -> bool:
    """A plain ONNX MatMul: the projections ``find`` looks for in an FP32 graph."""
    return node.op_type == "MatMul" and node.domain in DEFAULT_DOMAINS


def stacked_bias(gate: np.ndarray | None, up: np.ndarray | None, n: int) -> np.ndarray | None:
    """The gated node's bias [2n]: the gate's then the up projection's (zeros for a missing one); None if neither."""
    if gate is None and up is None:
        return None
    zeros = np.zeros(n, np.float32)
    return np.concatenate([zeros if gate is None else gate, zeros if up is None else up])


def forget_shapes(graph: onnx.GraphProto, mlp: GatedMLP) -> None:
    """Drop the value_info of the tensors the fused node no longer makes (before its nodes leave ``graph``)."""
    gone = {o for i in mlp.dropped for o in graph.node[i].output}
    kept = [v for v in graph.value_info if v.name not in gone]
    if len(kept) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept)


def fuse(gate: Int4Node, up: Int4Node, mlp: GatedMLP, name: str) -> Int4Node | None:
    """The gated node of two INT4 projections of ``mlp``, or None when they differ in what one node must share.

    Both must have the same input, K, group size, width, grid, scale dtype and compute mode, and
    neither be gated already; the codes, scales and biases are stacked gate first.
    """
    same = (
        gate.inputs == up.inputs
        and (gate.k, gate.n, gate.group_size, gate.bits, gate.grid) == (up.k, up.n, up.group_size, up.bits, up.grid)
        and gate.compute == up.compute
        and gate.scales.dtype == up.scales.dtype
        and (gate.super_scales is None) == (up.super_scales is None)
        and gate.gated is None
        and up.gated is None
        and gate.op == up.op
    )
    if not same:
        return None
    bias = stacked_bias(gate.bias, up.bias, gate.n)
    return replace(
        gate,
        name=name,
        outputs=(mlp.output,),
        n=2 * gate.n,
        packed=np.concatenate([gate.packed, up.packed]),
        scales=np.concatenate([gate.scales, up.scales]),
        super_scales=None if gate.super_scales is None else np.concatenate([gate.super_scales, up.super_scales]),
        bias=bias,
        gated=mlp.activation,
    )


def plain_nodes(
    full: str, output: str, half: int, activation: str, prefix: str
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Plain ONNX (opset >= 13) computing a gated node's ``output`` from its full product ``full`` [..., 2 * half].

    For a dequantized twin of an exported model (tests, tools/dequantized_twin.py): Slice the
    halves, then ``g * Sigmoid(t) * u`` with ``t`` as contract.GATED_FORMULAS says.
    """
    from onnx import numpy_helper

    def const(name: str, value: object, dtype: type = np.int64) -> str:
        inits.append(numpy_helper.from_array(np.array(value, dtype), f"{prefix}/{name}"))
        return f"{prefix}/{name}"

    inits: list[onnx.TensorProto] = []
    axis, zero, mid, end = const("axis", [-1]), const("zero", [0]), const("mid", [half]), const("end", [2 * half])
    g, u, t = f"{prefix}/gate", f"{prefix}/up", f"{prefix}/t"
    nodes = [
        helper.make_node("Slice", [full, zero, mid, axis], [g]),
        helper.make_node("Slice", [full, mid, end, axis], [u]),
    ]
    if activation == "silu":
        t = g
    elif activation == "gelu_tanh":
        c1, c2 = const("c1", 0.044715, np.float32), const("c2", 2 * np.sqrt(2 / np.pi), np.float32)
        nodes += [
            helper.make_node("Mul", [g, g], [f"{prefix}/g2"]),
            helper.make_node("Mul", [f"{prefix}/g2", g], [f"{prefix}/g3"]),
            helper.make_node("Mul", [f"{prefix}/g3", c1], [f"{prefix}/cg3"]),
            helper.make_node("Add", [g, f"{prefix}/cg3"], [f"{prefix}/inner"]),
            helper.make_node("Mul", [f"{prefix}/inner", c2], [t]),
        ]
    else:
        raise ValueError(f"gated activation {activation!r} is not one of the contract's")
    nodes += [
        helper.make_node("Sigmoid", [t], [f"{prefix}/s"]),
        helper.make_node("Mul", [g, f"{prefix}/s"], [f"{prefix}/act"]),
        helper.make_node("Mul", [f"{prefix}/act", u], [output]),
    ]
    return nodes, inits
