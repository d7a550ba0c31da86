"""A genai folder's weight nodes alone (CimInt4MatMul or MatMulNBits, the LM head included), timed at 1 and 2
threads beside the whole decode step: how much of a step the weight ops take in ORT (docs/real-llm.md,
"the KV cache as genai binds it").

    python tools/weights_only.py FOLDER [--threads 1 2] [--rounds 20] [--past 32]

The weight nodes keep their attributes and constant inputs; each reads a graph input of its K (random
activations, bound once), its output a graph output, in the decoder's order, ORT's arena on. The whole
step is tools/step_ab.py's (cim_int4.op_profile.bind_step). The two alternate block by block.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from cim_int4.ops import library_path
from onnx import TensorProto, helper

from cim_int4.bench.machine import cpu_model
from cim_int4.genai_bench import decoder_file
from cim_int4.op_profile import WEIGHT_OPS, bind_step, interleaved_blocks
from cim_int4.perplexity import open_model


def weights_graph(decoder) -> onnx.ModelProto:
    model = onnx.load(decoder)  # external data read in: the graph is written to memory, not beside the folder
    nodes, inputs, outputs = [], {}, []
    for node in model.graph.node:
        if node.op_type not in WEIGHT_OPS - {"MatMul", "Gemm"}:
            continue
        k = next((a.i for a in node.attribute if a.name == "K"), None)
        if k is None:
            sys.exit(f"{decoder}: weight node {node.name!r} has no K attribute")
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[0] = f"a{k}"
        inputs.setdefault(copy.input[0], helper.make_tensor_value_info(copy.input[0], TensorProto.FLOAT, [1, 1, k]))
        copy.output[:] = [f"{name}.alone" for name in node.output]
        outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in copy.output]
        nodes.append(copy)
    if not nodes:
        sys.exit(f"{decoder}: no CimInt4MatMul or MatMulNBits node")
    used = {name for node in nodes for name in node.input}
    graph = helper.make_graph(nodes, "weights", list(inputs.values()), outputs,
                              [i for i in model.graph.initializer if i.name in used])  # fmt: skip
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--past", type=int, default=32)
    args = parser.parse_args()
    graph = weights_graph(decoder_file(args.folder))
    nodes = len(graph.graph.node)
    alone = graph.SerializeToString()
    rng = np.random.default_rng(0)
    for threads in args.threads:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.register_custom_ops_library(library_path())
        weights = ort.InferenceSession(alone, so, providers=["CPUExecutionProvider"])
        binding = weights.io_binding()
        for inp in weights.get_inputs():
            binding.bind_cpu_input(inp.name, rng.standard_normal(inp.shape).astype(np.float32))
        for out in weights.get_outputs():
            binding.bind_output(out.name)
        step = open_model(args.folder, threads=threads)
        step_binding = bind_step(step, args.past)
        times = interleaved_blocks([(weights, binding), (step.session, step_binding)], args.rounds)
        ms = [statistics.median(t) * 1e3 for t in times]
        print(f"{threads} thread(s): the {nodes} weight nodes alone {ms[0]:.2f} ms, the whole step {ms[1]:.2f} ms "
              f"({ms[0] / ms[1]:.0%})")
        del weights, binding, step, step_binding
    print(f"CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
