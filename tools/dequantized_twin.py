"""The dequantized-FP32 twin of an exported model: every CimInt4MatMul / CimInt4Gather back to MatMul / Gather.

    python tools/dequantized_twin.py EXPORTED.onnx OUT.onnx

Each node's weight is ``reference.dequantize`` of its codes and scales (any width, float32 or
float16 scales; a gated node's gate in plain ONNX after it, ``exporter.gated.plain_nodes``), so
the twin computes what the op's fp32 compute mode computes, up to
summation order, in plain ONNX Runtime: the accuracy of widths whose kernels are not in the
op library yet can be measured (``cim-int4 perplexity`` on a genai folder holding the twin).
A genai folder's side files (genai_config.json, tokenizer) are copied next to OUT.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import onnx
from cim_int4.exporter import gated
from cim_int4.ops.reference import dequantize
from onnx import helper, numpy_helper

from cim_int4.contract import GATHER, MATMUL_SHARED, Int4Node, is_op_node, scale_values

SIDE_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "tokenizer.model")  # fmt: skip


def _ints(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (loaded with its data) with every node of the op library replaced by its FP32 equivalent, in place."""
    inits = {t.name: t for t in model.graph.initializer}
    used: set[str] = set()
    new_nodes, new_inits = [], []
    for node in model.graph.node:
        if is_op_node(node) and len(node.input) == 1:
            n = Int4Node.from_node(node)
            w = dequantize(n.packed, n.scales, n.k, n.group_size, n.bits, grid=n.grid).astype(np.float32)
            name = f"{node.name}/dequantized"
            new_inits.append(numpy_helper.from_array(w, name))
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
            packed = numpy_helper.to_array(inits[packed_name])
            scales = numpy_helper.to_array(inits[scales_name])
            used.update((packed_name, scales_name))
            if len(node.input) == 4:  # int8 scales and their super-scales
                super_scales = numpy_helper.to_array(inits[node.input[3]])
                used.add(node.input[3])
                rows = packed.shape[0]
                scales = scale_values(scales.reshape(rows, -1), super_scales.reshape(rows, -1))
            table = f"{packed_name}/dequantized"
            if table not in {t.name for t in new_inits}:
                grid = next((a.s.decode() for a in node.attribute if a.name == "grid"), "uniform")
                bits = attrs.get("bits", 4)
                w = dequantize(packed, scales, attrs["K"], attrs.get("group_size", 32), bits, grid=grid)
                new_inits.append(numpy_helper.from_array(w.T.astype(np.float32).copy(), table))  # [rows, K]
            if gather:
                new_nodes.append(helper.make_node("Gather", [table, node.input[1]], list(node.output), name=node.name))
            else:
                t = f"{table}/T"
                if t not in {x.name for x in new_inits}:
                    w = numpy_helper.to_array(next(x for x in new_inits if x.name == table))
                    new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), t))
                new_nodes.append(helper.make_node("MatMul", [node.input[0], t], list(node.output), name=node.name))
            continue
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    kept = [t for t in model.graph.initializer if t.name not in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + new_inits)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("output")
    args = parser.parse_args()
    src, out = Path(args.model), Path(args.output)
    model = twin(onnx.load(src))
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out, save_as_external_data=True, location=out.name + ".data")
    for name in SIDE_FILES:
        if (src.parent / name).exists() and src.parent != out.parent:
            shutil.copy(src.parent / name, out.parent / name)


if __name__ == "__main__":
    main()
