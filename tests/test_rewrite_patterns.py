"""One small graph per pattern the exporter handles beyond a plain initializer weight.

Folded producers, [1, K, N] weights, initializers listed as inputs, skip reasons, onnxsim,
subgraphs, Gemm biases that stay an Add, fp16/bf16 behind Casts, a stray opset import.
Each quantized model is run in ORT and checked twice: against the same graph with the
reference-dequantized weights (the rewrite is exact up to FP32 rounding) and against the
FP32 original (the right weight, in the right orientation, was quantized).
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from cim_int4.exporter import export_with_summary
from cim_int4.exporter.fold import COMPUTED
from conftest import check, init, model_of, w
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import NothingToQuantize, make_session
from cim_int4.contract import OP_TYPE

K, N, M = 64, 48, 3
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def x(seed: int = 9, *shape: int, dtype=np.float32) -> np.ndarray:  # noqa: ANN001
    return w(seed, *(shape or (M, K)), dtype=dtype)


# ---------------------------------------------------------------- 1. folded weight producers


def test_transpose_of_initializer_is_folded_and_dropped() -> None:
    nodes = [
        helper.make_node("Transpose", ["wt"], ["w"], name="tied", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="lm_head"),
    ]
    model = model_of(nodes, [("x", ["M", K])], [("y", ["M", N])], [init("wt", w(0, N, K))])
    q, summary = export_with_summary(model)
    assert [r.name for r in summary.rewritten] == ["lm_head"] and not summary.skipped
    assert [n.op_type for n in q.graph.node] == [OP_TYPE] and not q.graph.initializer
    check(model, q, {"x": x()})


def test_chain_of_foldable_ops_from_a_constant_node() -> None:
    flat = numpy_helper.from_array(w(1, K * N, dtype=np.float16), "flat")
    nodes = [
        helper.make_node("Constant", [], ["flat"], value=flat),
        helper.make_node("Constant", [], ["shape"], value=init("shape", np.array([1, K, N], np.int64))),
        helper.make_node("Reshape", ["flat", "shape"], ["r"], name="reshape"),
        helper.make_node("Cast", ["r"], ["c"], name="cast", to=F32),
        helper.make_node("Identity", ["c"], ["i"], name="dedup"),
        helper.make_node("Squeeze", ["i", "axes0"], ["s"], name="squeeze"),
        helper.make_node("Unsqueeze", ["s", "axes0"], ["u"], name="unsqueeze"),
        helper.make_node("Squeeze", ["u", "axes0"], ["wk"], name="squeeze2"),
        helper.make_node("MatMul", ["x", "wk"], ["y"], name="mm"),
    ]
    model = model_of(nodes, [("x", ["M", K])], [("y", ["M", N])], [init("axes0", np.array([0], np.int64))])
    q, summary = export_with_summary(model)
    assert [r.name for r in summary.rewritten] == ["mm"]
    assert [n.op_type for n in q.graph.node] == [OP_TYPE], "every link of the chain is unused now"
    check(model, q, {"x": x()})


def test_producer_still_read_elsewhere_stays() -> None:
    nodes = [
        helper.make_node("Transpose", ["wt"], ["w"], name="tied", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("ReduceSum", ["w"], ["s"], name="other", keepdims=0),
    ]
    model = model_of(nodes, [("x", ["M", K])], [("y", ["M", N])], [init("wt", w(0, N, K))])
    model.graph.output.append(helper.make_tensor_value_info("s", F32, None))
    q, _ = export_with_summary(model)
    assert [n.op_type for n in q.graph.node] == ["Transpose", OP_TYPE, "ReduceSum"]
    assert [t.name for t in q.graph.initializer] == ["wt"]
    check(model, q, {"x": x()})


@pytest.mark.parametrize(
    ("x_shape", "unsqueezed", "opset"),
    [([2, M, K], False, 17), ([M, K], True, 17), ([K], True, 17), ([M, K], True, 11)],  # 11: axes as attribute
)
def test_unit_batch_weight_is_squeezed(x_shape: list[int], unsqueezed: bool, opset: int) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="bmm")]
    model = model_of(nodes, [("x", x_shape)], [("y", None)], [init("w", w(2, 1, K, N))], opset=opset)
    q, summary = export_with_summary(model)
    assert [r.name for r in summary.rewritten] == ["bmm"]
    assert ("Unsqueeze" in [n.op_type for n in q.graph.node]) == unsqueezed
    check(model, q, {"x": x(9, *x_shape)})


def test_unit_batch_weight_input_rank_from_shape_inference() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"], name="bmm")]
    model = model_of(nodes, [("x", [M, K])], [("y", None)], [init("w", w(2, 1, K, N))])
    q, _ = export_with_summary(model)  # h has no declared shape: its rank comes from onnx shape inference
    assert [n.op_type for n in q.graph.node] == ["Relu", OP_TYPE, "Unsqueeze"]
    check(model, q, {"x": x()})


def test_unit_batch_weight_with_input_of_unknown_rank_is_skipped() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="bmm")]
    model = model_of(nodes, [("x", None)], [("y", None)], [init("w", w(2, 1, K, N))])
    with pytest.raises(NothingToQuantize) as info:
        export_with_summary(model)
    (skipped,) = info.value.summary.skipped
    assert "rank of input 'x' is unknown" in skipped.reason


def input_initializer_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h"], name="folded"),
        helper.make_node("MatMul", ["h", "w1"], ["y"], name="shared"),
        helper.make_node("ReduceSum", ["w1"], ["s"], name="reads_w1", keepdims=0),
    ]
    model = model_of(nodes, [("x", ["M", K])], [("y", ["M", K])], [init("w0", w(0, K, K)), init("w1", w(1, K, K))])
    model.graph.input.extend(helper.make_tensor_value_info(n, F32, [K, K]) for n in ("w0", "w1"))
    model.graph.output.append(helper.make_tensor_value_info("s", F32, None))
    return model


@pytest.mark.parametrize("fold", [None, True])
def test_input_initializers_are_quantized(fold: bool | None) -> None:
    model = input_initializer_model()
    q, summary = export_with_summary(model, fold_input_initializers=fold)
    assert [r.name for r in summary.rewritten] == ["folded", "shared"]
    warned = [m for m in summary.warnings if "also listed as graph inputs" in m]
    assert len(warned) == (1 if fold is None else 0)
    # w0 is gone (input too); w1 is still read by ReduceSum, so it stays an input and an initializer.
    assert [i.name for i in q.graph.input] == ["x", "w1"]
    assert [t.name for t in q.graph.initializer] == ["w1"]
    check(model, q, {"x": x()})
    with pytest.raises(Exception, match="Invalid input name: w0"):  # loud, not a silently ignored feed
        make_session(q, threads=1).run(None, {"x": x(), "w0": w(0, K, K)})


def test_input_initializers_stay_with_no_fold() -> None:
    with pytest.raises(NothingToQuantize, match="also listed as a graph input"):
        export_with_summary(input_initializer_model(), fold_input_initializers=False)


def computed_weight_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Mul", ["w", "two"], ["w2"], name="scale"),
        helper.make_node("Transpose", ["w2"], ["w2t"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w2t"], ["h"], name="behind_mul"),
        helper.make_node("Transpose", ["h"], ["ht"], name="ht", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "ht"], ["y"], name="scores"),
    ]
    inits = [init("w", w(0, K, K)), init("two", np.array(2.0, np.float32))]
    return model_of(nodes, [("x", ["M", K])], [("y", ["M", "M"])], inits)


def test_skip_reasons_tell_activations_from_unfolded_constants() -> None:
    with pytest.raises(NothingToQuantize) as info:
        export_with_summary(computed_weight_model())
    reasons = {s.name: s.reason for s in info.value.summary.skipped}
    assert reasons == {
        "behind_mul": "weight 'w2' is constant, but behind an op we do not fold (Mul 'scale')",
        "scores": COMPUTED,
    }


def test_skip_reasons_for_a_constant_first_operand_and_a_graph_input_weight() -> None:
    nodes = [
        helper.make_node("MatMul", ["w", "x"], ["y"], name="w_at_x"),
        helper.make_node("MatMul", ["x", "fed"], ["z"], name="x_at_fed"),
    ]
    model = model_of(nodes, [("x", [K, K]), ("fed", [K, K])], [("y", [K, K]), ("z", [K, K])], [init("w", w(0, K, K))])
    with pytest.raises(NothingToQuantize) as info:
        export_with_summary(model)
    reasons = {s.name: s.reason for s in info.value.summary.skipped}
    assert reasons == {
        "w_at_x": "the constant is the first operand ('w'); only x @ W is quantized",
        "x_at_fed": "weight 'fed' is a graph input (fed at run time)",
    }


def test_simplify_folds_what_we_do_not() -> None:
    pytest.importorskip("onnxsim")
    model = computed_weight_model()
    q, summary = export_with_summary(model, simplify=True)
    assert [r.name for r in summary.rewritten] == ["behind_mul"] and not summary.warnings
    check(model, q, {"x": x()})


@pytest.mark.parametrize("failure", ["missing", "raises"])
def test_simplify_failure_continues_unsimplified(failure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if failure == "missing":
        monkeypatch.setitem(sys.modules, "onnxsim", None)  # import fails as if not installed
    else:
        onnxsim = pytest.importorskip("onnxsim")

        def broken(model: onnx.ModelProto) -> None:
            raise RuntimeError("no luck\nsecond line")

        monkeypatch.setattr(onnxsim, "simplify", broken)
    model = input_initializer_model()
    q, summary = export_with_summary(model, simplify=True, fold_input_initializers=True)
    assert len(summary.rewritten) == 2
    expected = "onnxsim is not installed" if failure == "missing" else "onnxsim failed (RuntimeError: no luck)"
    assert expected in summary.warnings[0] and "continuing unsimplified" in summary.warnings[0]
    assert "\n" not in summary.warnings[0]
