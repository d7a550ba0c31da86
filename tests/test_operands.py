"""exporter.operands: a MatMul's or Gemm's plan (weight [K, N], bias, Casts, Transpose) or why it is ineligible."""

from __future__ import annotations

import numpy as np
import pytest
from cim_int4.exporter.fold import Scope
from cim_int4.exporter.operands import Ineligible, plan_gemm, plan_matmul
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)


def _scope(node, *tensors) -> Scope:  # noqa: ANN001
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], list(tensors),
    )
    return Scope(graph)


def test_matmul_plan_is_the_weight_as_it_is() -> None:
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    plan = plan_matmul(node, _scope(node, numpy_helper.from_array(W, "w")), lambda _: 2)
    np.testing.assert_array_equal(plan.w, W)
    assert (plan.bias, plan.unsqueeze, plan.trans_a, plan.notes) == (None, 0, False, "")


def test_unit_batch_weight_is_squeezed_with_an_unsqueeze_for_a_rank_1_input() -> None:
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    plan = plan_matmul(node, _scope(node, numpy_helper.from_array(W[None], "w")), lambda _: 1)
    assert plan.w.shape == (4, 3) and plan.unsqueeze == 1


def test_gemm_folds_alpha_trans_b_and_beta_c_into_weight_and_bias() -> None:
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], alpha=2.0, beta=0.5, transB=1, transA=1)
    c = np.arange(3, dtype=np.float32)
    plan = plan_gemm(node, _scope(node, numpy_helper.from_array(W.T.copy(), "w"), numpy_helper.from_array(c, "c")))
    np.testing.assert_array_equal(plan.w, W * 2)
    np.testing.assert_array_equal(plan.bias, c * np.float32(0.5))
    assert plan.trans_a and plan.add is None and "transA" in plan.notes


def test_gemm_input_c_stays_an_add_after_the_op() -> None:
    node = helper.make_node("Gemm", ["x", "w", "x"], ["y"])
    plan = plan_gemm(node, _scope(node, numpy_helper.from_array(W, "w")))
    assert plan.bias is None and plan.add == "x" and "kept as an Add" in plan.notes


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (numpy_helper.from_array(W.astype(np.float64), "w"), "only FLOAT, FLOAT16 and BFLOAT16"),
        (None, "not defined"),
    ],
)
def test_ineligible_weights_say_why(weight, message: str) -> None:  # noqa: ANN001
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    with pytest.raises(Ineligible, match=message):
        plan_matmul(node, _scope(node, *([weight] if weight is not None else [])), lambda _: 2)
