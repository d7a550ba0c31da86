"""The dequantized-FP32 twin of an exported model: every CimInt4MatMul / CimInt4Gather back to MatMul / Gather.

Each node's weight is ``reference.dequantize`` of its codes and scales (any width, float32, float16
or int8 scales; a gated node's gate in plain ONNX after it, ``exporter.gated.plain_nodes``), so the
twin computes what the op's fp32 compute mode computes, up to summation order, in plain ONNX
Runtime (tools/dequantized_twin.py, the accuracy of widths the op library has no kernels for) or
in ``tune.graph`` (scale tuning). With ``params`` it also lists, per stored set of scales, which
twin initializers it became, so a trainer can rebuild them from new scales (``ScaleParam``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...contract import GATHER, MATMUL_SHARED, Int4Node, is_op_node, levels, scale_values, unpack_codes
from .. import gated

__all__ = ["ScaleParam", "twin"]


@dataclass
class ScaleParam:
    """One stored set of scales: its codes' levels, its scale values, and the twin initializers made of them.

    ``weights``: (twin initializer name, True if it is ``[K, N]`` as a MatMul reads it, False for the
    ``[N, K]`` rows a Gather reads). ``node``: the exported node (attribute form) or the scales
    initializer (input form, shared by a tied table and head) the scales are written back to.
    """

    node: str
    q: np.ndarray = field(repr=False)  # int8 [N, groups * group_size]: each code's level
    scales: np.ndarray = field(repr=False)  # float32 [N, groups]: the values the op computes with
    k: int
    group_size: int
    weights: list[tuple[str, bool]] = field(default_factory=list)

    def rows(self, values: np.ndarray) -> np.ndarray:
        """float32 ``[N, K]``: the weight the scale ``values`` [N, groups] make with these codes."""
        per_element = np.repeat(values.astype(np.float32), self.group_size, axis=1)
        return (self.q * per_element)[:, : self.k]

    def scale_gradient(self, grad_rows: np.ndarray) -> np.ndarray:
        """d loss / d scale [N, groups] from d loss / d weight given as ``[N, K]`` rows."""
        n = self.q.shape[0]
        padded = np.zeros(self.q.shape, np.float32)
        padded[:, : self.k] = grad_rows
        return (padded * self.q).reshape(n, -1, self.group_size).sum(-1)


def _ints(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _param(
    name: str, packed: np.ndarray, values: np.ndarray, k: int, group_size: int, bits: int, grid: str
) -> ScaleParam:
    codes = unpack_codes(packed, bits).astype(np.int64)
    q = levels(bits, grid)[codes].astype(np.int8)
    return ScaleParam(name, q, values.astype(np.float32), k, group_size)


def twin(model: onnx.ModelProto, params: list[ScaleParam] | None = None) -> onnx.ModelProto:
    """``model`` (loaded with its data) with every node of the op library replaced by its FP32 equivalent, in place."""
    inits = {t.name: t for t in model.graph.initializer}
    used: set[str] = set()
    new_nodes, new_inits = [], []
    shared: dict[str, ScaleParam] = {}
    names = [n.name for n in model.graph.node if is_op_node(n) or is_op_node(n, GATHER)]
    if "" in names or len(set(names)) != len(names):
        raise ValueError("every CimInt4MatMul / CimInt4Gather node needs a name of its own (it names its weights)")
    for node in model.graph.node:
        if is_op_node(node) and len(node.input) == 1:
            n = Int4Node.from_node(node)
            p = _param(node.name, n.packed, n.scales, n.k, n.group_size, n.bits, n.grid)
            w = p.rows(p.scales).T
            name = f"{node.name}/dequantized"
            p.weights.append((name, True))
            if params is not None:
                params.append(p)
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w), name))
            y = f"{node.output[0]}/full" if n.gated else node.output[0]  # a gated node: both halves, then its gate
            if n.bias is None:
                new_nodes.append(helper.make_node("MatMul", [node.input[0], name], [y], name=node.name))
            else:
                new_inits.append(numpy_helper.from_array(n.bias.astype(np.float32), f"{name}/bias"))
                mid = f"{node.output[0]}/product"
                new_nodes.append(helper.make_node("MatMul", [node.input[0], name], [mid], name=node.name))
                new_nodes.append(helper.make_node("Add", [mid, f"{name}/bias"], [y]))
            if n.gated:
                nodes, consts = gated.plain_nodes(y, node.output[0], n.outputs_n, n.gated, f"{node.name}/gate")
                new_nodes += nodes
                new_inits += consts
            continue
        if is_op_node(node, MATMUL_SHARED) or is_op_node(node, GATHER):
            attrs = _ints(node)
            gather = node.op_type == GATHER.op_type
            packed_name, scales_name = (node.input[0], node.input[2]) if gather else (node.input[1], node.input[2])
            if scales_name not in shared:
                packed = numpy_helper.to_array(inits[packed_name])
                scales = numpy_helper.to_array(inits[scales_name])
                rows = packed.shape[0]
                if len(node.input) == 4:  # int8 scales and their super-scales
                    supers = numpy_helper.to_array(inits[node.input[3]]).reshape(rows, -1)
                    scales = scale_values(scales.reshape(rows, -1), supers)
                grid = next((a.s.decode() for a in node.attribute if a.name == "grid"), "uniform")
                shared[scales_name] = _param(scales_name, packed, scale_values(scales), attrs["K"],
                                             attrs.get("group_size", 32), attrs.get("bits", 4), grid)  # fmt: skip
                if params is not None:
                    params.append(shared[scales_name])
            used.update(node.input[i] for i in ((0, 2, 3) if gather else (1, 2, 3)) if i < len(node.input))
            p = shared[scales_name]
            table = f"{packed_name}/dequantized"
            name = table if gather else f"{table}/T"
            if name not in {t.name for t in new_inits}:
                rows_kn = p.rows(p.scales)
                new_inits.append(numpy_helper.from_array(rows_kn if gather else np.ascontiguousarray(rows_kn.T), name))
                p.weights.append((name, not gather))
            bias = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "bias"), None)
            if gather:
                new_nodes.append(helper.make_node("Gather", [name, node.input[1]], list(node.output), name=node.name))
            elif bias is None:
                new_nodes.append(helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name))
            else:
                mid, bias_name = f"{node.output[0]}/product", f"{node.name}/bias"
                new_inits.append(numpy_helper.from_array(bias.astype(np.float32), bias_name))
                new_nodes.append(helper.make_node("MatMul", [node.input[0], name], [mid], name=node.name))
                new_nodes.append(helper.make_node("Add", [mid, bias_name], list(node.output)))
            continue
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    kept = [t for t in model.graph.initializer if t.name not in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    return model
