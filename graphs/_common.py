"""Shared pieces of the graph builders: version numbers, weight generation, model assembly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# ai.onnx opset every builder targets; 17 keeps ReduceMean's `axes` an attribute.
OPSET = 17
# onnx >= 1.16 stamps IR 10+ by default, which older onnxruntime releases refuse to load.
IR_VERSION = 8
PRODUCER = "cim_int4.graphs"

# Defaults for the outlier columns (output channels) planted in weights, mimicking the
# few channels of real LLM weights whose magnitude is far above the rest.
OUTLIER_FRACTION = 0.01
OUTLIER_SCALE = 10.0

Dim = int | str


def weight_matrix(
    rng: np.random.Generator,
    k: int,
    n: int,
    *,
    std: float | None = None,
    outlier_fraction: float = OUTLIER_FRACTION,
    outlier_scale: float = OUTLIER_SCALE,
) -> np.ndarray:
    """Return a float32 [k, n] matrix ~ N(0, std) (std defaults to 1/sqrt(k)) with outlier columns."""
    std = 1.0 / np.sqrt(k) if std is None else std
    w = rng.standard_normal((k, n), dtype=np.float32)
    w *= np.float32(std)
    if outlier_fraction > 0.0 and outlier_scale != 1.0:
        # At least one column, so small test shapes still carry an outlier.
        count = min(n, max(1, round(outlier_fraction * n)))
        cols = rng.choice(n, size=count, replace=False)
        w[:, cols] *= np.float32(outlier_scale)
    return w


def initializer(name: str, array: np.ndarray) -> onnx.TensorProto:
    """Wrap a NumPy array as a named initializer."""
    return numpy_helper.from_array(np.ascontiguousarray(array), name=name)


def float_value_info(name: str, shape: Sequence[Dim]) -> onnx.ValueInfoProto:
    """Declare a float32 graph input/output with static (int) or symbolic (str) dims."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def make_model(
    graph_name: str,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto],
) -> onnx.ModelProto:
    """Assemble a graph into a model pinned to OPSET and IR_VERSION."""
    graph = helper.make_graph(
        list(nodes),
        graph_name,
        list(inputs),
        list(outputs),
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER)
    model.ir_version = IR_VERSION
    return model
