"""GroupQueryAttention alone at a decode step: its KV cache shared with the present outputs (as genai binds
it) or fed as arrays with the presents apart (as a plain session.run feeds it), per node, 1 and 2 threads.

    python tools/gqa_bench.py [--heads 9] [--kv-heads 3] [--head-size 64] [--past 32] [--capacity 64 512 2048]

Defaults: SmolLM2-135M's attention (docs/real-llm.md, "the KV cache as genai binds it"). A graph of 30
GroupQueryAttention nodes (one per layer of that model) on one packed QKV input, rotary on, timed in
blocks of 30 steps; prints microseconds per node.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from cim_int4.bench.machine import cpu_model
from cim_int4.op_profile import timed_runs

NODES = 30
ROTARY_POSITIONS = 8192


def graph(heads: int, kv_heads: int, size: int, capacity: int) -> bytes:
    width = (heads + 2 * kv_heads) * size
    rng = np.random.default_rng(0)
    caches = [helper.make_tensor(name, TensorProto.FLOAT, [ROTARY_POSITIONS, size // 2],
                                 rng.standard_normal(ROTARY_POSITIONS * size // 2).astype(np.float32))
              for name in ("cos", "sin")]  # fmt: skip
    kv = [1, kv_heads, capacity, size]
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, width]),
              helper.make_tensor_value_info("past_k", TensorProto.FLOAT, kv),
              helper.make_tensor_value_info("past_v", TensorProto.FLOAT, kv),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]  # fmt: skip
    nodes, outputs = [], []
    for i in range(NODES):
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total", "cos", "sin"],
            [f"out{i}", f"present_k{i}", f"present_v{i}"], domain="com.microsoft", num_heads=heads,
            kv_num_heads=kv_heads, scale=size**-0.5, do_rotary=1, local_window_size=-1))  # fmt: skip
        outputs += [helper.make_tensor_value_info(f"{n}{i}", TensorProto.FLOAT, None)
                    for n in ("out", "present_k", "present_v")]  # fmt: skip
    model = helper.make_model(helper.make_graph(nodes, "gqa", inputs, outputs, caches), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def per_node_us(args, threads: int, capacity: int, shared: bool) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    session = ort.InferenceSession(graph(args.heads, args.kv_heads, args.head_size, capacity), so,
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    width = (args.heads + 2 * args.kv_heads) * args.head_size
    kv = [np.zeros((1, args.kv_heads, capacity, args.head_size), np.float32) for _ in range(2)]
    binding = session.io_binding()
    binding.bind_cpu_input("qkv", np.random.default_rng(1).random((1, 1, width), dtype=np.float32))
    binding.bind_cpu_input("seqlens_k", np.array([args.past], np.int32))
    binding.bind_cpu_input("total", np.array(args.past + 1, np.int32))
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in kv]
    binding.bind_ortvalue_input("past_k", values[0])
    binding.bind_ortvalue_input("past_v", values[1])
    for i in range(NODES):
        binding.bind_output(f"out{i}")
        for j, name in enumerate((f"present_k{i}", f"present_v{i}")):
            if shared:
                binding.bind_ortvalue_output(name, values[j])
            else:
                binding.bind_output(name)
    timed_runs(session, binding, 20)  # warm-up
    return statistics.median(timed_runs(session, binding, 200)) * 1e6 / NODES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--past", type=int, default=32)
    parser.add_argument("--capacity", type=int, nargs="+", default=[64, 512, 2048])
    args = parser.parse_args()
    if min(args.capacity) < args.past + 1:
        parser.error(f"every --capacity must hold past + 1 = {args.past + 1} positions")
    for capacity in args.capacity:
        for threads in (1, 2):
            shared = per_node_us(args, threads, capacity, True)
            fed = per_node_us(args, threads, capacity, False)
            print(f"capacity {capacity:5d}, {threads} thread(s): {shared:6.1f} us a node shared, {fed:6.1f} us fed")
    print(f"CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
