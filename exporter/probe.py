"""The sensitivity analysis's probe: the export's rewrite with ``x @ W`` in place of CimInt4MatMul, W fed per run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .operands import Plan
from .options import ExportOptions
from .rewrite import Rewriter, run_rewrite

# Probe weights are named from this prefix.
PROBE_PREFIX = "cim_int4.probe."


@dataclass(frozen=True)
class Candidate:
    """An eligible MatMul/Gemm of a probe model: its key, probe weight name, weight [K, N] and bias [N] (or None)."""

    key: str  # subgraph path + label, as in the summary; unique in the model
    weight_name: str
    w: np.ndarray
    bias: np.ndarray | None


class ProbeRewriter(Rewriter):
    """Emits ``MatMul(x, W) [+ bias]`` where the export writes CimInt4MatMul, W a main-graph initializer per node."""

    def __init__(self, model: onnx.ModelProto, options: ExportOptions) -> None:
        super().__init__(model, options)
        self.candidates: list[Candidate] = []
        self.probe_weights: list[onnx.TensorProto] = []

    def core(
        self, base: str, key: str, x: str, out: str, plan: Plan, initializers: list[onnx.TensorProto]
    ) -> tuple[list[onnx.NodeProto], int | None]:
        w_name = self.fresh(f"{PROBE_PREFIX}{len(self.candidates)}.weight")
        self.probe_weights.append(numpy_helper.from_array(plan.w, w_name))
        self.candidates.append(Candidate(key, w_name, plan.w, plan.bias))
        if plan.bias is None:
            return [helper.make_node("MatMul", [x, w_name], [out], name=base)], None
        b_name = self.fresh(f"{w_name[: -len('weight')]}bias")
        initializers.append(numpy_helper.from_array(plan.bias, b_name))
        product = self.fresh(f"{out}/matmul")
        return [
            helper.make_node("MatMul", [x, w_name], [product], name=base),
            helper.make_node("Add", [product, b_name], [out], name=f"{base}/bias"),
        ], None


def probe_model(model: onnx.ModelProto, options: ExportOptions) -> tuple[onnx.ModelProto, list[Candidate]]:
    """A copy of ``model`` in which each eligible node computes ``x @ W (+ bias)`` with W overridable, and the nodes.

    Around each product are the same Casts, Transpose, Unsqueeze and Add the export writes, so
    feeding a node's dequantized INT4 weight at ``Candidate.weight_name`` gives its INT4 error.
    """
    out, rewriter = run_rewrite(model, options, lambda m: ProbeRewriter(m, options))
    assert isinstance(rewriter, ProbeRewriter)
    graph = out.graph
    graph.initializer.extend(rewriter.probe_weights)
    graph.input.extend(
        helper.make_tensor_value_info(t.name, onnx.TensorProto.FLOAT, list(t.dims)) for t in rewriter.probe_weights
    )
    return out, rewriter.candidates
