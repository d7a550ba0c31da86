"""CimInt4Gather vs ORT GatherBlockQuantized on one random int4 table: exactness and time per call (docs/embeddings.md).

    .venv/bin/python tools/gather_bench.py ROWS K

One intra-op thread; 7 interleaved rounds per batch of indices; medians and minima in us/call.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from cim_int4.ops import library_path, reference
from onnx import TensorProto, helper, numpy_helper

GROUP = 32


def main() -> None:
    rows, k = int(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(0)
    groups = -(-k // GROUP)
    packed = rng.integers(0, 256, (rows, groups * GROUP // 2), dtype=np.uint8)
    scales = (rng.standard_normal((rows, groups)) * 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(packed, "P"), numpy_helper.from_array(scales, "S")]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])
    opsets = [helper.make_opsetid(d, v) for d, v in (("", 17), ("dbhoo.cim", 1), ("com.microsoft", 1))]

    def model(node: onnx.NodeProto) -> bytes:
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        graph = helper.make_graph([node], "g", [ids], [y], initializer=inits)
        return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()

    # Whole groups: GatherBlockQuantized returns K_padded values per row, so K is padded here.
    k_padded = groups * GROUP
    nodes = {
        "CimInt4Gather": helper.make_node("CimInt4Gather", ["P", "ids", "S"], ["y"], domain="dbhoo.cim",
                                          K=k_padded, group_size=GROUP),
        "GatherBlockQuantized": helper.make_node("GatherBlockQuantized", ["P", "ids", "S"], ["y"],
                                                 domain="com.microsoft", bits=4, block_size=GROUP, gather_axis=0,
                                                 quantize_axis=1),
    }
    sessions = {}
    for name, node in nodes.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.register_custom_ops_library(library_path())
        sessions[name] = ort.InferenceSession(model(node), so, providers=["CPUExecutionProvider"])
    for count in (1, 16, 256):
        x = rng.integers(-rows, rows, (1, count)).astype(np.int64)
        ref = reference.gather(packed, scales, x, k_padded, GROUP)
        times: dict[str, list[float]] = {}
        for _ in range(7):
            for name, s in sessions.items():
                y = s.run(None, {"ids": x})[0]
                assert np.array_equal(y.view(np.uint32), ref.view(np.uint32)), name
                calls = 2000 if count < 256 else 200
                start = time.perf_counter()
                for _ in range(calls):
                    s.run(None, {"ids": x})
                times.setdefault(name, []).append((time.perf_counter() - start) / calls * 1e6)
        cells = ", ".join(f"{n} {np.median(t):.1f} us/call (min {min(t):.1f})" for n, t in times.items())
        print(f"rows={rows} K={k} indices/call={count}: {cells}; both bit-exact vs reference")


if __name__ == "__main__":

    main()
