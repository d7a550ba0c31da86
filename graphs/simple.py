"""Small FP32 graphs: one MatMul, a chain of MatMuls, and an MLP that mixes MatMul and Gemm."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import onnx
from onnx import helper

from ._common import (
    OUTLIER_FRACTION,
    OUTLIER_SCALE,
    float_value_info,
    initializer,
    make_model,
    weight_matrix,
)


def single_matmul(
    k: int,
    n: int,
    *,
    seed: int = 0,
    bias: bool = False,
    outlier_fraction: float = OUTLIER_FRACTION,
    outlier_scale: float = OUTLIER_SCALE,
) -> onnx.ModelProto:
    """Build y = x @ W (+ b): input "x" [M, k], output "y" [M, n], MatMul node "matmul"."""
    rng = np.random.default_rng(seed)
    w = weight_matrix(rng, k, n, outlier_fraction=outlier_fraction, outlier_scale=outlier_scale)
    inits = [initializer("matmul.weight", w)]
    matmul_out = "matmul.output" if bias else "y"
    nodes = [helper.make_node("MatMul", ["x", "matmul.weight"], [matmul_out], name="matmul")]
    if bias:
        b = (0.1 * rng.standard_normal(n)).astype(np.float32)
        inits.append(initializer("matmul.bias", b))
        nodes.append(helper.make_node("Add", [matmul_out, "matmul.bias"], ["y"], name="matmul.bias_add"))
    return make_model(
        "single_matmul",
        nodes,
        [float_value_info("x", ["M", k])],
        [float_value_info("y", ["M", n])],
        inits,
    )


def matmul_chain(n_layers: int, dim: int, *, seed: int = 0) -> onnx.ModelProto:
    """Build n_layers MatMuls [dim, dim] in series, nodes "matmul{i}", from "x" [M, dim] to "y"."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    current = "x"
    for i in range(n_layers):
        # No outliers and std 1/sqrt(dim): activations keep unit scale through any depth.
        w = weight_matrix(rng, dim, dim, outlier_fraction=0.0)
        inits.append(initializer(f"matmul{i}.weight", w))
        out = "y" if i == n_layers - 1 else f"matmul{i}.output"
        nodes.append(helper.make_node("MatMul", [current, f"matmul{i}.weight"], [out], name=f"matmul{i}"))
        current = out
    return make_model(
        "matmul_chain",
        nodes,
        [float_value_info("x", ["M", dim])],
        [float_value_info("y", ["M", dim])],
        inits,
    )


def mlp(
    dims: Sequence[int] = (256, 512, 512, 128),
    *,
    seed: int = 0,
    outlier_fraction: float = OUTLIER_FRACTION,
    outlier_scale: float = OUTLIER_SCALE,
) -> onnx.ModelProto:
    """Build an MLP "x" [batch, dims[0]] -> "y" [batch, dims[-1]]; layer "fc1" (or the only one) is a Gemm.

    Layer i is "fc{i}": MatMul "fc{i}" + Add "fc{i}.bias_add" with weight "fc{i}.weight"
    [K, N], except the Gemm layer, whose node "fc{i}" has transB=1, bias C, and weight
    stored [N, K] as exported PyTorch Linear layers are. Hidden layers end in Relu.
    """
    dims = list(dims)
    if len(dims) < 2:
        raise ValueError(f"mlp needs at least 2 dims, got {dims}")
    n_layers = len(dims) - 1
    gemm_layer = min(1, n_layers - 1)
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    current = "x"
    for i, (k, n) in enumerate(pairwise(dims)):
        name = f"fc{i}"
        last = i == n_layers - 1
        w = weight_matrix(rng, k, n, outlier_fraction=outlier_fraction, outlier_scale=outlier_scale)
        b = (0.1 * rng.standard_normal(n)).astype(np.float32)
        inits.append(initializer(f"{name}.bias", b))
        linear_out = "y" if last else f"{name}.linear"
        if i == gemm_layer:
            inits.append(initializer(f"{name}.weight", w.T))
            nodes.append(
                helper.make_node(
                    "Gemm",
                    [current, f"{name}.weight", f"{name}.bias"],
                    [linear_out],
                    name=name,
                    transB=1,
                )
            )
        else:
            inits.append(initializer(f"{name}.weight", w))
            nodes.append(helper.make_node("MatMul", [current, f"{name}.weight"], [f"{name}.matmul"], name=name))
            nodes.append(
                helper.make_node(
                    "Add",
                    [f"{name}.matmul", f"{name}.bias"],
                    [linear_out],
                    name=f"{name}.bias_add",
                )
            )
        if last:
            break
        nodes.append(helper.make_node("Relu", [linear_out], [f"{name}.output"], name=f"{name}.relu"))
        current = f"{name}.output"
    return make_model(
        "mlp",
        nodes,
        [float_value_info("x", ["batch", dims[0]])],
        [float_value_info("y", ["batch", dims[-1]])],
        inits,
    )
